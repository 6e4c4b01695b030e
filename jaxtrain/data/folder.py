"""An image-folder tree (train/<class>/*.jpg, test/<class>/*.jpg) -> uint8 arrays, cached.

    root/train/<class>/<any name>.{jpg,jpeg,png,bmp,webp}   (sub-folders of a class count too)
    root/test/<class>/...                                    (or root/val/ when there is no test/)

Why decode everything up front: the rest of jaxtrain trains from whole
arrays (uint8 NHWC RGB images, int32 labels) that it puts on the device and
augments there, inside the compiled steps. Decoding each image once into
those arrays - in parallel over the cores - lets a folder of JPEGs train
exactly like the CIFAR pickles, with no file reading or decoding on the host
while training. The decoded arrays are cached (an uncompressed .npz, keyed by
every file's path, size and mtime and by the decode settings), so later runs
load in seconds and any change to the folder or the settings decodes afresh.

Choices:
- Class names are the train/ sub-folder names, sorted; a label is the index
  in that list. Images are ordered by class, then by path within the class.
- Files are picked by extension (case-insensitive); other files, and hidden
  files and folders (a leading '.', e.g. .ipynb_checkpoints), are ignored.
  Pillow may only use its JPEG, PNG, BMP and WebP decoders, whatever a file
  holds: no other decoder (some call external programs) ever sees the data.
- Colour: any mode becomes RGB (channels=3) or L (channels=1) with Pillow.
  An alpha channel is dropped (Pillow's convert('RGB'), as torchvision's
  ImageFolder loader does), not composited, so pixels match the usual
  PyTorch pipeline. Grey images are replicated to RGB. 16-bit grey is scaled
  to 8 bits (Pillow's own convert would clip it to 255). EXIF orientation is
  not applied (pixels as stored, as torchvision does).
- Resizing (image_size set): resize='crop' scales the short side to the
  target and centre-crops; 'exact' scales straight to (h, w). Pillow's
  BILINEAR, which widens its filter when shrinking (so no aliasing), with
  reducing_gap=3.0: a big photo is first shrunk by an integer factor with a
  box filter, then resampled, which is several times faster and, per Pillow's
  documentation, indistinguishable from full resampling at a gap of 3. JPEGs
  are likewise decoded at 1/2, 1/4 or 1/8 scale (Image.draft) when that still
  leaves at least 3x the needed size.
- Symbolic links (files or folders) that resolve to a place outside the root
  folder are refused with a DataError naming the link, rather than skipped:
  silently dropping images would change the dataset unnoticed. Links inside
  the root are followed (within a class a folder is walked once, so a link
  cannot make a loop).
- Parallel decoding: files go in chunks to a process pool (workers - 1
  processes) and to this process, which decodes from the other end of the list
  rather than wait. Workers are forked and write straight into the result
  (shared memory) unless JAX has started its backends here: forking a process
  with JAX's threads running can deadlock, so then a fork server starts the
  workers and they send their chunks back (slower to start; needs the usual
  `if __name__ == "__main__":` guard in the main script).
- Safety: an image whose header claims more than max_pixels pixels is refused
  before it is decoded; Pillow's own decompression-bomb check (Image.MAX_IMAGE_PIXELS)
  stays in force too. Truncated images are errors (LOAD_TRUNCATED_IMAGES is
  left alone).
"""
from __future__ import annotations

import concurrent.futures
import hashlib
import importlib.util
import json
import logging
import math
import mmap
import multiprocessing
import os
import sys
import tempfile
import warnings

import numpy as np

from jaxtrain.data.dataset import DataError, Dataset

log = logging.getLogger(__name__)

IMAGE_EXTENSIONS = ('.jpg', '.jpeg', '.jpe', '.jfif', '.png', '.bmp', '.webp')
RESIZE_MODES = ('crop', 'exact')
MAX_PIXELS = 89_478_485  # Pillow's default Image.MAX_IMAGE_PIXELS (~ a 9459 x 9459 image)
CACHE_SUBDIR = 'folders'

_PIL_FORMATS = ('JPEG', 'PNG', 'BMP', 'WEBP')
_REDUCING_GAP = 3.0
_CACHE_VERSION = 1  # bump when decoding changes what a file turns into
_MAX_CHUNK = 256    # files per worker task: small enough to balance big photos
_MIN_CHUNK = 16
_SPLITS = ('train', 'test')


