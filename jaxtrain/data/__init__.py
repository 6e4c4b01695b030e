"""Data sources -> host uint8 arrays: `load` in front, one module per format.

Every loader returns a `Dataset` of plain numpy arrays (uint8 images in HWC
RGB order, int32 labels) so the rest of jaxtrain never sees file formats.

Local files are preferred over tensorflow-datasets because they need no
network and no TensorFlow. CIFAR pickles are read with a restricted
unpickler: a pickle can run arbitrary code, and data files are often
downloaded from mirrors nobody audits.
"""
from __future__ import annotations

import os

from jaxtrain.data.arrays import load_arrays
from jaxtrain.data.cifar import (CIFAR10_ARCHIVE, CIFAR10_CLASSES, CIFAR10_DIR,  # noqa: F401
                                 CIFAR10_META, CIFAR10_TEST, CIFAR10_TRAIN, CIFAR100_ARCHIVE,
                                 CIFAR100_DIR, CIFAR100_LABELS, _find_cifar10, _find_cifar100,
                                 load_cifar10_archive, load_cifar10_dir, load_cifar100_archive,
                                 load_cifar100_dir)
from jaxtrain.data.dataset import DataError, Dataset
from jaxtrain.data.idx import IDX_FILES, _find_idx, load_idx_dir, read_idx  # noqa: F401
from jaxtrain.data.tfds import load_tfds

__all__ = [
    'DataError', 'Dataset', 'load', 'load_config', 'search_dirs', 'load_cifar10_dir',
    'load_cifar10_archive', 'load_cifar100_dir', 'load_cifar100_archive', 'load_arrays',
    'load_idx_dir', 'read_idx', 'load_tfds',
]

SOURCES = ('auto', 'files', 'download', 'tfds')
# Your own data: data.dir is the folder tree or the .npz itself, nothing is searched.
PATH_DATASETS = ('folder', 'arrays')
RESIZES = ('crop', 'exact')
ENV_VAR = 'JAXTRAIN_DATA_DIR'
CACHE_DIR = '~/.cache/jaxtrain'


def load(name: str, source: str = 'auto', data_dir: str | None = None, *,
         label: str = 'fine', image_size: int = 0, resize: str = 'crop', channels: int = 3,
         workers: int = 0) -> Dataset:
    """Load dataset `name`: a built-in one from local files, a download, or tfds
    (source 'auto' tries them in that order), or your own ('folder', 'arrays') from
    data_dir. label: CIFAR-100's 'fine' or 'coarse'; image_size, resize, channels,
    workers: how a folder's images are decoded (folder.load_folder)."""
    if name in PATH_DATASETS:
        if not data_dir:
            raise DataError(f"data.name={name!r} reads data.dir: set it to "
                            + ("the folder holding train/<class>/ and test/<class>/"
                               if name == 'folder' else "the .npz file"))
        if name == 'arrays':
            return load_arrays(data_dir)
        from jaxtrain.data import folder  # Pillow and process pools: only when used
        return folder.load_folder(data_dir, image_size=image_size or None, resize=resize,
                                  channels=channels, workers=workers, cache_dir=CACHE_DIR)
    if name not in _FILE_LAYOUTS:
        raise DataError(f'unknown dataset {name!r}; supported: '
                        f'{", ".join(sorted([*_FILE_LAYOUTS, *PATH_DATASETS]))}')
    if source not in SOURCES:
        raise DataError(f'unknown data source {source!r}; use one of: {", ".join(SOURCES)}')
    if name == 'cifar100' and label not in CIFAR100_LABELS:
        raise DataError(f"data.label={label!r}: CIFAR-100 labels are 'fine' (100 classes) or "
                        "'coarse' (20 superclasses)")
    if source == 'tfds':
        return load_tfds(name, data_dir=data_dir)

    find, looked_for, provide = _FILE_LAYOUTS[name]
    if name == 'cifar100':
        find = _find_cifar100(label)
    dirs = search_dirs(data_dir, _SYSTEM_DIRS.get(name, ()))
    if source != 'download':
        for directory, _ in dirs:
            loader = find(directory)
            if loader is not None:
                return loader()

    report = _not_found_report(name, dirs, looked_for)
    if source == 'files':
        raise DataError(f'{report}\n{_how_to_provide(provide)}')
    from jaxtrain.data import download  # urllib and tqdm: only when used
    try:
        loader = find(download.download(name, cache_dir=CACHE_DIR))
        if loader is None:
            raise DataError(f'{name}: downloaded, but no {", ".join(looked_for)} in {CACHE_DIR}')
        return loader()
    except DataError as e:
        if source == 'download':
            raise
        fetch_error = e
    try:
        return load_tfds(name, data_dir=data_dir)
    except DataError as e:
        raise DataError(f'{report}\nThe download failed: {fetch_error}\n'
                        f'The tfds fallback failed too: {e}\n{_how_to_provide(provide)}') from e


