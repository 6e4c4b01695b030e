"""Data sources -> host uint8 arrays.

Every loader returns a `Dataset` of plain numpy arrays (uint8 images in HWC
RGB order, int32 labels) so the rest of jaxtrain never sees file formats.

Local files are preferred over tensorflow-datasets because they need no
network and no TensorFlow. CIFAR pickles are read with a restricted
unpickler: a pickle can run arbitrary code, and data files are often
downloaded from mirrors nobody audits.
"""
from __future__ import annotations

import dataclasses
import gzip
import importlib
import io
import os
import pickle
import struct
import tarfile
import zlib
from typing import Callable

import numpy as np

__all__ = [
    'DataError', 'Dataset', 'load', 'search_dirs', 'load_cifar10_dir',
    'load_cifar10_archive', 'load_tfds',
]

SOURCES = ('auto', 'files', 'tfds')
ENV_VAR = 'JAXTRAIN_DATA_DIR'
CACHE_DIR = '~/.cache/jaxtrain'

CIFAR10_CLASSES = ('airplane', 'automobile', 'bird', 'cat', 'deer',
                   'dog', 'frog', 'horse', 'ship', 'truck')
CIFAR10_DIR = 'cifar-10-batches-py'
CIFAR10_ARCHIVE = 'cifar-10-python.tar.gz'
CIFAR10_TRAIN = tuple(f'data_batch_{i}' for i in range(1, 6))
CIFAR10_TEST = 'test_batch'
CIFAR10_META = 'batches.meta'
_CIFAR_ROW = 3 * 32 * 32

# A gzip bomb must not be able to exhaust memory: real CIFAR members are ~30 MB.
_MAX_MEMBER_BYTES = 1 << 30


class DataError(Exception):
    """Raised for missing, malformed or unsafe data; message names the file and the problem."""


@dataclasses.dataclass(frozen=True, eq=False)
class Dataset:
    """A train/test split held in host memory.

    eq=False: comparing numpy arrays with == is ambiguous, so datasets
    compare (and hash) by identity.
    """
    x_train: np.ndarray = dataclasses.field(repr=False)  # uint8 (N, H, W, C), HWC RGB
    y_train: np.ndarray = dataclasses.field(repr=False)  # int32 (N,)
    x_test: np.ndarray = dataclasses.field(repr=False)   # uint8 (M, H, W, C)
    y_test: np.ndarray = dataclasses.field(repr=False)   # int32 (M,)
    class_names: tuple[str, ...]
    origin: str  # the path or 'tfds:<name>' it came from

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    @property
    def image_shape(self) -> tuple[int, int, int]:
        return tuple(self.x_train.shape[1:])


# ---------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------

def load(name: str, source: str = 'auto', data_dir: str | None = None) -> Dataset:
    """Load dataset `name` from local files, tfds, or files-then-tfds ('auto')."""
    if name not in _FILE_LAYOUTS:
        raise DataError(f'unknown dataset {name!r}; supported: {", ".join(sorted(_FILE_LAYOUTS))}')
    if source not in SOURCES:
        raise DataError(f'unknown data source {source!r}; use one of: {", ".join(SOURCES)}')
    if source == 'tfds':
        return load_tfds(name, data_dir=data_dir)

    find, looked_for, provide = _FILE_LAYOUTS[name]
    dirs = search_dirs(data_dir, _SYSTEM_DIRS.get(name, ()))
    for directory, _ in dirs:
        loader = find(directory)
        if loader is not None:
            return loader()

    report = _not_found_report(name, dirs, looked_for)
    if source == 'files':
        raise DataError(f'{report}\n{_how_to_provide(provide)}')
    try:
        return load_tfds(name, data_dir=data_dir)
    except DataError as e:
        raise DataError(f'{report}\nThe tfds fallback failed too: {e}\n{_how_to_provide(provide)}') from e


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
            f"or use data.source='tfds'.")


# ---------------------------------------------------------------------------
# MNIST-format IDX files (MNIST, Fashion-MNIST)
# ---------------------------------------------------------------------------

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


# ---------------------------------------------------------------------------
# CIFAR-10 local files
# ---------------------------------------------------------------------------