def load_folder(path, image_size=None, resize: str = 'crop', channels: int = 3, workers: int = 0,
                cache_dir: str | None = '~/.cache/jaxtrain', max_pixels: int = MAX_PIXELS) -> Dataset:
    """Decode root/train/<class>/* and root/test/<class>/* (or val/) into a Dataset.

    image_size: None (every image must already have one size), an int (square)
        or (height, width).
    resize: 'crop' (short side to size, then centre crop) or 'exact' (stretch).
    channels: 3 (RGB) or 1 (grey).
    workers: how many processes decode, this one included (it decodes too while
        workers - 1 others do); 0 means one per core this process may use
        (os.sched_getaffinity where there is one, else os.cpu_count()); 1 decodes
        in this process only.
    cache_dir: the decoded arrays are kept in <cache_dir>/folders/<key>.npz;
        None turns the cache off.
    max_pixels: images whose header claims more pixels are refused undecoded.
    """
    origin = os.fspath(path)
    shape = _check_args(image_size, resize, channels, workers, max_pixels)
    if importlib.util.find_spec('PIL') is None:  # decoding needs it; the rest of jaxtrain does not
        raise DataError(f'{origin}: loading an image folder needs Pillow (pip install pillow)')
    root = os.path.realpath(origin)
    if not os.path.isdir(root):
        raise DataError(f'{origin}: no such directory (expected {origin}/train/<class>/<image> '
                        f'and {origin}/test/<class>/<image>)')

    class_names, splits = _scan(origin, root)
    cache_path = key = None
    if cache_dir is not None:
        key = _cache_key(root, splits, shape, resize, channels, max_pixels)
        cache_path = os.path.join(os.path.expanduser(os.fspath(cache_dir)), CACHE_SUBDIR, key + '.npz')
        cached = _read_cache(cache_path, key, class_names, splits, shape, channels)
        if cached is not None:
            return Dataset(*cached, class_names=class_names, origin=origin)

    if shape is None:  # the first training image sets the size every other must have
        reference = splits['train'][0][0][0]
        shape = _header_size(reference, max_pixels)
        resize = None
    else:
        reference = None
    n_workers = _cpu_count() if workers == 0 else workers
    x = _decode_all(splits, shape, channels, resize, max_pixels, reference, n_workers, origin)
    arrays = (x['train'], _labels(splits['train']), x['test'], _labels(splits['test']))
    if cache_path is not None:
        _write_cache(cache_path, key, arrays, class_names)
    return Dataset(*arrays, class_names=class_names, origin=origin)


def find_images(paths) -> tuple[list[str], list[tuple[str, str]]]:
    """The image files `paths` name, and (path, why) for each path that names none.

    A file is taken as given (its decoder is still one of JPEG, PNG, BMP, WebP); a
    folder is walked recursively in name order for files with an image extension,
    hidden entries skipped, as the training folders are. For jaxtrain.predict: the
    user's own files, so links are followed wherever they lead.
    """
    found, missing = [], []
    for path in map(str, paths):
        if os.path.isdir(path):
            before = len(found)
            for directory, folders, names in os.walk(path, followlinks=True):
                folders[:] = sorted(f for f in folders if not f.startswith('.'))
                found.extend(os.path.join(directory, name) for name in sorted(names)
                             if not name.startswith('.')
                             and os.path.splitext(name)[1].lower() in IMAGE_EXTENSIONS)
            if len(found) == before:
                missing.append((path, f'no image files ({", ".join(IMAGE_EXTENSIONS)}) in it'))
        elif os.path.isfile(path):
            found.append(path)
        else:
            missing.append((path, 'no such file or folder'))
    return found, missing


def decode_image(path, shape, channels: int = 3, resize: str = 'crop',
                 max_pixels: int = MAX_PIXELS) -> np.ndarray:
    """One image file -> uint8 (h, w, channels) of `shape` (h, w), decoded and resized
    exactly as load_folder decodes a training folder's files (any size in; DataError
    naming the file for one that cannot be read)."""
    Image = _pil()
    if resize not in RESIZE_MODES:
        raise DataError(f'resize must be one of {", ".join(RESIZE_MODES)}, got {resize!r}')
    with warnings.catch_warnings():
        warnings.simplefilter('error', Image.DecompressionBombWarning)
        image = _decode_file(str(path), tuple(shape), channels, resize, max_pixels, None)
    if image.ndim == 2:  # grey: (h, w, 1), or replicated to RGB as load_folder's arrays are
        image = np.repeat(image[:, :, None], channels, axis=2)
    return image


