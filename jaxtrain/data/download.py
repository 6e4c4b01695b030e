"""Download the built-in datasets into the local cache, verified by checksum.

`download(name)` fetches the official files of cifar10, cifar100, mnist or
fashion_mnist into the layout `jaxtrain.data.load` already searches:

    <cache>/cifar-10-python.tar.gz
    <cache>/cifar-100-python.tar.gz
    <cache>/mnist/{train,t10k}-{images-idx3,labels-idx1}-ubyte.gz
    <cache>/fashion-mnist/{train,t10k}-{images-idx3,labels-idx1}-ubyte.gz

Each file streams into a temporary file beside its final name and is renamed
into place (atomically) only after its MD5 matches, so a cache never holds a
partial or corrupt file under a real name. Files already present with the
right checksum are not fetched again. `fetch` can check a SHA-256 instead, or a
hex prefix of one (torchvision names its weight files by the first 8 hex digits
of their SHA-256, e.g. resnet50-0676ba61.pth); jaxtrain.pretrained uses that.

A mirror (the `mirror` argument or $JAXTRAIN_DOWNLOAD_MIRROR) replaces the
official URL bases and must serve the cache layout above: a web server over a
populated cache directory is a valid mirror, e.g. http://host:8000/ serving
http://host:8000/mnist/train-images-idx3-ubyte.gz. file:// URLs work too.
"""
from __future__ import annotations

import dataclasses
import hashlib
import http.client
import os
import re
import secrets
import urllib.error
import urllib.request
from collections.abc import Mapping

from jaxtrain.data.dataset import DataError

# The same directory as jaxtrain.data.CACHE_DIR; not imported from there because
# jaxtrain.data may import this module.
DEFAULT_CACHE_DIR = '~/.cache/jaxtrain'
MIRROR_ENV_VAR = 'JAXTRAIN_DOWNLOAD_MIRROR'
TIMEOUT = 60.0  # seconds without progress (connect, or between reads) before giving up
USER_AGENT = 'jaxtrain-download/1 (+python-urllib)'
_CHUNK = 1 << 20


@dataclasses.dataclass(frozen=True)
class Resource:
    """The files of one dataset: where they come from and where they go."""
    urls: tuple[str, ...]          # URL bases, tried in order; a file's URL is base + file name
    subdir: str                    # where the files go, relative to the cache dir ('' = in it)
    files: tuple[tuple[str, str], ...]  # (file name, MD5 hex digest)


# Checksums: the MD5 values torchvision publishes in its dataset classes
# (pytorch/vision, torchvision/datasets/cifar.py: CIFAR10.tgz_md5 and
# CIFAR100.tgz_md5; torchvision/datasets/mnist.py: MNIST.resources and
# FashionMNIST.resources). URLs: the Toronto originals for CIFAR; for MNIST the
# PyTorch-maintained S3 copy first (yann.lecun.com is often unreachable or
# refuses downloads), the original second; Zalando's S3 bucket for Fashion-MNIST.
_IDX_NAMES = ('train-images-idx3-ubyte.gz', 'train-labels-idx1-ubyte.gz',
              't10k-images-idx3-ubyte.gz', 't10k-labels-idx1-ubyte.gz')
RESOURCES: dict[str, Resource] = {
    'cifar10': Resource(
        urls=('https://www.cs.toronto.edu/~kriz/',),
        subdir='',
        files=(('cifar-10-python.tar.gz', 'c58f30108f718f92721af3b95e74349a'),)),
    'cifar100': Resource(
        urls=('https://www.cs.toronto.edu/~kriz/',),
        subdir='',
        files=(('cifar-100-python.tar.gz', 'eb9058c3a382ffc7106e4002c42a8d85'),)),
    'mnist': Resource(
        urls=('https://ossci-datasets.s3.amazonaws.com/mnist/', 'http://yann.lecun.com/exdb/mnist/'),
        subdir='mnist',
        files=tuple(zip(_IDX_NAMES, ('f68b3c2dcbeaaa9fbdd348bbdeb94873',
                                     'd53e105ee54ea40749a09fcbcd1e9432',
                                     '9fb629c4189551a2d022fa330f9573f3',
                                     'ec29112dd5afa0611ce80d1b7f02629c')))),
    'fashion_mnist': Resource(
        urls=('http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/',),
        subdir='fashion-mnist',
        files=tuple(zip(_IDX_NAMES, ('8d4fb7e6c68d591d4c3dfef9ec88bf0d',
                                     '25c81989df183df01b3e8a0aad5dffbe',
                                     'bef4ecab320f06d8554ea6380940ec79',
                                     'bb300cfdad3c16e7a12a480ee83cd310')))),
}


