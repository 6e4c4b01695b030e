"""jaxtrain.data.download against a local HTTP server: success, skip, truncation, corruption, errors.

The server on 127.0.0.1 serves real archives (a small CIFAR-10 built from the
shared data, the system Fashion-MNIST files) under several prefixes, each a
way to serve or fail: /good/ serves the cache layout, /short/ announces more
bytes than it sends, /cut/ breaks a chunked body off, /stall/ stops sending,
anything else is a 404. These files are not the official ones, so tests pass
their checksums.
"""
import hashlib
import http.server
import os
import re
import socket
import sys
import threading
from pathlib import Path

import pytest
import fork_server

from jaxtrain import data
from jaxtrain.data import DataError
from jaxtrain.data import download as dl
from jaxtrain.data.__main__ import main as cli_main

REPO = Path(__file__).resolve().parents[1]
FASHION_DIR = Path('/usr/share/datasets/fashion-mnist')
CIFAR_ARCHIVE = 'cifar-10-python.tar.gz'


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = 'HTTP/1.1'  # needed for chunked bodies

    def do_GET(self):  # noqa: N802 (http.server's name)
        server = self.server
        server.requests.append(self.path)
        prefix, _, rest = self.path.lstrip('/').partition('/')
        body = server.files.get(rest)
        if body is None or prefix not in ('good', 'short', 'cut', 'stall'):
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header('Content-Type', 'application/octet-stream')
        if prefix == 'cut':  # a chunked body whose connection drops inside the first chunk
            self.send_header('Transfer-Encoding', 'chunked')
            self.send_header('Connection', 'close')
            self.end_headers()
            self.wfile.write(b'%x\r\n' % len(body) + body[:len(body) // 2])
        else:
            announced = len(body) + (1000 if prefix == 'short' else 0)
            self.send_header('Content-Length', str(announced))
            self.send_header('Connection', 'close')
            self.end_headers()
            if prefix == 'stall':  # some bytes, then silence until the client gives up
                self.wfile.write(body[:1000])
                self.wfile.flush()
                server.release.wait(5)
            else:
                self.wfile.write(body)
        self.close_connection = True

    def log_message(self, *args):
        pass


@pytest.fixture(scope='module')
def server(cifar_archive_dir):
    """(base URL, server): files keyed by their path in the cache layout."""
    httpd = http.server.ThreadingHTTPServer(('127.0.0.1', 0), _Handler)
    httpd.requests = []
    httpd.release = threading.Event()
    httpd.files = {CIFAR_ARCHIVE: (cifar_archive_dir / CIFAR_ARCHIVE).read_bytes()}
    for p in sorted(FASHION_DIR.glob('*-ubyte.gz')):
        httpd.files[f'fashion-mnist/{p.name}'] = p.read_bytes()
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f'http://127.0.0.1:{httpd.server_address[1]}', httpd
    finally:
        httpd.release.set()
        httpd.shutdown()
        httpd.server_close()


def md5s(files, subdir=''):
    """{file name: MD5} of the served files under subdir (the checksums= argument)."""
    prefix = f'{subdir}/' if subdir else ''
    return {k[len(prefix):]: hashlib.md5(v).hexdigest()
            for k, v in files.items() if k.startswith(prefix) and '/' not in k[len(prefix):]}


def closed_port_url():
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        port = s.getsockname()[1]
    return f'http://127.0.0.1:{port}/'


# ---------------------------------------------------------------------------
# Success
# ---------------------------------------------------------------------------

def test_cifar10_download_loads_and_second_call_does_not_fetch(server, tmp_path):
    url, httpd = server
    cache = tmp_path / 'cache'
    sums = md5s(httpd.files)
    where = dl.download('cifar10', str(cache), mirror=f'{url}/good/', progress=True, checksums=sums)
    assert where == str(cache)
    assert sorted(os.listdir(cache)) == [CIFAR_ARCHIVE]  # no temp files left
    assert (cache / CIFAR_ARCHIVE).read_bytes() == httpd.files[CIFAR_ARCHIVE]

    ds = data.load('cifar10', 'files', where)
    assert ds.x_train.shape == (2000, 32, 32, 3) and ds.x_test.shape == (500, 32, 32, 3)
    assert ds.origin == str(cache / CIFAR_ARCHIVE)

    before = len(httpd.requests)
    assert dl.download('cifar10', str(cache), mirror=f'{url}/good/', checksums=sums) == where
    assert len(httpd.requests) == before


def test_fashion_mnist_lands_in_subdir_and_loads(server, tmp_path):
    url, httpd = server
    where = dl.download('fashion_mnist', str(tmp_path), mirror=f'{url}/good',  # no trailing /
                        progress=False, checksums=md5s(httpd.files, 'fashion-mnist'))
    assert where == str(tmp_path / 'fashion-mnist')
    assert sorted(os.listdir(where)) == sorted(p.name for p in FASHION_DIR.glob('*-ubyte.gz'))
    ds = data.load('fashion_mnist', 'files', str(tmp_path))  # found in the fashion-mnist/ subdir
    assert ds.x_train.shape == (60000, 28, 28, 1) and ds.num_classes == 10
    assert ds.origin.startswith(where)


def test_corrupt_cached_file_is_fetched_again(server, tmp_path):
    url, httpd = server
    (tmp_path / CIFAR_ARCHIVE).write_bytes(b'not an archive')
    before = len(httpd.requests)
    dl.download('cifar10', str(tmp_path), mirror=f'{url}/good/', progress=False,
                checksums=md5s(httpd.files))
    assert len(httpd.requests) == before + 1
    assert (tmp_path / CIFAR_ARCHIVE).read_bytes() == httpd.files[CIFAR_ARCHIVE]


def test_mirror_from_environment(server, tmp_path, monkeypatch):
    url, httpd = server
    monkeypatch.setenv(dl.MIRROR_ENV_VAR, f'{url}/good/')
    dl.download('cifar10', str(tmp_path), progress=False, checksums=md5s(httpd.files))
    assert (tmp_path / CIFAR_ARCHIVE).is_file()


# ---------------------------------------------------------------------------
# Failures leave nothing behind and name the URL
# ---------------------------------------------------------------------------

@pytest.mark.parametrize('prefix, match', [
    ('short', r'truncated, got \d+ of \d+ bytes'),   # Content-Length larger than the body
    ('cut', r'truncated, the connection closed'),     # chunked body broken off
])
def test_truncated_download(server, tmp_path, prefix, match):
    url, httpd = server
    with pytest.raises(DataError, match=match) as e:
        dl.download('cifar10', str(tmp_path), mirror=f'{url}/{prefix}/', progress=False,
                    checksums=md5s(httpd.files))
    assert f'{url}/{prefix}/{CIFAR_ARCHIVE}' in str(e.value)
    assert os.listdir(tmp_path) == []


def test_wrong_checksum_names_both_and_leaves_nothing(server, tmp_path):
    url, httpd = server
    actual = hashlib.md5(httpd.files[CIFAR_ARCHIVE]).hexdigest()
    with pytest.raises(DataError) as e:
        dl.download('cifar10', str(tmp_path), mirror=f'{url}/good/', progress=False,
                    checksums={CIFAR_ARCHIVE: 'ab' * 16})
    message = str(e.value)
    assert f'{url}/good/{CIFAR_ARCHIVE}' in message
    assert 'ab' * 16 in message and actual in message
    assert '\n' not in message
    assert os.listdir(tmp_path) == []


def test_official_checksum_rejects_other_files(server, tmp_path):
    """Without checksums=, the published MD5 applies: the served subset is not the real archive."""
    url, _ = server
    with pytest.raises(DataError, match=dl.RESOURCES['cifar10'].files[0][1]):
        dl.download('cifar10', str(tmp_path / 'cache'), mirror=f'{url}/good/', progress=False)
    assert os.listdir(tmp_path) == []  # the cache dir it created is gone too


def test_failure_in_subdir_removes_the_new_subdir(server, tmp_path):
    url, httpd = server
    sums = md5s(httpd.files, 'fashion-mnist')
    sums['t10k-labels-idx1-ubyte.gz'] = '0' * 32  # the last file fails, after three good ones
    with pytest.raises(DataError, match='0' * 32):
        dl.download('fashion_mnist', str(tmp_path), mirror=f'{url}/good/', progress=False,
                    checksums=sums)
    sums = {name: '0' * 32 for name in sums}
    with pytest.raises(DataError, match='0' * 32):  # the first file fails: no new dirs stay
        dl.download('fashion_mnist', str(tmp_path / 'new' / 'cache'), mirror=f'{url}/good/',
                    progress=False, checksums=sums)
    assert not (tmp_path / 'new').exists()
    # the three verified files stay (a retry fetches only the fourth); no temp file stays
    assert sorted(os.listdir(tmp_path / 'fashion-mnist')) == sorted(
        n for n in sums if n != 't10k-labels-idx1-ubyte.gz')


def test_server_down_names_the_url(tmp_path):
    base = closed_port_url()
    with pytest.raises(DataError, match='cannot connect') as e:
        dl.download('cifar10', str(tmp_path), mirror=base, progress=False)
    assert f'{base}{CIFAR_ARCHIVE}' in str(e.value)
    assert os.listdir(tmp_path) == []


def test_http_404(server, tmp_path):
    url, _ = server
    with pytest.raises(DataError, match='HTTP 404') as e:
        dl.download('cifar10', str(tmp_path), mirror=f'{url}/missing/', progress=False)
    assert f'{url}/missing/{CIFAR_ARCHIVE}' in str(e.value)
    assert os.listdir(tmp_path) == []


def test_stalled_server_times_out(server, tmp_path):
    url, httpd = server
    with pytest.raises(DataError, match=r'no data for 0.3 s') as e:
        dl.download('cifar10', str(tmp_path), mirror=f'{url}/stall/', progress=False,
                    checksums=md5s(httpd.files), timeout=0.3)
    assert f'{url}/stall/{CIFAR_ARCHIVE}' in str(e.value)
    assert os.listdir(tmp_path) == []


def test_mirrors_tried_in_order(server, tmp_path, monkeypatch):
    url, httpd = server
    monkeypatch.delenv(dl.MIRROR_ENV_VAR, raising=False)  # conftest sets one for all tests
    bad, good = closed_port_url(), f'{url}/good/'
    monkeypatch.setitem(dl.RESOURCES, 'cifar10', dl.Resource(
        urls=(bad, good), subdir='', files=((CIFAR_ARCHIVE, md5s(httpd.files)[CIFAR_ARCHIVE]),)))
    dl.download('cifar10', str(tmp_path), progress=False)
    assert (tmp_path / CIFAR_ARCHIVE).is_file()

    monkeypatch.setitem(dl.RESOURCES, 'cifar10', dl.Resource(
        urls=(bad, f'{url}/missing/'), subdir='', files=dl.RESOURCES['cifar10'].files))
    with pytest.raises(DataError, match='all 2 sources failed') as e:
        dl.download('cifar10', str(tmp_path / 'other'), progress=False)
    assert bad in str(e.value) and f'{url}/missing/' in str(e.value)


def test_unknown_name_lists_the_names(tmp_path):
    with pytest.raises(DataError, match='cifar10, cifar100, fashion_mnist, mnist'):
        dl.download('imagenet', str(tmp_path))
    with pytest.raises(DataError, match='does not have'):
        dl.download('cifar10', str(tmp_path), checksums={'nope.gz': '0' * 32})
    assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------------------
# The published resources
# ---------------------------------------------------------------------------

def test_official_resources_are_well_formed():
    assert set(dl.RESOURCES) == {'cifar10', 'cifar100', 'mnist', 'fashion_mnist'}
    assert dl.DEFAULT_CACHE_DIR == data.CACHE_DIR
    for name, resource in dl.RESOURCES.items():
        assert resource.urls, name
        for base in resource.urls:
            assert re.fullmatch(r'https?://[^/\s]+/(\S*/)?', base), (name, base)
        for fname, md5 in resource.files:
            assert re.fullmatch(r'[0-9a-f]{32}', md5), (name, fname, md5)
    # where they land is where data.load looks
    assert dl.RESOURCES['cifar10'].files[0][0] == data.CIFAR10_ARCHIVE
    assert dl.RESOURCES['cifar10'].subdir == ''
    assert dl.RESOURCES['cifar100'].files[0][0] == 'cifar-100-python.tar.gz'
    idx = sorted(f'{stem}.gz' for pair in data.IDX_FILES.values() for stem in pair)
    assert sorted(f for f, _ in dl.RESOURCES['mnist'].files) == idx
    assert sorted(f for f, _ in dl.RESOURCES['fashion_mnist'].files) == idx
    assert (dl.RESOURCES['mnist'].subdir, dl.RESOURCES['fashion_mnist'].subdir) == (
        'mnist', 'fashion-mnist')
    all_md5 = [m for r in dl.RESOURCES.values() for _, m in r.files]
    assert len(set(all_md5)) == len(all_md5) == 10


# ---------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------

def run_cli(*args, patch=None):
    """`python -m jaxtrain.data ARGS` in a subprocess; patch: {name: Resource} set first.

    With patch, the module runs via runpy.run_module(alter_sys=True), which is what -m does,
    after RESOURCES is changed so that the served (unofficial) files pass their checksums.
    """
    env = {**os.environ, 'PYTHONPATH': str(REPO)}
    env.pop(dl.MIRROR_ENV_VAR, None)
    if patch is None:
        command = ['-m', 'jaxtrain.data', *args]
    else:
        code = ('import runpy, sys\n'
                'from jaxtrain.data import download as dl\n'
                f'dl.RESOURCES.update({{k: dl.Resource(*v) for k, v in {patch!r}.items()}})\n'
                f'sys.argv = ["jaxtrain.data", *{list(args)!r}]\n'
                'runpy.run_module("jaxtrain.data", run_name="__main__", alter_sys=True)\n')
        command = ['-c', code]
    return fork_server.run([sys.executable, *command], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_cli_download(server, tmp_path):
    url, httpd = server
    served = md5s(httpd.files)[CIFAR_ARCHIVE]
    resource = dl.RESOURCES['cifar10']
    patched = (resource.urls, resource.subdir, ((CIFAR_ARCHIVE, served),))
    cache = tmp_path / 'cache'
    proc = run_cli('download', 'cifar10', '--dir', str(cache), '--mirror', f'{url}/good/',
                   patch={'cifar10': patched})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f'{cache}\n'
    assert 'Traceback' not in proc.stderr
    assert (cache / CIFAR_ARCHIVE).read_bytes() == httpd.files[CIFAR_ARCHIVE]
    assert data.load('cifar10', 'files', proc.stdout.strip()).x_train.shape[0] == 2000


@pytest.mark.slow
def test_cli_checksum_failure_is_one_error_line(server, tmp_path, capsys):
    """With the published checksum the served subset archive fails: one line, exit 1.

    In-process (a subprocess pays the jax import again); main() is what -m runs.
    """
    url, httpd = server
    assert cli_main(['download', 'cifar10', '--dir', str(tmp_path), '--mirror', f'{url}/good/']) == 1
    out, err = capsys.readouterr()
    assert out == '' and err.count('\n') == 1 and err.startswith('error: '), err
    assert dl.RESOURCES['cifar10'].files[0][1] in err
    assert md5s(httpd.files)[CIFAR_ARCHIVE] in err
    assert os.listdir(tmp_path) == []


@pytest.mark.slow
def test_cli_unknown_name_is_one_error_line(tmp_path):
    proc = run_cli('download', 'imagenet', '--dir', str(tmp_path))
    assert proc.returncode == 1
    assert proc.stdout == ''
    assert proc.stderr.splitlines() == [
        "error: unknown dataset 'imagenet' to download; available: cifar10, cifar100, "
        "fashion_mnist, mnist"]
    assert 'Traceback' not in proc.stderr


def test_cli_usage_errors_exit_2(capsys):
    for argv in ([], ['download'], ['download', 'cifar10', '--bogus']):
        with pytest.raises(SystemExit) as e:
            cli_main(argv)
        assert e.value.code == 2
    assert 'usage:' in capsys.readouterr().err


# ---------------------------------------------------------------------------
# data.load: 'download' and 'auto' fetch, 'files' never does
# ---------------------------------------------------------------------------

def test_data_load_downloads_only_when_the_source_allows(server, tmp_path, monkeypatch):
    import dataclasses

    url, httpd = server
    home = tmp_path / 'home'
    home.mkdir()
    monkeypatch.setenv('HOME', str(home))  # an empty ~/.cache/jaxtrain
    monkeypatch.delenv('JAXTRAIN_DATA_DIR', raising=False)
    monkeypatch.setenv(dl.MIRROR_ENV_VAR, f'{url}/good/')
    served = dataclasses.replace(dl.RESOURCES['cifar10'],
                                 files=((CIFAR_ARCHIVE, md5s(httpd.files)[CIFAR_ARCHIVE]),))
    monkeypatch.setitem(dl.RESOURCES, 'cifar10', served)
    before = len(httpd.requests)
    with pytest.raises(DataError, match=r"(?s)no local cifar10 data found.*data.source='download'"):
        data.load('cifar10', 'files')
    assert len(httpd.requests) == before
    dataset = data.load('cifar10', 'download')
    assert dataset.x_train.shape == (2000, 32, 32, 3)
    assert dataset.origin == str(home / '.cache' / 'jaxtrain' / CIFAR_ARCHIVE)
    assert len(httpd.requests) == before + 1
    assert data.load('cifar10', 'auto').origin == dataset.origin  # now a local file
    assert len(httpd.requests) == before + 1