def _find_cifar10(directory: str) -> Callable[[], Dataset] | None:
    """The loader for the first CIFAR-10 layout present in `directory`, else None."""
    batches = os.path.join(directory, CIFAR10_DIR)
    if os.path.isdir(batches):
        return lambda: load_cifar10_dir(batches)
    if all(os.path.isfile(os.path.join(directory, f)) for f in (CIFAR10_TRAIN[0], CIFAR10_TEST)):
        return lambda: load_cifar10_dir(directory)
    archive = os.path.join(directory, CIFAR10_ARCHIVE)
    if os.path.isfile(archive):
        return lambda: load_cifar10_archive(archive)
    return None


def load_cifar10_dir(path: str) -> Dataset:
    """Load a cifar-10-batches-py directory (data_batch_1..5, test_batch, optional batches.meta)."""
    path = os.fspath(path)

    def read(fname):
        full = os.path.join(path, fname)
        try:
            with open(full, 'rb') as f:
                return f.read()
        except OSError as e:
            raise DataError(f'{full}: cannot read CIFAR-10 file ({e.strerror or e})') from e

    meta = os.path.join(path, CIFAR10_META)
    files = {f: read(f) for f in (*CIFAR10_TRAIN, CIFAR10_TEST)}
    if os.path.exists(meta):
        files[CIFAR10_META] = read(CIFAR10_META)
    return _cifar10_from_files(files, lambda fname: os.path.join(path, fname), origin=path)


def load_cifar10_archive(path: str) -> Dataset:
    """Load cifar-10-python.tar.gz (or .tar) in memory; nothing is extracted to disk."""
    path = os.fspath(path)
    wanted = {f'{CIFAR10_DIR}/{f}': f for f in (*CIFAR10_TRAIN, CIFAR10_TEST, CIFAR10_META)}
    files = {}
    try:
        with tarfile.open(path, 'r:*') as tar:
            for member in tar:  # one streaming pass: seeking back in a .gz re-decompresses
                fname = wanted.get(member.name.removeprefix('./'))
                if fname is not None:
                    files[fname] = _read_member(tar, member, path)
    except (tarfile.TarError, OSError, EOFError, zlib.error) as e:
        raise DataError(f'{path}: corrupt or unreadable archive ({type(e).__name__}: {e})') from e

    missing = [m for m, f in wanted.items() if f not in files and f != CIFAR10_META]
    if missing:
        raise DataError(f'{path}: archive lacks member(s) {", ".join(missing)}')
    return _cifar10_from_files(files, lambda fname: f'{path}:{CIFAR10_DIR}/{fname}', origin=path)


def _read_member(tar: tarfile.TarFile, member: tarfile.TarInfo, path: str) -> bytes:
    """Bytes of one archive member, refusing anything but a plain file with a plain name."""
    where = f'{path}:{member.name}'
    if not member.isreg():
        raise DataError(f'{where}: refused, not a regular file (a link, directory or device)')
    if member.name.startswith('/') or '..' in member.name.split('/'):
        raise DataError(f'{where}: refused, unsafe member path')
    if member.size > _MAX_MEMBER_BYTES:
        raise DataError(f'{where}: refused, member is implausibly large ({member.size} bytes)')
    return tar.extractfile(member).read()


def _cifar10_from_files(files: dict[str, bytes], where: Callable[[str], str], origin: str) -> Dataset:
    """Decode and validate CIFAR-10 pickles given as {file name: bytes}."""
    if CIFAR10_META in files:
        class_names = _cifar10_class_names(_unpickle(files[CIFAR10_META], where(CIFAR10_META)),
                                           where(CIFAR10_META))
    else:
        class_names = CIFAR10_CLASSES
    num_classes = len(class_names)

    train = [_cifar10_batch(files[f], where(f), num_classes) for f in CIFAR10_TRAIN]
    x_test, y_test = _cifar10_batch(files[CIFAR10_TEST], where(CIFAR10_TEST), num_classes)
    return Dataset(
        x_train=np.concatenate([x for x, _ in train]),
        y_train=np.concatenate([y for _, y in train]),
        x_test=x_test,
        y_test=y_test,
        class_names=class_names,
        origin=origin,
    )