def _check_args(image_size, resize, channels, workers, max_pixels) -> tuple[int, int] | None:
    """Validate the settings; return the target (height, width) or None."""
    if resize not in RESIZE_MODES:
        raise DataError(f'data.resize must be one of {", ".join(RESIZE_MODES)}, got {resize!r}')
    if channels not in (1, 3):
        raise DataError(f'data.channels must be 1 (grey) or 3 (RGB), got {channels!r}')
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
        raise DataError(f'data.workers must be an integer >= 0 (0: one per core), got {workers!r}')
    if isinstance(max_pixels, bool) or not isinstance(max_pixels, int) or max_pixels < 1:
        raise DataError(f'max_pixels must be a positive integer, got {max_pixels!r}')
    if image_size is None:
        return None
    size = (image_size, image_size) if isinstance(image_size, (int, np.integer)) else image_size
    try:
        h, w = size
    except (TypeError, ValueError):
        h = w = None
    if not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v > 0 for v in (h, w)):
        raise DataError(f'data.image_size must be None, a positive int or (height, width), '
                        f'got {image_size!r}')
    return int(h), int(w)


def _cpu_count() -> int:
    if hasattr(os, 'sched_getaffinity'):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


# ---------------------------------------------------------------------------
# Walking the tree
# ---------------------------------------------------------------------------

# One split: a list over classes (in class_names order) of
# [(path, path relative to root, DirEntry)], sorted by relative path.
_Split = list


def _scan(origin: str, root: str) -> tuple[tuple[str, ...], dict[str, _Split]]:
    """Class names and each split's files, after checking the layout."""
    train_dir = os.path.join(origin, 'train')
    if not os.path.isdir(train_dir):
        raise DataError(f'{train_dir}: missing; an image folder needs train/<class>/<image> '
                        f'and test/<class>/<image> (or val/) in {origin}')
    test_name = 'test' if os.path.isdir(os.path.join(origin, 'test')) else 'val'
    test_dir = os.path.join(origin, test_name)
    if not os.path.isdir(test_dir):
        raise DataError(f'{os.path.join(origin, "test")}: missing (and no val/ either); an image '
                        f'folder needs test/<class>/<image> beside train/')

    train = _scan_split(train_dir, 'train', root)
    test = _scan_split(test_dir, test_name, root)
    class_names = tuple(sorted(train))
    extra = [c for c in test if c not in train]
    if extra:
        raise DataError(f'{os.path.join(test_dir, extra[0])}: class {extra[0]!r} is not in '
                        f'{train_dir} (train classes: {", ".join(class_names)})')
    splits = {'train': [train[c] for c in class_names],
              'test': [test.get(c, []) for c in class_names]}
    return class_names, splits


def _scan_split(split_dir: str, split: str, root: str) -> dict[str, list]:
    """{class: [(path, path relative to root, DirEntry)] sorted} for one split folder."""
    if os.path.islink(split_dir):
        _check_link(split_dir, root)
    classes = {}
    for entry in _entries(split_dir):
        if not entry.is_dir():
            continue  # loose files beside the class folders are ignored
        if entry.is_symlink():
            _check_link(entry.path, root)
        files = []
        _walk_class(entry.path, f'{split}/{entry.name}', root, files, set())
        if not files:
            raise DataError(f'{entry.path}: empty class folder (no {"/".join(IMAGE_EXTENSIONS)} '
                            f'images); remove it or add images')
        files.sort(key=lambda f: f[1])
        classes[entry.name] = files
    if not classes:
        raise DataError(f'{split_dir}: no images; expected class folders {split_dir}/<class>/ '
                        f'holding {"/".join(IMAGE_EXTENSIONS)} files')
    return classes


