"""Your own data as arrays: one .npz with x_train, y_train, x_test, y_test.

The quickest way to bring any dataset to jaxtrain: whatever produced the
images, save them as uint8 (N, H, W, C) or (N, H, W) arrays with integer
labels. Read with allow_pickle=False, so a file from anywhere cannot run code.
"""
from __future__ import annotations

import os
import zipfile

import numpy as np

from jaxtrain.data.dataset import DataError, Dataset

ARRAY_KEYS = ('x_train', 'y_train', 'x_test', 'y_test')


def find_npz(path: str) -> str:
    """`path` itself, or the one .npz file in the directory `path`."""
    path = os.path.expanduser(os.fspath(path))
    if os.path.isdir(path):
        found = sorted(f for f in os.listdir(path) if f.endswith('.npz'))
        if len(found) != 1:
            raise DataError(f'{path}: data.name=arrays needs data.dir to be an .npz file or a '
                            f'folder with exactly one, found {len(found)}'
                            + (f' ({", ".join(found)})' if found else ''))
        return os.path.join(path, found[0])
    if not os.path.isfile(path):
        raise DataError(f'{path}: no such .npz file (data.name=arrays reads data.dir)')
    return path


def load_arrays(path: str) -> Dataset:
    """An .npz of x_train, y_train, x_test, y_test (+ optional class_names), validated."""
    path = find_npz(path)
    if not zipfile.is_zipfile(path):  # np.load would try it as a pickle
        raise DataError(f'{path}: not a readable .npz file (not a zip archive; write it with '
                        'numpy.savez)')
    try:
        with np.load(path, allow_pickle=False) as npz:
            missing = [k for k in ARRAY_KEYS if k not in npz.files]
            if missing:
                raise DataError(f'{path}: missing array(s) {", ".join(missing)} (it has '
                                f'{", ".join(npz.files) or "none"}; needs {", ".join(ARRAY_KEYS)})')
            arrays = {k: npz[k] for k in ARRAY_KEYS}
            names = npz['class_names'] if 'class_names' in npz.files else None
    except DataError:
        raise
    except ValueError as e:  # object arrays need pickle: refused
        raise DataError(f'{path}: refused, holds Python objects (only plain arrays are read: '
                        f'{e})') from e
    except (OSError, zipfile.BadZipFile, EOFError) as e:
        raise DataError(f'{path}: not a readable .npz file ({type(e).__name__}: {e})') from e

    images = {}
    for split in ('train', 'test'):
        x = arrays[f'x_{split}']
        if x.ndim == 3:
            x = x[..., None]
        if x.dtype != np.uint8 or x.ndim != 4 or x.shape[-1] not in (1, 3):
            raise DataError(f'{path}: x_{split} is {x.dtype} {x.shape}; expected uint8 '
                            '(N, H, W, C) with C 1 or 3, or (N, H, W)')
        images[split] = np.ascontiguousarray(x)
    if images['train'].shape[1:] != images['test'].shape[1:]:
        raise DataError(f'{path}: x_test images are {images["test"].shape[1:]}, x_train images '
                        f'are {images["train"].shape[1:]}')

    labels = {}
    for split in ('train', 'test'):
        y = arrays[f'y_{split}']
        if y.dtype.kind not in 'ui' or y.shape != (len(images[split]),):
            raise DataError(f'{path}: y_{split} is {y.dtype} {y.shape}; expected integer labels '
                            f'({len(images[split])},), one per image of x_{split}')
        if y.size and y.min() < 0:
            raise DataError(f'{path}: y_{split} has negative labels ({y.min()})')
        labels[split] = y.astype(np.int32)

    top = max(int(y.max()) if y.size else -1 for y in labels.values())
    if names is None:
        class_names = tuple(str(i) for i in range(top + 1))
    else:
        if names.ndim != 1 or names.dtype.kind not in 'US':
            raise DataError(f'{path}: class_names must be a 1-D array of strings')
        class_names = tuple(str(n.decode() if isinstance(n, bytes) else n) for n in names)
        if top >= len(class_names):
            raise DataError(f'{path}: label {top} but only {len(class_names)} class_names')
    if len(class_names) < 2:
        raise DataError(f'{path}: needs at least 2 classes, the labels name {len(class_names)}')
    return Dataset(x_train=images['train'], y_train=labels['train'], x_test=images['test'],
                   y_test=labels['test'], class_names=class_names, origin=path)
