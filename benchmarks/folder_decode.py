"""Decode an image folder into arrays: jaxtrain.data.folder.load_folder against the PyTorch way.

The folder is the 60,000 real CIFAR-10 JPEGs (train/ and test/, one folder
per class) that ../shared/data/cifar10_jpeg.py writes. The PyTorch way is an
ImageFolder-style Dataset decoding each file with Pillow (torchvision's
loader: open, convert('RGB'); the same resize and centre crop if
--image_size is set) read once by torch.utils.data.DataLoader(num_workers=2,
batch_size=256) into one array (torchvision itself is not installed here, so
the few lines of Dataset are written out below).

Both read the same files into uint8 (N, H, W, 3) arrays, which are checked to
be identical. With --workers 2, two processes decode on each side: for
load_folder this process and one worker, for the DataLoader its two workers
(while the main process gathers the batches). The page cache is warmed first, then the two alternate for
--rounds rounds in this one process (the machine may be busy with other
work; alternating, with the order swapped every round, shares that out).
One JSON line reports images/s of the median round of each and their ratio,
the best rounds, and CPU time per image (this process and its workers),
which outside load disturbs less than wall time:

    python3 benchmarks/folder_decode.py [--dir DIR] [--workers 2] [--rounds 5] [--image_size N]

DIR (default: a folder under the system temp dir) is written by the shared
script when it lacks train/.
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch
import torch.utils.data
from PIL import Image

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from jaxtrain.data.folder import load_folder  # noqa: E402  (imported before any timing)

SCRIPT = os.path.join(os.path.dirname(REPO), 'shared', 'data', 'cifar10_jpeg.py')
DEFAULT_DIR = os.path.join(tempfile.gettempdir(), 'jaxtrain_bench', 'cifar10_folder')
EXTENSIONS = ('.jpg', '.jpeg', '.png', '.bmp', '.webp')


def ensure_folder(directory, script):
    if not os.path.isdir(os.path.join(directory, 'train')):
        subprocess.run([sys.executable, script, 'folder', directory], check=True,
                       stdout=subprocess.DEVNULL)
    return directory


def warm_page_cache(directory):
    n = 0
    for dirpath, _, names in os.walk(directory):
        for name in names:
            with open(os.path.join(dirpath, name), 'rb') as f:
                f.read()
            n += 1
    return n


# ---------------------------------------------------------------------------
# The PyTorch way
# ---------------------------------------------------------------------------

def torch_load(directory, workers, image_size, batch_size=256):
    class FolderDataset(torch.utils.data.Dataset):
        """split/<class>/<file> -> (uint8 HWC tensor, label), like torchvision's ImageFolder."""

        def __init__(self, split_dir, classes):
            self.samples = []
            for label, cls in enumerate(classes):
                class_dir = os.path.join(split_dir, cls)
                if not os.path.isdir(class_dir):
                    continue
                for name in sorted(os.listdir(class_dir)):
                    if name.lower().endswith(EXTENSIONS):
                        self.samples.append((os.path.join(class_dir, name), label))

        def __len__(self):
            return len(self.samples)

        def __getitem__(self, i):
            path, label = self.samples[i]
            with open(path, 'rb') as f:
                img = Image.open(f).convert('RGB')  # torchvision's pil_loader
            if image_size is not None:
                img = resize_and_crop(img, image_size)
            return torch.from_numpy(np.array(img)), label  # PILToTensor, kept HWC

    train_dir = os.path.join(directory, 'train')
    classes = sorted(e.name for e in os.scandir(train_dir) if e.is_dir())
    splits = [FolderDataset(os.path.join(directory, s), classes) for s in ('train', 'test')]
    loader = torch.utils.data.DataLoader(torch.utils.data.ConcatDataset(splits),
                                         batch_size=batch_size, num_workers=workers, shuffle=False)
    n = sum(len(s) for s in splits)
    first, _ = splits[0][0]
    x = np.empty((n, *first.shape), np.uint8)
    y = np.empty(n, np.int32)
    i = 0
    for xb, yb in loader:
        x[i:i + len(xb)] = xb.numpy()
        y[i:i + len(yb)] = yb.numpy()
        i += len(xb)
    n_train = len(splits[0])
    return x[:n_train], y[:n_train], x[n_train:], y[n_train:]


def resize_and_crop(img, size):
    """Short side to `size`, centre crop: the recipe load_folder documents (BILINEAR, gap 3)."""
    w, h = img.size
    scale = size / min(w, h)
    nw, nh = max(size, round(w * scale)), max(size, round(h * scale))
    if (nw, nh) != (w, h):
        img = img.resize((nw, nh), Image.Resampling.BILINEAR, reducing_gap=3.0)
    left, top = (nw - size) // 2, (nh - size) // 2
    return img.crop((left, top, left + size, top + size))


def jaxtrain_load(directory, workers, image_size):
    ds = load_folder(directory, image_size=image_size, cache_dir=None, workers=workers)
    return ds.x_train, ds.y_train, ds.x_test, ds.y_test


def cpu_seconds():
    """CPU time of this process and its finished children (the decoding workers)."""
    return sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_SELF),
                                                 resource.getrusage(resource.RUSAGE_CHILDREN)))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--dir', default=DEFAULT_DIR)
    parser.add_argument('--script', default=SCRIPT, help='cifar10_jpeg.py, to write --dir if needed')
    parser.add_argument('--workers', type=int, default=2)
    parser.add_argument('--rounds', type=int, default=5)
    parser.add_argument('--image_size', type=int, default=None)
    args = parser.parse_args()

    directory = ensure_folder(args.dir, args.script)
    n_files = warm_page_cache(directory)
    runners = {'jaxtrain': jaxtrain_load, 'torch': torch_load}
    times = {name: [] for name in runners}
    cpu = {name: [] for name in runners}
    results = {}
    for r in range(args.rounds):
        names = list(runners) if r % 2 == 0 else list(runners)[::-1]  # alternate who goes first
        for name in names:
            start, cpu_start = time.perf_counter(), cpu_seconds()
            results[name] = runners[name](directory, args.workers, args.image_size)
            times[name].append(round(time.perf_counter() - start, 3))
            cpu[name].append(round(cpu_seconds() - cpu_start, 3))
    identical = all(np.array_equal(a, b) for a, b in zip(results['jaxtrain'], results['torch']))
    n = len(results['jaxtrain'][0]) + len(results['jaxtrain'][2])
    # The median round: under outside load a single lucky round says little.
    rate = {name: n / float(np.median(t)) for name, t in times.items()}
    best = {name: n / min(t) for name, t in times.items()}
    print(json.dumps({
        'images': n, 'files': n_files, 'workers': args.workers, 'image_size': args.image_size,
        'jaxtrain_images_per_s': round(rate['jaxtrain']), 'torch_images_per_s': round(rate['torch']),
        'ratio_jaxtrain_over_torch': round(rate['jaxtrain'] / rate['torch'], 3),
        'best_round_images_per_s': {k: round(v) for k, v in best.items()},
        'cpu_us_per_image': {k: round(float(np.median(v)) / n * 1e6, 1) for k, v in cpu.items()},
        'seconds': times, 'cpu_seconds': cpu, 'identical_arrays': identical,
        'load_average': [round(v, 2) for v in os.getloadavg()], 'cpus': os.cpu_count(),
    }))


if __name__ == '__main__':
    main()
