"""jaxtrain.pretrained: named weights resolved against a local HTTP server, and the table's form.

The server on 127.0.0.1 serves small fake weight files under prefixes, each a
way to serve or fail: /good/ serves files (and is the mirror), /short/ announces
more bytes than it sends, /hub/ answers like the Hugging Face hub (a redirect to
/good/ carrying the file's SHA-256 in X-Linked-Etag), /badhub/ publishes a wrong
SHA-256, /nohash/ publishes none. Tests pass their own table (weights=).
"""
import hashlib
import http.server
import os
import re
import socket
import threading

import pytest

from jaxtrain.data import DataError
from jaxtrain.data import download as dl
from jaxtrain.errors import ConfigError
from jaxtrain.weights import pretrained

RESNET = b'fake resnet18 state_dict ' * 4000
VIT = b'fake vit safetensors ' * 3000
RESNET_SHA = hashlib.sha256(RESNET).hexdigest()
VIT_SHA = hashlib.sha256(VIT).hexdigest()
RESNET_FILE = f'resnet18-{RESNET_SHA[:8]}.pth'
VIT_FILE = 'vit_tiny_patch16_224.augreg_in21k_ft_in1k.safetensors'


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = 'HTTP/1.1'

    def do_GET(self):  # noqa: N802 (http.server's name)
        self._answer(body=True)

    def do_HEAD(self):  # noqa: N802
        self._answer(body=False)

    def _answer(self, body):
        server = self.server
        server.requests.append((self.command, self.path))
        prefix, _, rest = self.path.lstrip('/').partition('/')
        data = server.files.get(rest)
        if data is None or prefix not in ('good', 'short', 'hub', 'badhub', 'nohash'):
            self.send_error(404)
            return
        if prefix in ('hub', 'badhub', 'nohash'):  # the hub: a redirect to the CDN, hash on it
            self.send_response(302)
            self.send_header('Location', f'http://127.0.0.1:{server.server_address[1]}/good/{rest}')
            if prefix != 'nohash':
                sha = hashlib.sha256(data if prefix == 'hub' else b'other').hexdigest()
                self.send_header('X-Linked-Etag', f'"{sha}"')
            self.send_header('Content-Length', '0')
            self.end_headers()
            return
        self.send_response(200)
        self.send_header('Content-Type', 'application/octet-stream')
        self.send_header('Content-Length', str(len(data) + (1000 if prefix == 'short' else 0)))
        self.send_header('Connection', 'close')
        self.end_headers()
        if body:
            self.wfile.write(data)
        self.close_connection = True

    def log_message(self, *args):
        pass


@pytest.fixture(scope='module')
def server():
    """(base URL, server); files keyed by their path below the prefix."""
    httpd = http.server.ThreadingHTTPServer(('127.0.0.1', 0), _Handler)
    httpd.requests = []
    httpd.files = {
        RESNET_FILE: RESNET, VIT_FILE: VIT,
        f'weights/torchvision/{RESNET_FILE}': RESNET,  # the mirror layout
        f'weights/timm/{VIT_FILE}': VIT,
        f'weights/timm/{VIT_FILE}.sha256': f'{VIT_SHA}  {VIT_FILE}\n'.encode(),
        'weights/timm/unhashed.safetensors': VIT,
    }
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f'http://127.0.0.1:{httpd.server_address[1]}', httpd
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.fixture(autouse=True)
def no_mirror(monkeypatch):
    """conftest points $JAXTRAIN_DOWNLOAD_MIRROR at a closed port; these tests set their own."""
    monkeypatch.delenv(dl.MIRROR_ENV_VAR, raising=False)


def closed_port_url():
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        port = s.getsockname()[1]
    return f'http://127.0.0.1:{port}'


def resnet(url, sha=RESNET_SHA[:8], file=RESNET_FILE):
    base = pretrained.WEIGHTS['torchvision:resnet18']
    return pretrained.Weights(**{**vars(base), 'url': url, 'hash': sha, 'file': file})


def vit(url, sha=None, file=VIT_FILE):
    base = pretrained.WEIGHTS['timm:vit_tiny_patch16_224.augreg_in21k_ft_in1k']
    return pretrained.Weights(**{**vars(base), 'url': url, 'hash': sha, 'file': file})


def files_under(root):
    return sorted(os.path.relpath(os.path.join(d, f), root)
                  for d, _, fs in os.walk(root) for f in fs)


