"""An image folder read image by image while training (data.placement='stream').

`load_folder` decodes a whole folder into arrays up front; for a training set
too big for that (ImageNet: 1.28 M JPEGs, ~190 GB decoded at 224 px) this
module keeps only the training files' paths and labels, and decodes the images
a batch asks for when it asks (in Grain's worker processes, see
jaxtrain/training/batches.py). The test split is decoded once, as load_folder does it
(and cached), because evaluation reads all of it every time.

The same decoder serves both ways (folder._decode_file: the same checks,
Pillow decoders and resizing), so a folder streamed with resize 'crop' or
'exact' gives exactly the pixels of the decoded arrays. With a random
resized crop (augment.crop='random_resized') each training image is instead
cropped from the original file, ImageNet-style, then flipped; its randomness
comes from (seed, epoch, image index) alone, so a resumed run reads the
same crops.
"""
from __future__ import annotations

import math
import os
import warnings

import numpy as np

from jaxtrain.data import folder
from jaxtrain.data.dataset import DataError, Dataset


class FolderImages:
    """The training images of a folder as a lazily decoded uint8 (N, h, w, c) "array".

    Indexing with an int, a slice or an integer array decodes those images.
    Plain data (paths and settings), so it pickles cheaply to worker processes.
    """

    def __init__(self, paths, shape, channels, resize, max_pixels, reference):
        self.paths = tuple(paths)
        self._settings = (shape, channels, resize, max_pixels, reference)
        self.crop = None  # set by with_random_crop: (seed, scale, ratio, flip)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        shape, channels = self._settings[:2]
        return (len(self.paths), *shape, channels)

    dtype = np.dtype(np.uint8)
    ndim = 4

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index):
        if isinstance(index, (int, np.integer)):
            return self[np.array([index])][0]
        picked = np.arange(len(self.paths))[index]
        out = np.empty((len(picked), *self.shape[1:]), np.uint8)
        folder._decode_into(out, [self.paths[i] for i in picked], *self._settings)
        return out

    def with_random_crop(self, seed: int, scale, ratio, flip: bool) -> FolderImages:
        """A copy whose `read` crops at random (see random_resized_crop)."""
        copy = FolderImages(self.paths, *self._settings)
        copy.crop = (int(seed), tuple(scale), tuple(ratio), bool(flip))
        return copy

    def read(self, indices, epoch: int) -> np.ndarray:
        """Training images `indices` of `epoch`: randomly cropped when set, else as indexed."""
        if self.crop is None:
            return self[np.asarray(indices)]
        seed, scale, ratio, flip = self.crop
        shape, channels, _, max_pixels, _ = self._settings
        out = np.empty((len(indices), *self.shape[1:]), np.uint8)
        Image = folder._pil()
        with warnings.catch_warnings():
            warnings.simplefilter('error', Image.DecompressionBombWarning)
            for i, index in enumerate(indices):
                rng = np.random.default_rng([seed, epoch, int(index)])
                image = random_resized_crop(self.paths[index], shape, channels, max_pixels, rng,
                                            scale, ratio, flip)
                out[i] = image if image.ndim == 3 else image[:, :, None]
        return out


def load_folder_stream(path, image_size=None, resize: str = 'crop', channels: int = 3,
                       workers: int = 0, cache_dir: str | None = '~/.cache/jaxtrain',
                       max_pixels: int = folder.MAX_PIXELS) -> Dataset:
    """A Dataset whose x_train is FolderImages (decoded on demand) and x_test arrays.

    Without image_size, the first training image's size is the size (every
    image read must have it, as with load_folder).
    """
    origin = os.fspath(path)
    shape = folder._check_args(image_size, resize, channels, workers, max_pixels)
    root = os.path.realpath(origin)
    if not os.path.isdir(root):
        raise DataError(f'{origin}: no such directory (expected {origin}/train/<class>/<image> '
                        f'and {origin}/test/<class>/<image>)')
    class_names, splits = folder._scan(origin, root)
    train_paths = [p for files in splits['train'] for p, _, _ in files]
    reference = None
    if shape is None:
        reference = train_paths[0]
        shape, resize = folder._header_size(reference, max_pixels), None
    images = FolderImages(train_paths, shape, channels, resize, max_pixels, reference)
    test_only = {'train': [[] for _ in class_names], 'test': splits['test']}
    x_test, y_test = _test_split(root, test_only, shape, resize, channels, max_pixels, reference,
                                 workers, cache_dir, class_names, origin)
    return Dataset(images, folder._labels(splits['train']), x_test, y_test,
                   class_names=class_names, origin=origin)