def _walk_class(directory: str, rel: str, root: str, files: list, seen: set) -> None:
    """Append directory's images (recursively) to files; `seen`: real paths walked already."""
    real = os.path.realpath(directory)
    if real in seen:  # reached again through a link (inside root): walk it once, never loop
        return
    seen.add(real)
    for entry in _entries(directory):
        entry_rel = f'{rel}/{entry.name}'
        link = entry.is_symlink()  # DirEntry answers from the directory listing: no syscall
        if entry.is_dir():
            if link:
                _check_link(entry.path, root)
            _walk_class(entry.path, entry_rel, root, files, seen)
        elif os.path.splitext(entry.name)[1].lower() in IMAGE_EXTENSIONS:
            if link:
                _check_link(entry.path, root)
            if entry.is_file():  # not a FIFO or device that happens to be named x.jpg
                files.append((entry.path, entry_rel, entry))
            elif link and not os.path.exists(entry.path):
                raise DataError(f'{entry.path}: broken symbolic link to {os.path.realpath(entry.path)}')


def _entries(directory: str) -> list:
    """Non-hidden entries of `directory`, sorted by name."""
    try:
        with os.scandir(directory) as it:
            return sorted((e for e in it if not e.name.startswith('.')), key=lambda e: e.name)
    except OSError as e:
        raise DataError(f'{directory}: cannot list ({e.strerror or e})') from e


def _check_link(path: str, root: str) -> None:
    """Refuse a symbolic link that resolves outside root (walking must not leave it)."""
    target = os.path.realpath(path)
    if os.path.commonpath([root, target]) != root:
        raise DataError(f'{path}: refused, symbolic link to {target}, outside {root}; '
                        f'copy the data in, or point data.dir at a folder that holds it')


def _labels(split: _Split) -> np.ndarray:
    return np.repeat(np.arange(len(split), dtype=np.int32), [len(files) for files in split])


# ---------------------------------------------------------------------------
# Decoding
# ---------------------------------------------------------------------------

def _decode_all(splits, shape, channels, resize, max_pixels, reference, n_workers, origin):
    """{split: uint8 (N, h, w, channels)}, decoded by n_workers processes: this one and a pool."""
    jobs = []  # (split, start, paths)
    sizes = {}
    total = sum(len(files) for split in splits.values() for files in split)
    chunk = max(_MIN_CHUNK, min(_MAX_CHUNK, math.ceil(total / (4 * n_workers))))
    for name in _SPLITS:
        paths = [p for files in splits[name] for p, _, _ in files]
        sizes[name] = (len(paths), *shape, channels)
        jobs += [(name, lo, paths[lo:lo + chunk]) for lo in range(0, len(paths), chunk)]
    settings = (shape, channels, resize, max_pixels, reference)

    n_workers = min(n_workers, len(jobs))
    n_pool = n_workers - 1  # this process decodes too
    if n_pool < 1:
        out = {name: np.empty(size, np.uint8) for name, size in sizes.items()}
        for name, lo, paths in jobs:
            _decode_into(out[name][lo:lo + len(paths)], paths, *settings)
        return out

    ctx = _mp_context()
    shared = ctx.get_start_method() == 'fork'
    if shared:
        # Forked workers write straight into the result: memory shared with them
        # (an anonymous shared mapping, not /dev/shm), so no pixels are pickled.
        out = {name: _shared_empty(size) for name, size in sizes.items()}
        executor = concurrent.futures.ProcessPoolExecutor(
            n_pool, mp_context=ctx, initializer=_attach_output, initargs=(out,))
    else:  # workers that do not share our memory send their chunks back
        quiet_resource_tracker()  # this pool's first lock starts the tracker
        out = {name: np.empty(size, np.uint8) for name, size in sizes.items()}
        executor = concurrent.futures.ProcessPoolExecutor(n_pool, mp_context=ctx)
    try:
        _run_jobs(executor, jobs, out, shared, settings, 2 * n_pool, origin)
    finally:
        executor.shutdown(wait=True, cancel_futures=True)
    return out