# ---------------------------------------------------------------------------
# Success and the cache
# ---------------------------------------------------------------------------

def test_download_lands_in_cache_and_second_call_does_not_fetch(server, tmp_path):
    url, httpd = server
    table = {'torchvision:resnet18': resnet(f'{url}/good/{RESNET_FILE}')}
    before = len(httpd.requests)
    path, spec = pretrained.resolve('torchvision:resnet18', str(tmp_path), progress=True,
                                    weights=table)
    assert path == str(tmp_path / 'weights' / 'torchvision' / RESNET_FILE)
    assert spec is table['torchvision:resnet18']
    assert open(path, 'rb').read() == RESNET
    assert files_under(tmp_path) == [f'weights/torchvision/{RESNET_FILE}',
                                     f'weights/torchvision/{RESNET_FILE}.sha256']
    assert open(path + '.sha256').read() == f'{RESNET_SHA}  {RESNET_FILE}\n'
    assert len(httpd.requests) == before + 1

    assert pretrained.resolve('torchvision:resnet18', str(tmp_path), weights=table) == (path, spec)
    assert len(httpd.requests) == before + 1


def test_corrupt_cached_file_is_fetched_again(server, tmp_path):
    url, httpd = server
    table = {'torchvision:resnet18': resnet(f'{url}/good/{RESNET_FILE}')}
    target = tmp_path / 'weights' / 'torchvision' / RESNET_FILE
    target.parent.mkdir(parents=True)
    target.write_bytes(b'not the weights')
    before = len(httpd.requests)
    pretrained.resolve('torchvision:resnet18', str(tmp_path), progress=False, weights=table)
    assert len(httpd.requests) == before + 1
    assert target.read_bytes() == RESNET


def test_hub_published_sha256_is_checked_and_cached(server, tmp_path):
    """No pinned hash: the hub's X-Linked-Etag (HEAD, redirect not followed) is the hash;
    the cached file is verified later by its .sha256, without the network."""
    url, httpd = server
    name = 'timm:vit_tiny_patch16_224.augreg_in21k_ft_in1k'
    table = {name: vit(f'{url}/hub/{VIT_FILE}')}
    before = len(httpd.requests)
    path, _ = pretrained.resolve(name, str(tmp_path), progress=False, weights=table)
    assert open(path, 'rb').read() == VIT
    assert path == str(tmp_path / 'weights' / 'timm' / VIT_FILE)
    assert httpd.requests[before:] == [('HEAD', f'/hub/{VIT_FILE}'), ('GET', f'/hub/{VIT_FILE}'),
                                       ('GET', f'/good/{VIT_FILE}')]
    assert open(path + '.sha256').read().split()[0] == VIT_SHA
    pretrained.resolve(name, str(tmp_path), progress=False, weights=table)
    assert len(httpd.requests) == before + 3


# ---------------------------------------------------------------------------
# Failures: one line naming the URL, nothing left behind
# ---------------------------------------------------------------------------

def assert_one_line_naming(error, url):
    message = str(error.value)
    assert url in message and '\n' not in message, message


def test_wrong_hash_leaves_nothing(server, tmp_path):
    url, _ = server
    source = f'{url}/good/{RESNET_FILE}'
    table = {'torchvision:resnet18': resnet(source, sha='deadbeef')}
    with pytest.raises(DataError, match=f'expected sha256 prefix deadbeef, got {RESNET_SHA}') as e:
        pretrained.resolve('torchvision:resnet18', str(tmp_path / 'cache'), progress=False,
                           weights=table)
    assert_one_line_naming(e, source)
    assert os.listdir(tmp_path) == []  # no file, no .part, no new directories


def test_truncated_response_leaves_nothing(server, tmp_path):
    url, _ = server
    source = f'{url}/short/{RESNET_FILE}'
    table = {'torchvision:resnet18': resnet(source)}
    with pytest.raises(DataError, match=r'truncated, got \d+ of \d+ bytes') as e:
        pretrained.resolve('torchvision:resnet18', str(tmp_path / 'cache'), progress=False,
                           weights=table)
    assert_one_line_naming(e, source)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize('prefix, match', [
    ('badhub', 'checksum mismatch, expected sha256 '),  # the hub's hash and the bytes differ
    ('nohash', 'publishes no SHA-256'),                 # no hash to check against: refused
])
def test_hub_hash_mismatch_or_missing_leaves_nothing(server, tmp_path, prefix, match):
    url, _ = server
    name = 'timm:vit_tiny_patch16_224.augreg_in21k_ft_in1k'
    with pytest.raises(DataError, match=match) as e:
        pretrained.resolve(name, str(tmp_path / 'cache'), progress=False,
                           weights={name: vit(f'{url}/{prefix}/{VIT_FILE}')})
    assert_one_line_naming(e, f'/{VIT_FILE}')
    assert os.listdir(tmp_path) == []


