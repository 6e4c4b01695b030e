"""Streaming at 224 px: jaxtrain's Grain loader against a PyTorch DataLoader, and the
share of a ResNet-18 step spent waiting for input.

The folder: real photographs (scikit-image's sample photos, 9 of them) cut
into --images JPEG files of mixed sizes, about ImageNet's (300-600 px a side,
quality 90), in 8 class folders. Both loaders do the ImageNet training
transform on every image: decode, random-resized crop (8-100 % of the area,
aspect 3/4-4/3) to 224 x 224, random horizontal flip, uint8 HWC, batches of
--batch, with --workers worker processes:

  jaxtrain  python -m jaxtrain.bench --config=configs/imagenet_resnet50.py --input-only
            (Grain workers; the batch put on the device, as training gets it)
  PyTorch   torch.utils.data.DataLoader(num_workers=W, shuffle=True) over an
            ImageFolder-style Dataset doing what torchvision's RandomResizedCrop
            and RandomHorizontalFlip do to a Pillow image (open, convert('RGB'),
            crop, resize BILINEAR, flip), written out here as torchvision is not
            installed

Each loader runs in its own process (neither forks the other's threads),
--rounds times, alternating, first batch (worker start-up) excluded; the
median round is reported. Then a streamed ResNet-18 run (the ImageNet recipe
with model.name=resnet18, --train_steps steps at 224 px) reports
input_wait_fraction from its summary.json. One JSON document on stdout:

    python3 benchmarks/stream_loader.py [--dir DIR] [--images 640] [--batch 64]
        [--workers 2] [--batches 20] [--rounds 3] [--train_steps 6]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_DIR = os.path.join(tempfile.gettempdir(), 'jaxtrain_bench', 'photos_224')
PHOTOS = ('astronaut.png', 'chelsea.png', 'coffee.png', 'hubble_deep_field.jpg', 'ihc.png',
          'motorcycle_left.png', 'motorcycle_right.png', 'retina.jpg', 'rocket.jpg')


def ensure_folder(directory, images):
    """train/ and test/ (one eighth as many) of JPEG crops of the sample photographs."""
    if os.path.isdir(os.path.join(directory, 'train')):
        return directory
    import skimage
    from PIL import Image

    sources = [Image.open(os.path.join(os.path.dirname(skimage.__file__), 'data', name))
               .convert('RGB') for name in PHOTOS]
    rng = np.random.default_rng(0)
    for split, count in (('train', images), ('test', max(images // 8, 8))):
        for i in range(count):
            photo = sources[i % len(sources)]
            w, h = photo.size
            cw, ch = int(rng.integers(w // 2, w + 1)), int(rng.integers(h // 2, h + 1))
            left, top = int(rng.integers(0, w - cw + 1)), int(rng.integers(0, h - ch + 1))
            crop = photo.crop((left, top, left + cw, top + ch))
            side = int(rng.integers(300, 601))  # the longer side, as ImageNet's vary
            scale = side / max(cw, ch)
            crop = crop.resize((max(1, round(cw * scale)), max(1, round(ch * scale))),
                               Image.Resampling.BICUBIC)
            folder = os.path.join(directory, split, f'class_{i % 8}')
            os.makedirs(folder, exist_ok=True)
            crop.save(os.path.join(folder, f'{i:05d}.jpg'), quality=90)
    return directory


# ---------------------------------------------------------------- the PyTorch side

class PhotoFolder:
    """ImageFolder-style: (uint8 HWC 224 x 224 x 3, label) with torchvision's
    RandomResizedCrop + RandomHorizontalFlip done on the Pillow image."""

    def __init__(self, root, size=224, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)):
        classes = sorted(os.listdir(os.path.join(root, 'train')))
        self.files = [(os.path.join(root, 'train', c, f), label)
                      for label, c in enumerate(classes)
                      for f in sorted(os.listdir(os.path.join(root, 'train', c)))]
        self.size, self.scale, self.ratio = size, scale, ratio

    def __len__(self):
        return len(self.files)

    def crop_box(self, w, h):
        import math
        import random
        area = w * h
        log_ratio = (math.log(self.ratio[0]), math.log(self.ratio[1]))
        for _ in range(10):
            target = area * random.uniform(*self.scale)
            aspect = math.exp(random.uniform(*log_ratio))
            cw, ch = round(math.sqrt(target * aspect)), round(math.sqrt(target / aspect))
            if 0 < cw <= w and 0 < ch <= h:
                left, top = random.randint(0, w - cw), random.randint(0, h - ch)
                return left, top, left + cw, top + ch
        return 0, 0, w, h

    def __getitem__(self, i):
        import random

        import torch
        from PIL import Image
        path, label = self.files[i]
        with Image.open(path) as im:
            im = im.convert('RGB')
        im = im.crop(self.crop_box(*im.size)).resize((self.size, self.size),
                                                     Image.Resampling.BILINEAR)
        if random.random() < 0.5:
            im = im.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        return torch.from_numpy(np.asarray(im).copy()), label


def torch_loader(directory, batch, workers, batches) -> dict:
    import torch
    import torch.utils.data
    torch.manual_seed(0)
    loader = torch.utils.data.DataLoader(PhotoFolder(directory), batch_size=batch, shuffle=True,
                                         num_workers=workers, drop_last=True,
                                         persistent_workers=True)
    start = time.perf_counter()
    it = iter(loader)
    images, _ = next(it)
    first = time.perf_counter() - start
    assert images.shape == (batch, 224, 224, 3) and images.dtype == torch.uint8
    start, done = time.perf_counter(), 0
    while done < batches:
        for images, _ in it:
            done += 1
            if done == batches:
                break
        else:
            it = iter(loader)
    seconds = time.perf_counter() - start
    return {"images_per_second": batches * batch / seconds, "first_batch_seconds": first}


# ---------------------------------------------------------------- the rounds

def jaxtrain_round(directory, batch, workers, batches, scratch) -> dict:
    out = os.path.join(scratch, 'jaxtrain.json')
    subprocess.run([sys.executable, '-m', 'jaxtrain.bench', '--config=configs/imagenet_resnet50.py',
                    '--input-only', f'--batches={batches}', f'--json={out}',
                    f'--config.data.dir={directory}', f'--config.data.workers={workers}',
                    f'--config.train.batch_size={batch}'], cwd=REPO, check=True,
                   stdout=subprocess.DEVNULL)
    with open(out) as f:
        result = json.load(f)
    return {k: result[k] for k in ("images_per_second", "first_batch_seconds")}


def torch_round(directory, batch, workers, batches) -> dict:
    command = [sys.executable, os.path.abspath(__file__), '--torch_only', f'--dir={directory}',
               f'--batch={batch}', f'--workers={workers}', f'--batches={batches}']
    done = subprocess.run(command, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def resnet18_wait(directory, batch, workers, steps, scratch) -> dict:
    workdir = os.path.join(scratch, 'resnet18')
    subprocess.run([sys.executable, 'main.py', '--config=configs/imagenet_resnet50.py',
                    f'--workdir={workdir}', f'--config.data.dir={directory}',
                    '--config.model.name=resnet18', f'--config.data.workers={workers}',
                    f'--config.train.batch_size={batch}', f'--config.train.num_steps={steps}',
                    f'--config.train.log_every_steps={steps}', '--config.eval.batch_size=40'],
                   cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(workdir, 'summary.json')) as f:
        summary = json.load(f)
    return {"input_wait_fraction": summary["input_wait_fraction"], "steps": steps,
            "batch_size": batch, "images_per_second": summary["images_per_second"],
            "model": "resnet18", "image_size": 224}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--dir', default=DEFAULT_DIR)
    parser.add_argument('--images', type=int, default=640)
    parser.add_argument('--batch', type=int, default=64)
    parser.add_argument('--workers', type=int, default=2)
    parser.add_argument('--batches', type=int, default=20)
    parser.add_argument('--rounds', type=int, default=3)
    parser.add_argument('--train_steps', type=int, default=6)
    parser.add_argument('--torch_only', action='store_true', help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.torch_only:
        print(json.dumps(torch_loader(args.dir, args.batch, args.workers, args.batches)))
        return
    directory = ensure_folder(args.dir, args.images)
    rounds = {"jaxtrain": [], "torch": []}
    with tempfile.TemporaryDirectory() as scratch:
        for r in range(args.rounds):
            order = ("jaxtrain", "torch") if r % 2 == 0 else ("torch", "jaxtrain")
            for name in order:
                if name == "jaxtrain":
                    rounds[name].append(jaxtrain_round(directory, args.batch, args.workers,
                                                       args.batches, scratch))
                else:
                    rounds[name].append(torch_round(directory, args.batch, args.workers,
                                                    args.batches))
        wait = resnet18_wait(directory, min(args.batch, 32), args.workers, args.train_steps,
                             scratch) if args.train_steps else None
    median = {name: statistics.median(r["images_per_second"] for r in results)
              for name, results in rounds.items()}
    print(json.dumps({
        "images_per_second": median, "ratio": median["jaxtrain"] / median["torch"],
        "rounds": rounds, "batch": args.batch, "workers": args.workers,
        "batches": args.batches, "images": args.images, "image_size": 224,
        "resnet18_stream": wait, "cpus": len(os.sched_getaffinity(0)),
    }, indent=1))


if __name__ == '__main__':
    main()