def download(name: str, cache_dir: str = DEFAULT_CACHE_DIR, mirror: str | None = None,
             progress: bool = True, *, checksums: Mapping[str, str] | None = None,
             timeout: float = TIMEOUT) -> str:
    """Fetch dataset `name` into cache_dir unless it is there already; return the dir to load from.

    mirror: a URL base serving the cache layout (see the module docstring) used
    instead of the official URLs; defaults to $JAXTRAIN_DOWNLOAD_MIRROR.
    checksums: {file name: MD5} overriding the published ones (for files served
    by a mirror that are not the official ones, e.g. in tests).
    Raises DataError naming the URL for any failed or corrupt download; the
    failed file leaves nothing behind.
    """
    if name not in RESOURCES:
        raise DataError(f'unknown dataset {name!r} to download; available: '
                        f'{", ".join(sorted(RESOURCES))}')
    resource = RESOURCES[name]
    expected = {fname: md5.lower() for fname, md5 in resource.files}
    unknown = set(checksums or ()) - set(expected)
    if unknown:
        raise DataError(f'checksums given for file(s) {", ".join(sorted(unknown))} that {name} '
                        f'does not have; its files: {", ".join(expected)}')
    expected.update({f: md5.lower() for f, md5 in (checksums or {}).items()})

    mirror = mirror or os.environ.get(MIRROR_ENV_VAR) or None
    if mirror:
        base = mirror.rstrip('/') + '/'
        bases = (base + resource.subdir + '/' if resource.subdir else base,)
    else:
        bases = resource.urls

    target_dir = os.path.expanduser(os.fspath(cache_dir))
    if resource.subdir:
        target_dir = os.path.join(target_dir, resource.subdir)
    created = _missing_dirs(target_dir)
    try:
        os.makedirs(target_dir, exist_ok=True)
    except OSError as e:
        raise DataError(f'{target_dir}: cannot create download directory ({e.strerror or e})') from e
    try:
        for fname, md5 in expected.items():
            path = os.path.join(target_dir, fname)
            if os.path.isfile(path) and _md5(path) == md5:
                continue
            _fetch_first([b + fname for b in bases], path, md5, progress, timeout)
    except BaseException:
        for directory in created:  # leave no new empty directories behind either
            try:
                os.rmdir(directory)
            except OSError:
                break
        raise
    return target_dir


def _missing_dirs(path: str) -> list[str]:
    """path and those of its ancestors that do not exist yet, deepest first."""
    missing = []
    path = os.path.abspath(path)
    while not os.path.isdir(path):
        missing.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return missing


def _fetch_first(urls: list[str], path: str, md5: str, progress: bool, timeout: float) -> None:
    """Fetch from the first URL that works; DataError listing every failure if none does."""
    errors = []
    for url in urls:
        try:
            fetch(url, path, md5, progress=progress, timeout=timeout)
            return
        except DataError as e:
            errors.append(e)
    if len(errors) == 1:
        raise errors[0]
    raise DataError(f'all {len(errors)} sources failed: ' + '; '.join(map(str, errors))) from errors[-1]