def _cifar10_batch(raw: bytes, where: str, num_classes: int) -> tuple[np.ndarray, np.ndarray]:
    """One batch file -> (uint8 (n, 32, 32, 3) HWC, int32 (n,)), after validating it."""
    batch = _unpickle(raw, where)
    if not isinstance(batch, dict):
        raise DataError(f'{where}: expected a dict, got {type(batch).__name__}')
    data = _as_array(_get(batch, 'data', where), where, 'data')
    labels = _as_array(_get(batch, 'labels', where), where, 'labels')

    if data.ndim != 2 or data.shape[1] != _CIFAR_ROW:
        raise DataError(f'{where}: data has shape {data.shape}, expected (n, {_CIFAR_ROW})')
    if data.dtype != np.uint8:
        if data.dtype.kind not in 'ui':
            raise DataError(f'{where}: data has dtype {data.dtype}, expected uint8')
        if data.size and (data.min() < 0 or data.max() > 255):
            raise DataError(f'{where}: data values outside 0..255')
    if labels.size == 0:
        labels = labels.astype(np.int64)  # np.asarray([]) is float64
    if labels.ndim != 1 or labels.dtype.kind not in 'ui':
        raise DataError(f'{where}: labels must be a flat list of integers, got {labels.dtype} {labels.shape}')
    if len(labels) != len(data):
        raise DataError(f'{where}: {len(labels)} labels for {len(data)} images')
    if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
        raise DataError(f'{where}: labels outside 0..{num_classes - 1} '
                        f'(found {labels.min()}..{labels.max()})')

    # Rows are R, G, B planes of 32x32 each (CHW); the framework wants HWC.
    images = data.astype(np.uint8, copy=False).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
    return np.ascontiguousarray(images), labels.astype(np.int32)


def _cifar10_class_names(meta, where: str) -> tuple[str, ...]:
    if not isinstance(meta, dict):
        raise DataError(f'{where}: expected a dict, got {type(meta).__name__}')
    names = _get(meta, 'label_names', where)
    if not isinstance(names, (list, tuple)) or len(names) != len(CIFAR10_CLASSES):
        raise DataError(f'{where}: label_names must be a list of {len(CIFAR10_CLASSES)} names')
    result = []
    for n in names:
        if isinstance(n, bytes):
            n = n.decode('latin1')
        if not isinstance(n, str):
            raise DataError(f'{where}: label_names holds a {type(n).__name__}, expected strings')
        result.append(n)
    return tuple(result)


def _get(d: dict, key: str, where: str):
    """d[key], accepting the bytes keys of Python-2 pickles loaded with encoding='bytes'."""
    for k in (key, key.encode()):
        if k in d:
            return d[k]
    raise DataError(f'{where}: missing key {key!r}')


def _as_array(value, where: str, what: str) -> np.ndarray:
    try:
        arr = np.asarray(value)
    except (ValueError, TypeError) as e:
        raise DataError(f'{where}: {what} is not an array ({e})') from e
    if arr.dtype == object:
        raise DataError(f'{where}: {what} is not numeric')
    return arr


# ---------------------------------------------------------------------------
# Restricted unpickling
# ---------------------------------------------------------------------------

def _latin1_encode(text, encoding='latin1', errors='strict'):
    """Stand-in for _codecs.encode: protocol-2 pickles from Python 3 store bytes this way."""
    if encoding not in ('latin1', 'latin-1') or errors != 'strict' or not isinstance(text, str):
        raise pickle.UnpicklingError(f'refused _codecs.encode with encoding {encoding!r}')
    return text.encode('latin1')


def _numpy_core(submodule: str):
    """numpy._core.<submodule> on numpy 2, numpy.core.<submodule> on numpy 1."""
    try:
        return importlib.import_module(f'numpy._core.{submodule}')
    except ImportError:
        return importlib.import_module(f'numpy.core.{submodule}')


# Everything a CIFAR pickle legitimately refers to: numpy array/scalar
# reconstruction (numpy 1 and 2 spellings) and protocol-2 bytes.
_ALLOWED_GLOBALS = {
    ('numpy', 'ndarray'): lambda: np.ndarray,
    ('numpy', 'dtype'): lambda: np.dtype,
    ('numpy.core.multiarray', '_reconstruct'): lambda: _numpy_core('multiarray')._reconstruct,
    ('numpy._core.multiarray', '_reconstruct'): lambda: _numpy_core('multiarray')._reconstruct,
    ('numpy.core.multiarray', 'scalar'): lambda: _numpy_core('multiarray').scalar,
    ('numpy._core.multiarray', 'scalar'): lambda: _numpy_core('multiarray').scalar,
    ('numpy.core.numeric', '_frombuffer'): lambda: _numpy_core('numeric')._frombuffer,
    ('numpy._core.numeric', '_frombuffer'): lambda: _numpy_core('numeric')._frombuffer,
    ('_codecs', 'encode'): lambda: _latin1_encode,
}


