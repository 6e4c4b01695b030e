"""MNIST-format IDX files (MNIST, Fashion-MNIST), gzipped or not."""
from __future__ import annotations

import gzip
import os
import struct
import zlib
from typing import Callable

import numpy as np

from jaxtrain.data.dataset import DataError, Dataset
from jaxtrain.data.limits import MAX_MEMBER_BYTES as _MAX_MEMBER_BYTES

IDX_FILES = {'train': ('train-images-idx3-ubyte', 'train-labels-idx1-ubyte'),
             'test': ('t10k-images-idx3-ubyte', 't10k-labels-idx1-ubyte')}
_IDX_CLASSES = {
    'fashion_mnist': ('T-shirt/top', 'Trouser', 'Pullover', 'Dress', 'Coat', 'Sandal', 'Shirt',
                      'Sneaker', 'Bag', 'Ankle boot'),
    'mnist': tuple(str(d) for d in range(10)),
}
_IDX_UBYTE = 0x08


def _idx_file(directory: str, stem: str) -> str | None:
    """The path of `stem` or `stem.gz` in directory, if either exists."""
    for path in (os.path.join(directory, stem), os.path.join(directory, stem + '.gz')):
        if os.path.isfile(path):
            return path
    return None


def read_idx(path: str, ndim: int) -> np.ndarray:
    """An IDX file (gzipped or not) of unsigned bytes with `ndim` dimensions, validated."""
    try:
        with (gzip.open(path, 'rb') if path.endswith('.gz') else open(path, 'rb')) as f:
            raw = f.read(_MAX_MEMBER_BYTES + 1)
    except (OSError, EOFError, zlib.error) as e:
        raise DataError(f'{path}: cannot read ({type(e).__name__}: {e})') from e
    if len(raw) > _MAX_MEMBER_BYTES:
        raise DataError(f'{path}: refused, implausibly large (over {_MAX_MEMBER_BYTES} bytes)')
    if len(raw) < 4 or raw[:2] != b'\0\0':
        raise DataError(f'{path}: not an IDX file (bad magic number {raw[:4].hex() or "(empty)"})')
    if raw[2] != _IDX_UBYTE or raw[3] != ndim:
        raise DataError(f'{path}: IDX magic {raw[:4].hex()} says type 0x{raw[2]:02x} with '
                        f'{raw[3]} dimensions; expected unsigned bytes (0x08) with {ndim}')
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise DataError(f'{path}: truncated IDX header')
    dims = struct.unpack(f'>{ndim}I', raw[4:header])
    expected = int(np.prod(dims, dtype=np.int64))
    if len(raw) - header != expected:
        raise DataError(f'{path}: header says {"x".join(map(str, dims))} = {expected} bytes of '
                        f'data, the file has {len(raw) - header}')
    return np.frombuffer(raw, np.uint8, offset=header).reshape(dims)


def load_idx_dir(path: str, class_names: tuple[str, ...]) -> Dataset:
    """The four MNIST-format files in `path` -> Dataset with (N, H, W, 1) images."""
    path = os.fspath(path)
    splits = {}
    for split, (image_stem, label_stem) in IDX_FILES.items():
        image_path, label_path = _idx_file(path, image_stem), _idx_file(path, label_stem)
        if image_path is None or label_path is None:
            missing = image_stem if image_path is None else label_stem
            raise DataError(f'{os.path.join(path, missing)}[.gz]: missing')
        images, labels = read_idx(image_path, 3), read_idx(label_path, 1)
        if len(images) != len(labels):
            raise DataError(f'{label_path}: {len(labels)} labels for the {len(images)} images '
                            f'of {image_path}')
        if labels.size and labels.max() >= len(class_names):
            raise DataError(f'{label_path}: labels outside 0..{len(class_names) - 1} '
                            f'(found {labels.max()})')
        # a copy: frombuffer arrays are read-only, which other libraries warn about
        splits[split] = (images[..., None].copy(), labels.astype(np.int32), image_path)
    (x_train, y_train, train_path), (x_test, y_test, test_path) = splits['train'], splits['test']
    if x_train.shape[1:] != x_test.shape[1:]:
        raise DataError(f'{test_path}: images are {x_test.shape[1:3]}, the training images '
                        f'in {train_path} are {x_train.shape[1:3]}')
    return Dataset(x_train=x_train, y_train=y_train, x_test=x_test, y_test=y_test,
                   class_names=class_names, origin=path)


def _find_idx(name: str, subdirs: tuple[str, ...]):
    """find(dir) for an IDX dataset: the four files in dir itself or in one of `subdirs`."""
    def find(directory: str) -> Callable[[], Dataset] | None:
        for candidate in (directory, *(os.path.join(directory, d) for d in subdirs)):
            if _idx_file(candidate, IDX_FILES['train'][0]) is not None:
                return lambda: load_idx_dir(candidate, _IDX_CLASSES[name])
        return None
    return find
