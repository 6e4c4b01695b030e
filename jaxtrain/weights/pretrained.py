"""Named pretrained weights ('torchvision:resnet50') resolved to a verified local file.

`resolve(name)` looks the name up in WEIGHTS, the official file of each entry,
and downloads it once, with jaxtrain.data.download.fetch (a temp file renamed
into place only after its SHA-256 checks out; progress bar; timeouts), into

    <cache>/weights/<source>/<file>          e.g. weights/torchvision/resnet50-11ad3fa6.pth
    <cache>/weights/<source>/<file>.sha256   its verified SHA-256, in `sha256sum` format

Where each file's hash comes from:
- torchvision entries are pinned: torchvision names each weight file by the first
  8 hex digits of its SHA-256 (resnet50-11ad3fa6.pth) and torch.hub checks that
  prefix; so does jaxtrain.
- timm entries (files on the Hugging Face hub) have no hash published anywhere
  jaxtrain can pin it from, so their `hash` is None and the hash comes from the
  server's published metadata: the hub answers a request for an LFS file with
  the header X-Linked-Etag, the file's full SHA-256 (what huggingface_hub reads
  as the file's etag). jaxtrain asks for it (a HEAD request, redirects not
  followed) and then checks the download against it. That guards against a
  broken or truncated transfer, not against a compromised hub.

A mirror (the `mirror` argument or $JAXTRAIN_DOWNLOAD_MIRROR, as for the
datasets) replaces the official URLs and serves the cache layout:
<mirror>/weights/<source>/<file>. A mirror is a plain file server, so for an
entry without a pinned hash it must also serve <file>.sha256 beside the file;
without one jaxtrain refuses the file. A web server over a populated cache
directory is therefore a valid mirror.

A cached file is hashed again on every resolve (SHA-256 runs at about 1 GB/s,
a fraction of a second for a ResNet-50 and well under the time to load it) and
compared with the pinned hash or, failing one, with its .sha256 file; only a
match is used without the network, anything else is downloaded again.
Nothing here touches the network at import.
"""
from __future__ import annotations

import dataclasses
import difflib
import http.client
import os
import re
import urllib.error
import urllib.request
from collections.abc import Mapping

from jaxtrain.data import download
from jaxtrain.data.dataset import DataError
from jaxtrain.errors import ConfigError

SOURCES = ('torchvision:', 'timm:')
MODELS = ('resnet18', 'resnet34', 'resnet50', 'vit_tiny', 'vit_small', 'vit_base')
TORCHVISION_MEAN, TORCHVISION_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
TIMM_AUGREG_MEAN, TIMM_AUGREG_STD = (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)
_SHA256 = re.compile(r'[0-9a-f]{64}')


class UnknownWeightsError(ConfigError):
    """A weights name not in the table; the message lists the nearest known names."""


@dataclasses.dataclass(frozen=True)
class Weights:
    """One official weights file and what a model needs to use it."""
    url: str                        # the official download URL
    hash: str | None                # SHA-256 hex digest or a prefix (>= 8); None: the server's
    file: str                       # the file's name in the cache
    model: str                      # the jaxtrain model.name the weights fit
    source: str                     # 'torchvision' | 'timm'
    format: str                     # 'pth' | 'safetensors'
    mean: tuple[float, float, float]  # the input normalisation the weights were trained with
    std: tuple[float, float, float]
    image_size: int = 224
    num_classes: int = 1000


def _torchvision(file: str, model: str) -> Weights:
    """An entry for https://download.pytorch.org/models/<file>; the hash is in the name."""
    return Weights(url=f'https://download.pytorch.org/models/{file}',
                   hash=file.rsplit('-', 1)[1].split('.')[0], file=file, model=model,
                   source='torchvision', format='pth',
                   mean=TORCHVISION_MEAN, std=TORCHVISION_STD)


def _timm(name: str, model: str) -> Weights:
    """An entry for the Hugging Face repo timm/<name>; its hash comes from the hub."""
    return Weights(url=f'https://huggingface.co/timm/{name}/resolve/main/model.safetensors',
                   hash=None, file=f'{name}.safetensors', model=model,
                   source='timm', format='safetensors',
                   mean=TIMM_AUGREG_MEAN, std=TIMM_AUGREG_STD)