def _run_jobs(executor, jobs, out, shared, settings, max_running, origin) -> None:
    """Decode every job: the pool takes them from the front, this process from the back.

    This process would otherwise sit idle waiting. The error raised is the one
    of the first bad file in walking order, whoever decodes what: after a
    failure, only the jobs before it are still decoded.
    """
    running = {}  # future -> job index
    errors = {}   # job index -> DataError
    head, tail = 0, len(jobs)

    def collect(futures):
        for future in futures:
            i = running.pop(future)
            try:
                images = future.result()
            except DataError as e:
                errors[i] = e
                continue
            except concurrent.futures.process.BrokenProcessPool as e:
                raise DataError(
                    f'{origin}: a decoding process died ({e}) Out of memory? Or, without '
                    f'fork, workers import the main script: is its work under '
                    f'`if __name__ == "__main__":`? workers=1 decodes in this process') from e
            if images is not None:  # sent back, not written to shared memory
                name, lo, _ = jobs[i]
                out[name][lo:lo + len(images)] = images

    while True:
        limit = min(tail, min(errors, default=tail))  # nothing after a known error is needed
        while head < limit and len(running) < max_running:
            name, lo, paths = jobs[head]
            running[executor.submit(_decode_shared, name, lo, paths, *settings) if shared
                    else executor.submit(_decode_chunk, paths, *settings)] = head
            head += 1
        if not errors and head < tail:
            tail -= 1
            name, lo, paths = jobs[tail]
            try:
                _decode_into(out[name][lo:lo + len(paths)], paths, *settings)
            except DataError as e:
                errors[tail] = e
            collect([f for f in running if f.done()])
        elif running:
            done, _ = concurrent.futures.wait(running, return_when=concurrent.futures.FIRST_COMPLETED)
            collect(done)
        elif head >= limit:
            break
    if errors:
        raise errors[min(errors)]


def _shared_empty(size) -> np.ndarray:
    """An uninitialised uint8 array in anonymous MAP_SHARED memory: forked children write to it.

    The array owns the mapping (unmapped when the array goes). Being shared,
    its pages stay shared with any process forked later as well, which only
    matters to a child that writes to the dataset in place.
    """
    nbytes = math.prod(size)
    buf = mmap.mmap(-1, max(nbytes, 1))  # fileno -1: anonymous; MAP_SHARED is the default
    return np.frombuffer(buf, np.uint8, count=nbytes).reshape(size)


_SHARED_OUTPUT = None  # in a forked worker: the parent's {split: shared array}


def _attach_output(out) -> None:
    global _SHARED_OUTPUT
    _SHARED_OUTPUT = out


def _decode_shared(name, lo, paths, *settings) -> None:
    """Worker task (forked): decode `paths` into the shared result at [lo, lo + len(paths))."""
    _decode_into(_SHARED_OUTPUT[name][lo:lo + len(paths)], paths, *settings)


def quiet_resource_tracker() -> None:
    """Silences the "leaked shared_memory objects" warning of multiprocessing's resource
    tracker. A streaming run's Grain workers put batches in shared memory; one a worker
    had just written when the stream closed (an error, a signal) is freed by the tracker
    when this process exits, with that warning after the run's one-line error. The
    tracker reads PYTHONWARNINGS once, when this process's first pool that is not forked
    starts it (a fork server decoding a folder, Grain's workers): whichever comes first
    calls this before it."""
    quiet = "ignore:resource_tracker:UserWarning"
    current = os.environ.get("PYTHONWARNINGS", "")
    if quiet not in current:
        os.environ["PYTHONWARNINGS"] = f"{current},{quiet}" if current else quiet


def _mp_context():
    """fork where it is safe (fast start: nothing is imported again), else forkserver/spawn.

    Forking a process in which JAX has started its backends (and their
    threads) can deadlock, and JAX warns about it; such a process gets a fork
    server instead, which imports this module once.
    """
    if sys.platform.startswith('linux') and not _jax_backends_started():
        return multiprocessing.get_context('fork')
    if 'forkserver' in multiprocessing.get_all_start_methods():
        ctx = multiprocessing.get_context('forkserver')
        ctx.set_forkserver_preload(['__main__', __name__])  # no effect once the server runs
        return ctx
    return multiprocessing.get_context('spawn')


def _jax_backends_started() -> bool:
    bridge = sys.modules.get('jax._src.xla_bridge')
    if bridge is None:
        return False
    try:
        return bool(bridge.backends_are_initialized())
    except Exception:  # an unknown JAX: assume threads
        return True


def _pil():
    """PIL.Image, imported on first use (a function-level import costs microseconds per image)."""
    global _PIL_IMAGE
    if _PIL_IMAGE is None:
        from PIL import Image
        _PIL_IMAGE = Image
    return _PIL_IMAGE


_PIL_IMAGE = None