def test_server_down_names_the_url(tmp_path):
    source = f'{closed_port_url()}/{RESNET_FILE}'
    with pytest.raises(DataError, match='cannot connect') as e:
        pretrained.resolve('torchvision:resnet18', str(tmp_path / 'cache'), progress=False,
                           weights={'torchvision:resnet18': resnet(source)})
    assert_one_line_naming(e, source)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize('name, make', [
    ('torchvision:resnet18', resnet),  # a pinned hash: the file itself is fetched
    ('timm:vit_tiny_patch16_224.augreg_in21k_ft_in1k', vit),  # its published hash first
])
def test_offline_errors_say_what_to_do(tmp_path, name, make):
    """No network: the line names the mirror variable and passing the file instead; the
    timm one says the server cannot be reached (not that a hash is missing)."""
    spec = make(f'{closed_port_url()}/{"weights.bin"}')
    with pytest.raises(DataError) as e:
        pretrained.resolve(name, str(tmp_path / 'cache'), progress=False, weights={name: spec})
    message = str(e.value)
    assert '\n' not in message
    assert f'set ${dl.MIRROR_ENV_VAR} to a mirror serving weights/{spec.source}/{spec.file}' \
        in message
    assert f'pass the file itself: model.init_from=/path/to/{spec.file}' in message
    if spec.hash is None:
        assert 'the server cannot be reached (no network?' in message
    assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------------------
# Mirrors serve <mirror>/weights/<source>/<file> (and <file>.sha256 when unpinned)
# ---------------------------------------------------------------------------

def test_mirror_from_environment(server, tmp_path, monkeypatch):
    url, httpd = server
    monkeypatch.setenv(dl.MIRROR_ENV_VAR, f'{url}/good/')
    table = {'torchvision:resnet18': resnet(f'{closed_port_url()}/{RESNET_FILE}')}  # unused
    before = len(httpd.requests)
    path, _ = pretrained.resolve('torchvision:resnet18', str(tmp_path), progress=False,
                                 weights=table)
    assert httpd.requests[before:] == [('GET', f'/good/weights/torchvision/{RESNET_FILE}')]
    assert open(path, 'rb').read() == RESNET


def test_mirror_serves_sha256_beside_unpinned_files(server, tmp_path):
    url, httpd = server
    name = 'timm:vit_tiny_patch16_224.augreg_in21k_ft_in1k'
    table = {name: vit(f'{closed_port_url()}/{VIT_FILE}')}
    before = len(httpd.requests)
    path, _ = pretrained.resolve(name, str(tmp_path), f'{url}/good', progress=False, weights=table)
    assert open(path, 'rb').read() == VIT
    assert httpd.requests[before:] == [('GET', f'/good/weights/timm/{VIT_FILE}.sha256'),
                                       ('GET', f'/good/weights/timm/{VIT_FILE}')]

    table = {name: vit(table[name].url, file='unhashed.safetensors')}  # no .sha256 beside it
    with pytest.raises(DataError, match=r'HTTP 404.*<file>\.sha256') as e:
        pretrained.resolve(name, str(tmp_path / 'other'), f'{url}/good', progress=False,
                           weights=table)
    assert_one_line_naming(e, f'{url}/good/weights/timm/unhashed.safetensors.sha256')
    assert not (tmp_path / 'other').exists()


def test_a_populated_cache_is_a_mirror(server, tmp_path):
    """The cache layout, .sha256 files included, is what a mirror serves: file:// works."""
    url, _ = server
    name = 'timm:vit_tiny_patch16_224.augreg_in21k_ft_in1k'
    pretrained.resolve(name, str(tmp_path / 'a'), progress=False,
                       weights={name: vit(f'{url}/hub/{VIT_FILE}')})
    offline = {name: vit(f'{closed_port_url()}/{VIT_FILE}')}
    path, _ = pretrained.resolve(name, str(tmp_path / 'b'), (tmp_path / 'a').as_uri(),
                                 progress=False, weights=offline)
    assert open(path, 'rb').read() == VIT