# The torchvision URLs are those of torchvision 0.29's ResNet{18,34,50}_Weights enums
# (torchvision/models/resnet.py), their mean/std ImageClassification's defaults; all
# evaluate at crop 224 (resize 256, or 232 for resnet50 IMAGENET1K_V2). The timm names,
# hub repos and mean/std are timm 1.0's default_cfgs (timm/models/vision_transformer.py).
WEIGHTS: dict[str, Weights] = {
    'torchvision:resnet18': _torchvision('resnet18-f37072fd.pth', 'resnet18'),     # IMAGENET1K_V1
    'torchvision:resnet34': _torchvision('resnet34-b627a593.pth', 'resnet34'),     # IMAGENET1K_V1
    'torchvision:resnet50': _torchvision('resnet50-11ad3fa6.pth', 'resnet50'),     # IMAGENET1K_V2
    'torchvision:resnet50.v1': _torchvision('resnet50-0676ba61.pth', 'resnet50'),  # IMAGENET1K_V1
    'timm:vit_tiny_patch16_224.augreg_in21k_ft_in1k':
        _timm('vit_tiny_patch16_224.augreg_in21k_ft_in1k', 'vit_tiny'),
    'timm:vit_small_patch16_224.augreg_in21k_ft_in1k':
        _timm('vit_small_patch16_224.augreg_in21k_ft_in1k', 'vit_small'),
    'timm:vit_base_patch16_224.augreg2_in21k_ft_in1k':
        _timm('vit_base_patch16_224.augreg2_in21k_ft_in1k', 'vit_base'),
    'timm:vit_base_patch16_224.augreg_in21k_ft_in1k':
        _timm('vit_base_patch16_224.augreg_in21k_ft_in1k', 'vit_base'),
}


def is_name(init_from: str) -> bool:
    """Whether model.init_from names table weights rather than a path."""
    return isinstance(init_from, str) and init_from.startswith(SOURCES)


def entry(name: str, weights: Mapping[str, Weights] | None = None) -> Weights:
    """The table entry for `name`; an unknown name is a one-line error naming the nearest."""
    table = WEIGHTS if weights is None else weights
    if name in table:
        return table[name]
    tail = name.rpartition(':')[2]
    near = ([k for k in sorted(table) if tail and tail in k][:3]
            or difflib.get_close_matches(name, list(table), n=3, cutoff=0.6))
    hint = f'did you mean {", ".join(near)}? ' if near else ''
    raise UnknownWeightsError(f'unknown pretrained weights {name!r}; {hint}'
                              f'known: {", ".join(sorted(table))}')


def resolve(name: str, cache_dir: str = download.DEFAULT_CACHE_DIR, mirror: str | None = None,
            progress: bool = True, *, weights: Mapping[str, Weights] | None = None,
            timeout: float = download.TIMEOUT) -> tuple[str, Weights]:
    """(local path, table entry) of weights `name`, downloaded and verified unless cached.

    mirror: a URL base serving <mirror>/weights/<source>/<file> (and <file>.sha256
    for entries without a pinned hash); defaults to $JAXTRAIN_DOWNLOAD_MIRROR.
    weights: the table to look the name up in (WEIGHTS; tests pass their own).
    Raises UnknownWeightsError (a ConfigError) for an unknown name and DataError,
    naming the URL, for a failed or corrupt download, which leaves nothing behind.
    """
    spec = entry(name, weights)
    directory = os.path.join(os.path.expanduser(os.fspath(cache_dir)), 'weights', spec.source)
    path = os.path.join(directory, spec.file)
    if _cached(path, spec.hash):
        return path, spec
    mirror = mirror or os.environ.get(download.MIRROR_ENV_VAR) or None
    url = f'{mirror.rstrip("/")}/weights/{spec.source}/{spec.file}' if mirror else spec.url
    created = download._missing_dirs(directory)
    try:
        _download(url, path, spec.hash, from_mirror=bool(mirror), progress=progress,
                  timeout=timeout)
    except BaseException as error:
        for new_dir in created:  # leave no new empty directories behind either
            try:
                os.rmdir(new_dir)
            except OSError:
                break
        if isinstance(error, DataError):
            raise DataError(f'{error}; {offline_hint(spec)}') from error
        raise
    return path, spec


def offline_hint(spec: Weights) -> str:
    """What to do without the network: a mirror, or the file fetched elsewhere."""
    return (f'without the network, set ${download.MIRROR_ENV_VAR} to a mirror serving '
            f'weights/{spec.source}/{spec.file}, or fetch {spec.url} elsewhere and pass the '
            f'file itself: model.init_from=/path/to/{spec.file}')