def _decode_chunk(paths, shape, channels, resize, max_pixels, reference) -> np.ndarray:
    """Worker task: decode `paths` into a new uint8 (len(paths), h, w, channels) array."""
    out = np.empty((len(paths), *shape, channels), np.uint8)
    _decode_into(out, paths, shape, channels, resize, max_pixels, reference)
    return out


def _decode_into(out, paths, shape, channels, resize, max_pixels, reference) -> None:
    Image = _pil()

    with warnings.catch_warnings():
        # Pillow warns (rather than raises) between 1x and 2x its pixel limit.
        warnings.simplefilter('error', Image.DecompressionBombWarning)
        for i, path in enumerate(paths):
            image = _decode_file(path, shape, channels, resize, max_pixels, reference)
            out[i] = image if image.ndim == 3 else image[:, :, None]  # grey -> (h, w, 1 or 3)


def _decode_file(path, shape, channels, resize, max_pixels, reference) -> np.ndarray:
    """One image file -> uint8 (h, w) grey or (h, w, 3) RGB of the target shape."""
    Image = _pil()

    try:
        with Image.open(path, formats=_PIL_FORMATS) as im:
            w, h = im.size
            _check_pixels(path, w, h, max_pixels)
            if resize is None:
                if (h, w) != shape:
                    raise DataError(
                        f'{path}: image is {w}x{h} (width x height) but {reference} is '
                        f'{shape[1]}x{shape[0]}; the images differ in size, so set data.image_size '
                        f'(e.g. --config.data.image_size={min(shape)}) to resize them')
            elif im.format in ('JPEG', 'MPO'):
                tw, th = _resized_size(w, h, shape, resize)
                im.draft(None, (math.ceil(tw * _REDUCING_GAP), math.ceil(th * _REDUCING_GAP)))
            im.load()
            im = _to_mode(im, channels)
            if resize is not None:
                im = _resize(im, shape, resize)
            return np.asarray(im)
    except Exception as e:
        raise _decode_error(path, e) from e


def _decode_error(path, error: Exception) -> DataError:
    """Any failure decoding `path` as the DataError that names the file."""
    Image = _pil()
    if isinstance(error, DataError):
        return error
    if isinstance(error, (Image.DecompressionBombError, Image.DecompressionBombWarning)):
        return DataError(f'{path}: refused, a decompression bomb ({error})')
    # Pillow raises OSError, SyntaxError, ValueError, struct.error, ...
    return DataError(f'{path}: cannot decode image ({type(error).__name__}: {error})')


def _check_pixels(path, w, h, max_pixels):
    if w * h > max_pixels:
        raise DataError(f'{path}: refused, its header claims {w}x{h} = {w * h} pixels, over '
                        f'max_pixels={max_pixels} (a decompression bomb, or raise max_pixels)')


def _header_size(path: str, max_pixels: int) -> tuple[int, int]:
    """(height, width) from an image's header, with the checks decoding does."""
    Image = _pil()

    try:
        with warnings.catch_warnings():
            warnings.simplefilter('error', Image.DecompressionBombWarning)
            with Image.open(path, formats=_PIL_FORMATS) as im:
                w, h = im.size
    except Exception as e:
        raise _decode_error(path, e) from e
    _check_pixels(path, w, h, max_pixels)
    return h, w


def _resized_size(w, h, shape, resize) -> tuple[int, int]:
    """(width, height) an image of w x h is resized to before cropping."""
    th, tw = shape
    if resize == 'exact':
        return tw, th
    scale = max(tw / w, th / h)  # short side -> target, long side keeps the aspect ratio
    return max(tw, round(w * scale)), max(th, round(h * scale))


def _resize(im, shape, resize):
    Image = _pil()

    th, tw = shape
    w, h = im.size
    nw, nh = _resized_size(w, h, shape, resize)
    if (nw, nh) != (w, h):
        im = im.resize((nw, nh), Image.Resampling.BILINEAR, reducing_gap=_REDUCING_GAP)
    if (nw, nh) != (tw, th):  # centre crop
        left, top = (nw - tw) // 2, (nh - th) // 2
        im = im.crop((left, top, left + tw, top + th))
    return im