# ---------------------------------------------------------------------------
# Names
# ---------------------------------------------------------------------------

@pytest.mark.parametrize('name, near', [
    ('torchvision:resnet5', 'torchvision:resnet50'),
    ('torchvison:resnet34', 'torchvision:resnet34'),
    ('timm:vit_small', 'timm:vit_small_patch16_224.augreg_in21k_ft_in1k'),
])
def test_unknown_name_lists_near_names(tmp_path, name, near):
    with pytest.raises(pretrained.UnknownWeightsError) as e:
        pretrained.resolve(name, str(tmp_path / 'cache'))
    message = str(e.value)
    assert isinstance(e.value, ConfigError) and isinstance(e.value, ValueError)
    assert f'did you mean {near}' in message and '\n' not in message, message
    assert repr(name) in message
    assert not (tmp_path / 'cache').exists()


def test_is_name():
    assert pretrained.is_name('torchvision:resnet50')
    assert pretrained.is_name('timm:vit_small_patch16_224.augreg_in21k_ft_in1k')
    assert not pretrained.is_name('/runs/resnet50')
    assert not pretrained.is_name('resnet50-0676ba61.pth')
    assert not pretrained.is_name('')


# ---------------------------------------------------------------------------
# The table (no network)
# ---------------------------------------------------------------------------

def test_table_is_well_formed():
    assert {'torchvision:resnet18', 'torchvision:resnet34', 'torchvision:resnet50',
            'torchvision:resnet50.v1', 'timm:vit_tiny_patch16_224.augreg_in21k_ft_in1k',
            'timm:vit_small_patch16_224.augreg_in21k_ft_in1k',
            'timm:vit_base_patch16_224.augreg2_in21k_ft_in1k'} <= set(pretrained.WEIGHTS)
    for name, w in pretrained.WEIGHTS.items():
        source, _, tag = name.partition(':')
        assert pretrained.is_name(name) and w.source == source, name
        assert w.model in pretrained.MODELS, name
        assert (w.image_size, w.num_classes) == (224, 1000), name
        for stats in (w.mean, w.std):
            assert len(stats) == 3 and all(isinstance(v, float) and 0 < v < 1 for v in stats)
        if source == 'torchvision':
            match = re.fullmatch(r'https://download\.pytorch\.org/models/(\w+-([0-9a-f]{8})\.pth)',
                                 w.url)
            assert match and match[1] == w.file and match[2] == w.hash, name
            assert w.format == 'pth' and w.mean == (0.485, 0.456, 0.406), name
            assert w.model == tag.split('.')[0], name
        else:
            assert w.url == f'https://huggingface.co/timm/{tag}/resolve/main/model.safetensors'
            assert w.format == 'safetensors' and w.file == f'{tag}.safetensors', name
            assert w.hash is None or re.fullmatch(r'[0-9a-f]{64}', w.hash), name
            assert (w.mean, w.std) == ((0.5,) * 3, (0.5,) * 3), name
            assert tag.startswith(w.model + '_patch16_224.'), name
    # torchvision's own hashes: V2 is the default resnet50, V1 its .v1
    assert pretrained.WEIGHTS['torchvision:resnet50'].hash == '11ad3fa6'
    assert pretrained.WEIGHTS['torchvision:resnet50.v1'].hash == '0676ba61'


def test_fetch_checks_a_full_sha256(server, tmp_path):
    url, _ = server
    target = tmp_path / 'f.pth'
    assert dl.fetch(f'{url}/good/{RESNET_FILE}', str(target), sha256=RESNET_SHA.upper(),
                    progress=False) == {'sha256': RESNET_SHA}
    with pytest.raises(DataError, match=f'expected sha256 {"0" * 64}, got {RESNET_SHA}'):
        dl.fetch(f'{url}/good/{RESNET_FILE}', str(tmp_path / 'g.pth'), sha256='0' * 64,
                 progress=False)
    assert os.listdir(tmp_path) == ['f.pth']
    with pytest.raises(ValueError, match='8 to 64 hex digits'):
        dl.fetch(f'{url}/good/{RESNET_FILE}', str(tmp_path / 'h.pth'), sha256='abc')
