"""CIFAR-10 and CIFAR-100 in their "python version": the directory or the .tar.gz.

The pickles are read with a restricted unpickler: a pickle can run arbitrary
code, and data files are often downloaded from mirrors nobody audits.
"""
from __future__ import annotations

import importlib
import io
import os
import pickle
import tarfile
import zlib
from typing import Callable

import numpy as np

from jaxtrain.data.dataset import DataError, Dataset
from jaxtrain.data.limits import MAX_MEMBER_BYTES as _MAX_MEMBER_BYTES

CIFAR10_CLASSES = ('airplane', 'automobile', 'bird', 'cat', 'deer',
                   'dog', 'frog', 'horse', 'ship', 'truck')
CIFAR10_DIR = 'cifar-10-batches-py'
CIFAR10_ARCHIVE = 'cifar-10-python.tar.gz'
CIFAR10_TRAIN = tuple(f'data_batch_{i}' for i in range(1, 6))
CIFAR10_TEST = 'test_batch'
CIFAR10_META = 'batches.meta'
_CIFAR_ROW = 3 * 32 * 32

CIFAR100_DIR = 'cifar-100-python'
CIFAR100_ARCHIVE = 'cifar-100-python.tar.gz'
CIFAR100_TRAIN, CIFAR100_TEST, CIFAR100_META = 'train', 'test', 'meta'
# data.label -> (the batches' label key, the meta's names key, the number of classes)
CIFAR100_LABELS = {'fine': ('fine_labels', 'fine_label_names', 100),
                   'coarse': ('coarse_labels', 'coarse_label_names', 20)}


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


def _find_cifar100(label: str):
    """find(dir) for CIFAR-100 with `label` ('fine' or 'coarse')."""
    def find(directory: str) -> Callable[[], Dataset] | None:
        folder = os.path.join(directory, CIFAR100_DIR)
        if os.path.isdir(folder):
            return lambda: load_cifar100_dir(folder, label)
        archive = os.path.join(directory, CIFAR100_ARCHIVE)
        if os.path.isfile(archive):
            return lambda: load_cifar100_archive(archive, label)
        return None
    return find


def load_cifar100_dir(path: str, label: str = 'fine') -> Dataset:
    """Load a cifar-100-python directory (train, test, meta); label 'fine' (100 classes)
    or 'coarse' (the 20 superclasses)."""
    path = os.fspath(path)
    files = {}
    for fname in (CIFAR100_TRAIN, CIFAR100_TEST, CIFAR100_META):
        full = os.path.join(path, fname)
        try:
            with open(full, 'rb') as f:
                files[fname] = f.read()
        except OSError as e:
            raise DataError(f'{full}: cannot read CIFAR-100 file ({e.strerror or e})') from e
    return _cifar100_from_files(files, lambda fname: os.path.join(path, fname), path, label)


def load_cifar100_archive(path: str, label: str = 'fine') -> Dataset:
    """Load cifar-100-python.tar.gz in memory, like load_cifar10_archive."""
    path = os.fspath(path)
    wanted = {f'{CIFAR100_DIR}/{f}': f for f in (CIFAR100_TRAIN, CIFAR100_TEST, CIFAR100_META)}
    files = {}
    try:
        with tarfile.open(path, 'r:*') as tar:
            for member in tar:
                fname = wanted.get(member.name.removeprefix('./'))
                if fname is not None:
                    files[fname] = _read_member(tar, member, path)
    except (tarfile.TarError, OSError, EOFError, zlib.error) as e:
        raise DataError(f'{path}: corrupt or unreadable archive ({type(e).__name__}: {e})') from e
    missing = [m for m, f in wanted.items() if f not in files]
    if missing:
        raise DataError(f'{path}: archive lacks member(s) {", ".join(missing)}')
    return _cifar100_from_files(files, lambda fname: f'{path}:{CIFAR100_DIR}/{fname}', path,
                                label)


def _cifar100_from_files(files: dict[str, bytes], where: Callable[[str], str], origin: str,
                         label: str) -> Dataset:
    if label not in CIFAR100_LABELS:
        raise DataError(f"data.label={label!r}: CIFAR-100 labels are 'fine' (100 classes) or "
                        "'coarse' (20 superclasses)")
    label_key, names_key, count = CIFAR100_LABELS[label]
    meta = where(CIFAR100_META)
    class_names = _cifar10_class_names(_unpickle(files[CIFAR100_META], meta), meta, names_key,
                                       count)
    x_train, y_train = _cifar10_batch(files[CIFAR100_TRAIN], where(CIFAR100_TRAIN), count,
                                      label_key)
    x_test, y_test = _cifar10_batch(files[CIFAR100_TEST], where(CIFAR100_TEST), count,
                                    label_key)
    return Dataset(x_train=x_train, y_train=y_train, x_test=x_test, y_test=y_test,
                   class_names=class_names, origin=origin)


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


def _cifar10_batch(raw: bytes, where: str, num_classes: int,
                   label_key: str = 'labels') -> tuple[np.ndarray, np.ndarray]:
    """One batch file -> (uint8 (n, 32, 32, 3) HWC, int32 (n,)), after validating it."""
    batch = _unpickle(raw, where)
    if not isinstance(batch, dict):
        raise DataError(f'{where}: expected a dict, got {type(batch).__name__}')
    data = _as_array(_get(batch, 'data', where), where, 'data')
    labels = _as_array(_get(batch, label_key, where), where, label_key)

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


def _cifar10_class_names(meta, where: str, key: str = 'label_names',
                         count: int = len(CIFAR10_CLASSES)) -> tuple[str, ...]:
    if not isinstance(meta, dict):
        raise DataError(f'{where}: expected a dict, got {type(meta).__name__}')
    names = _get(meta, key, where)
    if not isinstance(names, (list, tuple)) or len(names) != count:
        raise DataError(f'{where}: {key} must be a list of {count} names')
    result = []
    for n in names:
        if isinstance(n, bytes):
            n = n.decode('latin1')
        if not isinstance(n, str):
            raise DataError(f'{where}: {key} holds a {type(n).__name__}, expected strings')
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