def _to_mode(im, channels):
    """Any Pillow mode -> 'RGB' (channels=3; grey stays 'L', widened later) or 'L' (channels=1)."""
    Image = _pil()

    mode = im.mode
    if mode in ('L', 'RGB'):
        pass
    elif mode.startswith('I') or mode == 'F':  # 16/32-bit grey; Pillow's convert would clip
        a = np.asarray(im)
        if mode == 'F':
            a = np.clip(np.rint(a), 0, 255)
        else:  # 16-bit samples (PNG): 0..65535 -> 0..255, rounded
            a = (np.clip(a.astype(np.int64), 0, 65535) + 128) // 257
        im = Image.fromarray(a.astype(np.uint8))
    elif mode in ('1', 'LA', 'La'):
        im = im.convert('L')
    elif mode in ('P', 'PA'):
        has_alpha = mode == 'PA' or 'transparency' in im.info
        im = im.convert('RGBA' if has_alpha else 'RGB')  # via RGBA: no Pillow warning
        if has_alpha:
            im = im.convert('RGB')
    else:  # RGBA, RGBa, RGBX, CMYK, YCbCr, ...
        im = im.convert('RGB')
    if channels == 1 and im.mode == 'RGB':
        im = im.convert('L')
    return im


# ---------------------------------------------------------------------------
# Cache
# ---------------------------------------------------------------------------

def _cache_key(root, splits, shape, resize, channels, max_pixels) -> str:
    """sha256 of the settings and every file's relative path, size and mtime."""
    import PIL

    h = hashlib.sha256()
    settings = {'version': _CACHE_VERSION, 'pillow': PIL.__version__, 'root': root,
                'image_size': shape, 'resize': resize if shape else None, 'channels': channels,
                'max_pixels': max_pixels}
    h.update(json.dumps(settings, sort_keys=True).encode())
    for name in _SPLITS:
        h.update(f'\n{name}\n'.encode())
        for label, files in enumerate(splits[name]):
            for path, rel, entry in files:
                st = _stat(entry)
                h.update(b'%d\0%s\0%d\0%d\n' % (label, os.fsencode(rel), st.st_size, st.st_mtime_ns))
    return h.hexdigest()


def _stat(entry: os.DirEntry) -> os.stat_result:
    try:
        return entry.stat()  # follows links: the target's size and mtime
    except OSError as e:
        raise DataError(f'{entry.path}: cannot read ({e.strerror or e})') from e


def _read_cache(cache_path, key, class_names, splits, shape, channels):
    """(x_train, y_train, x_test, y_test) from the cache, or None if absent or unusable."""
    if not os.path.isfile(cache_path):
        return None
    try:
        with np.load(cache_path, allow_pickle=False) as z:
            if str(z['key']) != key or tuple(str(c) for c in z['class_names']) != class_names:
                raise ValueError('key or classes differ')
            arrays = tuple(z[k] for k in ('x_train', 'y_train', 'x_test', 'y_test'))
        for x, y, name in ((arrays[0], arrays[1], 'train'), (arrays[2], arrays[3], 'test')):
            n = sum(len(files) for files in splits[name])
            image_shape = x.shape[1:3] if shape is None else shape
            if (x.dtype != np.uint8 or x.shape != (n, *image_shape, channels)
                    or y.dtype != np.int32 or not np.array_equal(y, _labels(splits[name]))):
                raise ValueError(f'{name} arrays do not fit the folder')
        if arrays[0].shape[1:] != arrays[2].shape[1:]:
            raise ValueError('train and test shapes differ')
    except Exception as e:  # any damage at all: decode again and rewrite it, never fail
        log.warning('ignoring unusable cache %s (%s: %s); decoding again', cache_path,
                    type(e).__name__, e)
        return None
    return arrays


def _write_cache(cache_path, key, arrays, class_names) -> None:
    """Save atomically (temp file + os.replace); failing to cache is a warning, not an error."""
    directory = os.path.dirname(cache_path)
    tmp = None
    try:
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix='.' + os.path.basename(cache_path),
                                   suffix='.tmp')
        with os.fdopen(fd, 'wb') as f:
            np.savez(f, key=np.array(key), class_names=np.array(class_names, dtype=str),
                     **dict(zip(('x_train', 'y_train', 'x_test', 'y_test'), arrays)))
        os.replace(tmp, cache_path)
        tmp = None
    except Exception as e:  # a full disk or a read-only cache must not stop training
        log.warning('could not write the image-folder cache %s (%s: %s); continuing without it',
                    cache_path, type(e).__name__, e)
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