class _RestrictedUnpickler(pickle.Unpickler):
    """Unpickler that resolves only the globals in _ALLOWED_GLOBALS."""

    def __init__(self, file, where: str):
        super().__init__(file, encoding='latin1')  # Python-2 str -> str, as numpy expects
        self.where = where

    def find_class(self, module, name):
        resolve = _ALLOWED_GLOBALS.get((module, name))
        if resolve is None:
            raise DataError(f'{self.where}: refused to unpickle global {module}.{name} '
                            f'(only numpy arrays are allowed in data files)')
        return resolve()


def _unpickle(raw: bytes, where: str):
    """Unpickle `raw` safely; any failure becomes a DataError naming `where`."""
    try:
        return _RestrictedUnpickler(io.BytesIO(raw), where).load()
    except DataError:
        raise
    except Exception as e:  # truncated or garbage pickles raise almost anything
        raise DataError(f'{where}: not a valid pickle ({type(e).__name__}: {e})') from e


# ---------------------------------------------------------------------------
# tensorflow-datasets
# ---------------------------------------------------------------------------

def load_tfds(name: str, data_dir: str | None = None, download: bool = True) -> Dataset:
    """Load `name` through tensorflow-datasets (imported only here: it is slow and optional)."""
    try:
        import tensorflow_datasets as tfds
    except ImportError as e:
        raise DataError(f'tfds:{name}: tensorflow-datasets is not installed '
                        f'(pip install tensorflow-datasets tensorflow) [{e}]') from e
    try:
        import tensorflow  # noqa: F401  tfds needs it to read prepared data
    except ImportError as e:
        raise DataError(f'tfds:{name}: tensorflow is not installed, tensorflow-datasets '
                        f'needs it (pip install tensorflow) [{e}]') from e

    try:
        builder = tfds.builder(name, data_dir=data_dir)
        if download:
            builder.download_and_prepare()
        elif not builder.is_prepared():
            raise DataError(f'tfds:{name}: not prepared in {builder.data_dir} and download=False')
        train, test = (tfds.as_numpy(builder.as_dataset(split=s, batch_size=-1, as_supervised=True))
                       for s in ('train', 'test'))
        class_names = tuple(str(n) for n in builder.info.features['label'].names)
    except DataError:
        raise
    except Exception as e:
        raise DataError(f'tfds:{name}: {type(e).__name__}: {e}') from e

    (x_train, y_train), (x_test, y_test) = train, test
    for x, y, split in ((x_train, y_train, 'train'), (x_test, y_test, 'test')):
        if np.asarray(x).dtype != np.uint8 or np.ndim(x) != 4:
            raise DataError(f'tfds:{name}: {split} images are {np.asarray(x).dtype} '
                            f'{np.shape(x)}, expected uint8 (N, H, W, C)')
        y = np.asarray(y)
        if y.shape != (len(x),) or (y.size and (y.min() < 0 or y.max() >= len(class_names))):
            raise DataError(f'tfds:{name}: {split} labels do not match its {len(x)} images '
                            f'and {len(class_names)} classes')
    return Dataset(
        x_train=np.ascontiguousarray(x_train),
        y_train=np.asarray(y_train, dtype=np.int32),
        x_test=np.ascontiguousarray(x_test),
        y_test=np.asarray(y_test, dtype=np.int32),
        class_names=class_names,
        origin=f'tfds:{name}',
    )


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
    'mnist': (_find_idx('mnist', ('mnist',)),
              ('train-images-idx3-ubyte[.gz] and the other three IDX files, there or in mnist/',),
              'the four MNIST IDX files'),
}
# Where system packages install datasets (searched after the usual places).
_SYSTEM_DIRS = {'fashion_mnist': ('/usr/share/datasets/fashion-mnist',)}