def load_config(data_config) -> Dataset:
    """data.load with the `data` config block's settings."""
    return load(data_config.name, data_config.source, data_config.dir or None,
                label=data_config.get('label', 'fine'),
                image_size=data_config.get('image_size', 0),
                resize=data_config.get('resize', 'crop'),
                channels=data_config.get('channels', 3),
                workers=data_config.get('workers', 0))


def search_dirs(data_dir: str | None, system_dirs=()) -> list[tuple[str, str]]:
    """Directories searched for local files, best first, as (path, why it is searched).

    system_dirs: where a system package installs the dataset, searched last.
    """
    candidates = [
        (data_dir, 'data.dir'),
        (os.environ.get(ENV_VAR), f'${ENV_VAR}'),
        (CACHE_DIR, 'default cache'),
        *((d, 'system package') for d in system_dirs),
    ]
    result, seen = [], set()
    for path, why in candidates:
        if not path:
            continue
        path = os.path.expanduser(os.fspath(path))
        key = os.path.normpath(os.path.abspath(path))
        if key not in seen:  # the same dir given twice is searched (and reported) once
            seen.add(key)
            result.append((path, why))
    return result


def _not_found_report(name, dirs, looked_for) -> str:
    lines = [f'no local {name} data found; looked for {", ".join(looked_for)} in:']
    for directory, why in dirs:
        missing = '' if os.path.isdir(directory) else ', does not exist'
        lines.append(f'  - {directory} ({why}{missing})')
    return '\n'.join(lines)


def _how_to_provide(provide: str) -> str:
    return (f'To provide the data, put {provide} into data.dir, '
            f'${ENV_VAR} or {CACHE_DIR} (e.g. pass --config.data.dir=DIR), '
            f"or let jaxtrain fetch it: data.source='download', or data.source='tfds' "
            f"(after pip install tensorflow; or ahead of time: python -m jaxtrain.data "
            f"download NAME).")


# ---------------------------------------------------------------------------
# Which files make which dataset
# ---------------------------------------------------------------------------

# name -> (find(dir) -> loader or None, file names looked for in search order,
# what users should provide). New formats (e.g. MNIST IDX files) plug in here.
_FILE_LAYOUTS = {
    'cifar10': (_find_cifar10,
                (f'{CIFAR10_DIR}/', f'{CIFAR10_TRAIN[0]} + {CIFAR10_TEST}', CIFAR10_ARCHIVE),
                f'{CIFAR10_ARCHIVE} or {CIFAR10_DIR}/'),
    'fashion_mnist': (_find_idx('fashion_mnist', ('fashion-mnist', 'fashion_mnist')),
                      ('train-images-idx3-ubyte[.gz] and the other three IDX files, '
                       'there or in fashion-mnist/',),
                      'the four Fashion-MNIST IDX files (apt-get install dataset-fashion-mnist)'),
    'cifar100': (_find_cifar100('fine'), (f'{CIFAR100_DIR}/', CIFAR100_ARCHIVE),
                 f'{CIFAR100_ARCHIVE} or {CIFAR100_DIR}/'),
    'mnist': (_find_idx('mnist', ('mnist',)),
              ('train-images-idx3-ubyte[.gz] and the other three IDX files, there or in mnist/',),
              'the four MNIST IDX files'),
}
# Where system packages install datasets (searched after the usual places).
_SYSTEM_DIRS = {'fashion_mnist': ('/usr/share/datasets/fashion-mnist',)}

# Every data.name load() knows.
DATASETS = (*_FILE_LAYOUTS, *PATH_DATASETS)