def fetch(url: str, path: str, md5: str | None = None, *, sha256: str | None = None,
          progress: bool = True, timeout: float = TIMEOUT) -> dict[str, str]:
    """Stream `url` to `path` via a temp file beside it, check its digests, then rename into place.

    md5: the full MD5 hex digest. sha256: the SHA-256 hex digest or a prefix of it
    of at least 8 digits (what torchvision's file names publish).
    Returns the hex digests it computed, {'md5': ...} and/or {'sha256': ...} (MD5
    when neither is given). Raises DataError (message names the URL) on HTTP
    errors, connection failures, timeouts, truncation or a checksum mismatch;
    the temp file is removed and `path` is left as it was.
    """
    expected = _expected_digests(md5, sha256)
    # O_EXCL, a random name: tempfile.mkstemp would do, but makes the file mode 0600,
    # unreadable to others in a shared cache; this one gets the usual 0666 & ~umask.
    tmp = os.path.join(os.path.dirname(os.path.abspath(path)),
                       f'.{os.path.basename(path)}.{secrets.token_hex(6)}.part')
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, 'O_BINARY', 0), 0o666)
    except OSError as e:
        raise DataError(f'{tmp}: cannot create file to download {url} into ({e.strerror or e})') from e
    try:
        with os.fdopen(fd, 'wb') as out:
            actual = _stream(url, out, os.path.basename(path), progress, timeout,
                             tuple(expected) or ('md5',))
        for algorithm, want in expected.items():
            got = actual[algorithm]
            if not matches(got, want, prefix=algorithm == 'sha256'):
                what = algorithm if len(want) == len(got) else f'{algorithm} prefix'
                raise DataError(f'{url}: checksum mismatch, expected {what} {want}, got {got} '
                                f'(corrupt download or a changed file); nothing was saved')
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return actual


def matches(actual: str, expected: str, prefix: bool = False) -> bool:
    """Whether hex digest `actual` is `expected` (or, with prefix, starts with it)."""
    expected = expected.lower()
    return actual.startswith(expected) if prefix else actual == expected


def _expected_digests(md5: str | None, sha256: str | None) -> dict[str, str]:
    """{algorithm: lower-case hex} of the digests given; a malformed one is a caller's bug."""
    expected = {}
    if md5 is not None:
        expected['md5'] = md5.lower()
    if sha256 is not None:
        if not re.fullmatch(r'[0-9a-fA-F]{8,64}', sha256):
            raise ValueError(f'sha256 must be 8 to 64 hex digits, got {sha256!r}')
        expected['sha256'] = sha256.lower()
    return expected


def _stream(url: str, out, label: str, progress: bool, timeout: float,
            algorithms: tuple[str, ...] = ('md5',)) -> dict[str, str]:
    """Copy url's body into the open file `out`; return {algorithm: hex digest} of it."""
    request = urllib.request.Request(url, headers={'User-Agent': USER_AGENT})
    digests = {name: hashlib.new(name) for name in algorithms}
    received = 0
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            length = response.headers.get('Content-Length')
            length = int(length) if length and length.strip().isdigit() else None
            with _progress_bar(progress, length, label) as bar:
                while True:
                    chunk = response.read(_CHUNK)
                    if not chunk:
                        break
                    out.write(chunk)
                    for digest in digests.values():
                        digest.update(chunk)
                    received += len(chunk)
                    bar.update(len(chunk))
    except urllib.error.HTTPError as e:
        e.close()
        raise DataError(f'{url}: download failed, HTTP {e.code} {e.reason}') from e
    except urllib.error.URLError as e:
        reason = e.reason.strerror if isinstance(e.reason, OSError) and e.reason.strerror else e.reason
        what = 'cannot open' if url.startswith('file:') else 'cannot connect'
        raise DataError(f'{url}: download failed, {what} ({_one_line(reason)})') from e
    except http.client.IncompleteRead as e:
        raise DataError(f'{url}: download truncated, the connection closed after '
                        f'{received + len(e.partial)} bytes') from e
    except TimeoutError as e:
        raise DataError(f'{url}: download failed, no data for {timeout:g} s '
                        f'(after {received} bytes)') from e
    except (http.client.HTTPException, OSError, ValueError) as e:
        raise DataError(f'{url}: download failed after {received} bytes '
                        f'({type(e).__name__}: {_one_line(e)})') from e
    if length is not None and received != length:
        raise DataError(f'{url}: download truncated, got {received} of {length} bytes')
    return {name: digest.hexdigest() for name, digest in digests.items()}


def _progress_bar(progress: bool, total: int | None, label: str):
    from tqdm import tqdm
    return tqdm(total=total, desc=label, unit='B', unit_scale=True, unit_divisor=1024,
                disable=not progress, leave=False, dynamic_ncols=True)


def _md5(path: str) -> str:
    return file_digest(path, 'md5')


def file_digest(path: str, algorithm: str = 'sha256') -> str:
    """Hex digest of a local file, read in chunks (weight files run to hundreds of MB)."""
    digest = hashlib.new(algorithm)
    with open(path, 'rb') as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _one_line(x) -> str:
    return ' '.join(str(x).split()) or type(x).__name__