def _download(url: str, path: str, pinned: str | None, *, from_mirror: bool, progress: bool,
              timeout: float) -> None:
    """Fetch url to path against the pinned or the published SHA-256, then record it beside."""
    directory = os.path.dirname(path)
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:
        raise DataError(f'{directory}: cannot create the weights directory '
                        f'({e.strerror or e})') from e
    expected = pinned or _published_sha256(url, from_mirror=from_mirror, timeout=timeout)
    actual = download.fetch(url, path, sha256=expected, progress=progress, timeout=timeout)
    try:
        _write_sha256(path, actual['sha256'])
    except OSError as e:
        raise DataError(f'{path}.sha256: cannot write ({e.strerror or e})') from e


def _cached(path: str, pinned: str | None) -> bool:
    """Whether `path` holds the right file: its SHA-256 matches the pinned hash, or its .sha256."""
    if not os.path.isfile(path):
        return False
    expected = pinned or _read_sha256_file(path + '.sha256')
    return bool(expected) and download.matches(download.file_digest(path), expected, prefix=True)


def _read_sha256_file(path: str) -> str | None:
    """The digest in a `sha256sum`-style file, or None if it is missing or malformed."""
    try:
        with open(path, encoding='ascii') as f:
            return _parse_sha256(f.read(4096))
    except (OSError, ValueError):
        return None


def _parse_sha256(text: str) -> str | None:
    """The leading 64-hex-digit word of text (lower-cased), or None."""
    words = text.split()
    word = words[0].lower() if words else ''
    return word if _SHA256.fullmatch(word) else None


def _write_sha256(path: str, digest: str) -> None:
    """Record a verified file's SHA-256 beside it, so the cache can serve as a mirror
    (written in place: a torn one reads as malformed, and the file is fetched again)."""
    with open(path + '.sha256', 'w', encoding='ascii') as f:
        f.write(f'{digest}  {os.path.basename(path)}\n')


def _published_sha256(url: str, *, from_mirror: bool, timeout: float) -> str:
    """The SHA-256 the server publishes for `url`: <url>.sha256 on a mirror, else the
    hub's X-Linked-Etag header; DataError if there is none (nothing is trusted unhashed)."""
    if from_mirror:
        text = _get_small(url + '.sha256', timeout)
        digest = _parse_sha256(text)
        if digest is None:
            raise DataError(f'{url}.sha256: not a SHA-256 (the mirror must serve the file\'s '
                            f'`sha256sum` beside it, as a jaxtrain cache has)')
        return digest
    headers = _head_headers(url, timeout)
    etag = headers.get('X-Linked-Etag') or ''
    digest = _parse_sha256(etag.removeprefix('W/').strip('"'))
    if digest is None:
        raise DataError(f'{url}: the server publishes no SHA-256 for it (no X-Linked-Etag '
                        f'header), and jaxtrain pins none; nothing was downloaded')
    return digest


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """Stop at the first redirect: the hub puts X-Linked-Etag on it, not on the CDN's reply."""

    def redirect_request(self, *args, **kwargs):
        return None


def _head_headers(url: str, timeout: float):
    """The headers of a HEAD request for url, redirects not followed."""
    request = urllib.request.Request(url, method='HEAD',
                                     headers={'User-Agent': download.USER_AGENT})
    opener = urllib.request.build_opener(_NoRedirect)
    try:
        with opener.open(request, timeout=timeout) as response:
            return response.headers
    except urllib.error.HTTPError as e:
        e.close()
        if 300 <= e.code < 400:
            return e.headers
        raise DataError(f'{url}: cannot get its published SHA-256, HTTP {e.code} {e.reason}') \
            from e
    except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as e:
        reason = getattr(e, 'reason', e)
        raise DataError(f'{url}: cannot get its published SHA-256: the server cannot be reached '
                        f'(no network? {download._one_line(reason)})') from e


def _get_small(url: str, timeout: float, limit: int = 4096) -> str:
    """The first `limit` bytes of url as text (a .sha256 file); DataError naming the URL."""
    request = urllib.request.Request(url, headers={'User-Agent': download.USER_AGENT})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.read(limit).decode('ascii', 'replace')
    except urllib.error.HTTPError as e:
        e.close()
        raise DataError(f'{url}: cannot get the SHA-256 of the file beside it, HTTP {e.code} '
                        f'{e.reason} (a mirror must serve <file>.sha256 for weights jaxtrain '
                        f'pins no hash for)') from e
    except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as e:
        reason = getattr(e, 'reason', e)
        raise DataError(f'{url}: cannot get the SHA-256 of the file beside it '
                        f'({download._one_line(reason)})') from e