def count_and_shape(path, image_size=None, channels: int = 3,
                    max_pixels: int = folder.MAX_PIXELS) -> tuple[int, tuple[int, int, int]]:
    """(training images, (h, w, c)) of a folder without decoding it: for data.placement='auto'."""
    origin = os.fspath(path)
    shape = folder._check_args(image_size, 'crop', channels, 1, max_pixels)
    root = os.path.realpath(origin)
    if not os.path.isdir(root):
        raise DataError(f'{origin}: no such directory (expected {origin}/train/<class>/<image> '
                        f'and {origin}/test/<class>/<image>)')
    _, splits = folder._scan(origin, root)
    first = splits['train'][0][0][0]
    shape = shape or folder._header_size(first, max_pixels)
    return sum(len(files) for files in splits['train']), (*shape, channels)


def _test_split(root, splits, shape, resize, channels, max_pixels, reference, workers, cache_dir,
                class_names, origin):
    """The test split decoded into arrays, through load_folder's cache."""
    cache_path = key = None
    if cache_dir is not None:
        key = folder._cache_key(root, splits, shape, resize, channels, max_pixels)
        cache_path = os.path.join(os.path.expanduser(os.fspath(cache_dir)), folder.CACHE_SUBDIR,
                                  key + '.npz')
        cached = folder._read_cache(cache_path, key, class_names, splits, shape, channels)
        if cached is not None:
            return cached[2], cached[3]
    n_workers = folder._cpu_count() if workers == 0 else workers
    x = folder._decode_all(splits, shape, channels, resize, max_pixels, reference, n_workers,
                           origin)
    arrays = (x['train'], folder._labels(splits['train']), x['test'],
              folder._labels(splits['test']))
    if cache_path is not None:
        folder._write_cache(cache_path, key, arrays, class_names)
    return arrays[2], arrays[3]


def random_resized_crop(path, shape, channels, max_pixels, rng, scale=(0.08, 1.0),
                        ratio=(3 / 4, 4 / 3), flip: bool = True) -> np.ndarray:
    """ImageNet-style training crop of one file: a random box covering `scale` of the
    area with aspect ratio in `ratio` (log-uniform), resized to `shape`, mirrored
    with probability 1/2. After 10 failed draws, the centre crop at the nearest
    allowed ratio (torchvision's RandomResizedCrop rule)."""
    Image = folder._pil()
    th, tw = shape
    try:
        with Image.open(path, formats=folder._PIL_FORMATS) as im:
            w, h = im.size
            folder._check_pixels(path, w, h, max_pixels)
            box = _crop_box(w, h, rng, scale, ratio)
            if im.format in ('JPEG', 'MPO'):  # decode at 1/2..1/8 scale when the box allows
                bw, bh = box[2] - box[0], box[3] - box[1]
                factor = max(1, min(bw / (tw * folder._REDUCING_GAP),
                                    bh / (th * folder._REDUCING_GAP)))
                im.draft(None, (math.ceil(w / factor), math.ceil(h / factor)))
                sx, sy = im.size[0] / w, im.size[1] / h
                box = (box[0] * sx, box[1] * sy, box[2] * sx, box[3] * sy)
            im.load()
            im = folder._to_mode(im, channels)
            im = im.resize((tw, th), Image.Resampling.BILINEAR, box=box,
                           reducing_gap=folder._REDUCING_GAP)
            if flip and rng.random() < 0.5:
                im = im.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
            return np.asarray(im)
    except Exception as e:
        raise folder._decode_error(path, e) from e


def _crop_box(w, h, rng, scale, ratio) -> tuple[float, float, float, float]:
    area = w * h
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target = area * rng.uniform(*scale)
        aspect = math.exp(rng.uniform(*log_ratio))
        cw, ch = round(math.sqrt(target * aspect)), round(math.sqrt(target / aspect))
        if 0 < cw <= w and 0 < ch <= h:
            left, top = int(rng.integers(0, w - cw + 1)), int(rng.integers(0, h - ch + 1))
            return left, top, left + cw, top + ch
    aspect = w / h
    if aspect < ratio[0]:
        cw, ch = w, round(w / ratio[0])
    elif aspect > ratio[1]:
        cw, ch = round(h * ratio[1]), h
    else:
        cw, ch = w, h
    left, top = (w - cw) // 2, (h - ch) // 2
    return left, top, left + cw, top + ch
