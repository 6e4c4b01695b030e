"""Tests for jaxtrain.data: CIFAR-10 files, search order, safety, tfds wrapping."""
import importlib.util
import io
import os
import pickle
import re
import shlex
import struct
import sys
import tarfile
import types

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from conftest import missing
from PIL import Image

from jaxtrain import data
from jaxtrain.data import DataError, Dataset

NPZ_NAME = 'cifar10_jpeg.npz'
BATCH_FILES = ('data_batch_1', 'data_batch_2', 'data_batch_3', 'data_batch_4', 'data_batch_5', 'test_batch')


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------

def tiny(subset, n_train=10, n_test=5):
    """A few images of the real subset: enough to tell datasets apart, cheap to write."""
    return {'x_train': subset['x_train'][:n_train], 'y_train': subset['y_train'][:n_train],
            'x_test': subset['x_test'][:n_test], 'y_test': subset['y_test'][:n_test],
            'class_names': subset['class_names']}


def assert_matches(ds, subset):
    assert isinstance(ds, Dataset)
    for split in ('train', 'test'):
        x, y = getattr(ds, f'x_{split}'), getattr(ds, f'y_{split}')
        assert x.dtype == np.uint8 and x.flags.c_contiguous
        assert y.dtype == np.int32 and y.ndim == 1
        np.testing.assert_array_equal(x, subset[f'x_{split}'])
        np.testing.assert_array_equal(y, subset[f'y_{split}'])
    assert ds.class_names == tuple(subset['class_names'])
    assert ds.num_classes == 10
    assert ds.image_shape == (32, 32, 3)


def batch_dict(n=4, width=3072, labels=None, seed=0):
    rng = np.random.default_rng(seed)
    return {'batch_label': 'synthetic', 'labels': list(range(n)) if labels is None else labels,
            'data': rng.integers(0, 256, size=(n, width), dtype=np.uint8),
            'filenames': [f'{i}.png' for i in range(n)]}


def write_dir(root, batches=None, meta=True, protocol=2):
    """<root>/cifar-10-batches-py with small synthetic batches; `batches` overrides file contents."""
    out = root / 'cifar-10-batches-py'
    out.mkdir(parents=True, exist_ok=True)
    contents = {f: pickle.dumps(batch_dict(seed=i), protocol=protocol) for i, f in enumerate(BATCH_FILES)}
    if meta:
        contents['batches.meta'] = pickle.dumps({'label_names': list(data.CIFAR10_CLASSES)}, protocol=protocol)
    contents.update(batches or {})
    for fname, raw in contents.items():
        if raw is not None:
            (out / fname).write_bytes(raw)
    return out


def write_tar(archive, members):
    """A tar (gzip if the name ends in .gz) of {member name: bytes}."""
    with tarfile.open(archive, 'w:gz' if str(archive).endswith('.gz') else 'w') as tar:
        for name, raw in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(raw)
            tar.addfile(info, io.BytesIO(raw))
    return archive


def tree(path):
    """Every path under `path`, to prove that nothing was written."""
    return sorted(str(p.relative_to(path)) for p in path.rglob('*'))


class Reduce:
    """Pickles as a call fn(*args): how malicious pickles run code."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


class Py2Pickler(pickle._Pickler):
    """Emits ASCII strings and bytes as Python-2 STRING opcodes, as cPickle did for the originals."""
    dispatch = dict(pickle._Pickler.dispatch)

    def save_py2_str(self, obj):
        raw = obj.encode('ascii') if isinstance(obj, str) else obj
        n = len(raw)
        self.write((pickle.SHORT_BINSTRING + bytes([n]) if n < 256 else
                    pickle.BINSTRING + struct.pack('<i', n)) + raw)
        self.memoize(obj)

    dispatch[bytes] = save_py2_str
    dispatch[str] = save_py2_str


def py2_pickle(obj):
    """A protocol-2 pickle shaped like those written by Python 2 with numpy 1."""
    f = io.BytesIO()
    Py2Pickler(f, protocol=2).dump(obj)
    raw = f.getvalue().replace(b'cnumpy._core.multiarray\n', b'cnumpy.core.multiarray\n')
    assert b'_codecs' not in raw and b'numpy._core' not in raw
    return raw


@pytest.fixture
def no_tfds(monkeypatch):
    """Fail the test if anything reaches tensorflow-datasets."""
    def fail(*args, **kwargs):
        pytest.fail('tfds must not be used here')
    monkeypatch.setattr(data, 'load_tfds', fail)
    monkeypatch.setitem(sys.modules, 'tensorflow_datasets', None)  # any import raises


@pytest.fixture
def isolated_env(tmp_path, monkeypatch):
    """No $JAXTRAIN_DATA_DIR and an empty HOME, so nothing real is found."""
    home = tmp_path / 'home'
    home.mkdir()
    monkeypatch.setenv('HOME', str(home))
    monkeypatch.delenv('JAXTRAIN_DATA_DIR', raising=False)
    return home


# ---------------------------------------------------------------------------
# formats
# ---------------------------------------------------------------------------

@pytest.mark.parametrize('root', ['cifar_batches_dir', 'cifar_bytes_keys_dir', 'cifar_archive_dir'])
def test_every_format_gives_the_subset(root, request, cifar_subset, isolated_env, no_tfds):
    directory = request.getfixturevalue(root)
    ds = data.load('cifar10', source='files', data_dir=str(directory))
    assert_matches(ds, cifar_subset)
    assert ds.x_train.shape == (2000, 32, 32, 3) and ds.x_test.shape == (500, 32, 32, 3)
    assert ds.class_names[:3] == ('airplane', 'automobile', 'bird')
    expected = 'cifar-10-python.tar.gz' if root == 'cifar_archive_dir' else 'cifar-10-batches-py'
    assert ds.origin == os.path.join(str(directory), expected)


def test_direct_loaders_agree(cifar_batches_dir, cifar_archive_dir, cifar_subset):
    a = data.load_cifar10_dir(cifar_batches_dir / 'cifar-10-batches-py')
    b = data.load_cifar10_archive(cifar_archive_dir / 'cifar-10-python.tar.gz')
    assert_matches(a, cifar_subset)
    assert_matches(b, cifar_subset)


def test_hwc_order_against_raw_rows_and_jpegs(cifar_batches_dir, shared_data_dir):
    ds = data.load_cifar10_dir(cifar_batches_dir / 'cifar-10-batches-py')
    with open(cifar_batches_dir / 'cifar-10-batches-py' / 'data_batch_1', 'rb') as f:
        row = pickle.load(f)['data'][7]  # our own fixture file: a trusted plain load is fine
    img = ds.x_train[7]
    assert img[0, 0].tolist() == [row[0], row[1024], row[2048]]          # R, G, B planes
    assert img[0, 1].tolist() == [row[1], row[1025], row[2049]]          # next column
    assert img[1, 0].tolist() == [row[32], row[1056], row[2080]]         # next row
    assert not np.array_equal(img, row.reshape(32, 32, 3))               # the naive reshape is wrong

    # Decode two JPEGs straight from the npz, independently of conftest.
    with np.load(shared_data_dir / NPZ_NAME) as z:
        header = z['jpeg_header'].tobytes()
        for split, x, i in (('train', ds.x_train, 1999), ('test', ds.x_test, 0)):
            lo, hi = z[f'{split}_offsets'][i:i + 2]
            jpeg = header + z[f'{split}_scans'][lo:hi].tobytes()
            expected = np.asarray(Image.open(io.BytesIO(jpeg)).convert('RGB'))
            np.testing.assert_array_equal(x[i], expected)
            assert ds.class_names[int(z[f'{split}_labels'][i])] == ds.class_names[
                (ds.y_train if split == 'train' else ds.y_test)[i]]


def test_python2_original_pickles_load(tmp_path, cifar_subset):
    """The Toronto files: STRING opcodes, numpy.core names; need encoding='latin1' handling."""
    small = tiny(cifar_subset)
    out = tmp_path / 'cifar-10-batches-py'
    out.mkdir()
    rows = lambda x: np.ascontiguousarray(x.transpose(0, 3, 1, 2).reshape(len(x), 3072))
    splits = np.array_split(np.arange(10), 5)
    for i, idx in enumerate(splits):
        (out / f'data_batch_{i + 1}').write_bytes(py2_pickle(
            {'batch_label': 'b', 'labels': [int(v) for v in small['y_train'][idx]],
             'data': rows(small['x_train'][idx])}))
    (out / 'test_batch').write_bytes(py2_pickle(
        {'labels': [int(v) for v in small['y_test']], 'data': rows(small['x_test'])}))
    (out / 'batches.meta').write_bytes(py2_pickle({'label_names': list(small['class_names'])}))
    assert_matches(data.load_cifar10_dir(out), small)


@pytest.mark.parametrize('protocol', [2, 3, 4, 5])
def test_pickle_protocols(tmp_path, protocol):
    out = write_dir(tmp_path, protocol=protocol)
    ds = data.load_cifar10_dir(out)
    assert ds.x_train.shape == (20, 32, 32, 3) and ds.x_test.shape == (4, 32, 32, 3)
    expected = batch_dict(seed=5)['data'].reshape(4, 3, 32, 32).transpose(0, 2, 3, 1)
    np.testing.assert_array_equal(ds.x_test, expected)


def test_labels_as_numpy_and_int64_data_are_accepted(tmp_path):
    batch = batch_dict()
    batch['labels'] = np.array([0, 1, 2, 9], dtype=np.int64)
    batch['data'] = batch['data'].astype(np.int64)
    out = write_dir(tmp_path, {'test_batch': pickle.dumps(batch, protocol=4)})
    ds = data.load_cifar10_dir(out)
    assert ds.y_test.dtype == np.int32 and ds.y_test.tolist() == [0, 1, 2, 9]
    assert ds.x_test.dtype == np.uint8


def test_missing_meta_uses_standard_names(tmp_path):
    ds = data.load_cifar10_dir(write_dir(tmp_path, meta=False))
    assert ds.class_names == data.CIFAR10_CLASSES
    assert ds.class_names[-1] == 'truck'


def test_uncompressed_tar_and_dot_slash_members(tmp_path, cifar_batches_dir, cifar_subset):
    batches = cifar_batches_dir / 'cifar-10-batches-py'
    archive = write_tar(tmp_path / 'cifar.tar',
                        {f'./cifar-10-batches-py/{p.name}': p.read_bytes() for p in batches.iterdir()})
    assert_matches(data.load_cifar10_archive(archive), cifar_subset)


# ---------------------------------------------------------------------------
# where data is looked for
# ---------------------------------------------------------------------------

def test_search_dirs(tmp_path, monkeypatch):
    monkeypatch.setenv('HOME', str(tmp_path))
    monkeypatch.setenv('JAXTRAIN_DATA_DIR', '~/env')
    cache = str(tmp_path / '.cache' / 'jaxtrain')
    assert data.search_dirs('~/mine') == [
        (str(tmp_path / 'mine'), 'data.dir'),
        (str(tmp_path / 'env'), '$JAXTRAIN_DATA_DIR'),
        (cache, 'default cache')]
    monkeypatch.setenv('JAXTRAIN_DATA_DIR', '')
    assert data.search_dirs('') == [(cache, 'default cache')]
    assert data.search_dirs(None) == [(cache, 'default cache')]
    assert data.search_dirs(cache) == [(cache, 'data.dir')]  # listed once


def test_search_order(tmp_path, monkeypatch, write_cifar, cifar_subset, no_tfds):
    small = tiny(cifar_subset)
    home, env_dir, own = tmp_path / 'home', tmp_path / 'env', tmp_path / 'own'
    for root in (home / '.cache' / 'jaxtrain', env_dir, own):
        write_cifar(root, small)
    monkeypatch.setenv('HOME', str(home))
    monkeypatch.setenv('JAXTRAIN_DATA_DIR', str(env_dir))
    origin = lambda d: data.load('cifar10', source='files', data_dir=d).origin

    assert origin(str(own)) == str(own / 'cifar-10-batches-py')
    assert origin(None) == str(env_dir / 'cifar-10-batches-py')
    empty = tmp_path / 'empty'
    empty.mkdir()
    assert origin(str(empty)) == str(env_dir / 'cifar-10-batches-py')  # an empty data.dir falls through
    monkeypatch.delenv('JAXTRAIN_DATA_DIR')
    assert origin(None) == str(home / '.cache' / 'jaxtrain' / 'cifar-10-batches-py')
    assert_matches(data.load('cifar10', source='files'), small)


def test_layout_order_within_a_dir(tmp_path, cifar_archive_dir, isolated_env, no_tfds):
    archive = (cifar_archive_dir / 'cifar-10-python.tar.gz').read_bytes()
    (tmp_path / 'cifar-10-python.tar.gz').write_bytes(archive)
    assert data.load('cifar10', 'files', str(tmp_path)).origin == str(tmp_path / 'cifar-10-python.tar.gz')

    for p in write_dir(tmp_path / 'staging').iterdir():  # loose batch files in the dir itself
        p.rename(tmp_path / p.name)
    assert data.load('cifar10', 'files', str(tmp_path)).origin == str(tmp_path)

    write_dir(tmp_path)
    assert data.load('cifar10', 'files', str(tmp_path)).origin == str(tmp_path / 'cifar-10-batches-py')


def test_files_source_not_found_lists_places(tmp_path, isolated_env, no_tfds, monkeypatch):
    env_dir = tmp_path / 'env'
    env_dir.mkdir()
    monkeypatch.setenv('JAXTRAIN_DATA_DIR', str(env_dir))
    with pytest.raises(DataError) as e:
        data.load('cifar10', source='files', data_dir=str(tmp_path / 'nowhere'))
    msg = str(e.value)
    assert f'{tmp_path / "nowhere"} (data.dir, does not exist)' in msg
    assert f'{env_dir} ($JAXTRAIN_DATA_DIR)' in msg
    assert f'{isolated_env / ".cache" / "jaxtrain"} (default cache' in msg
    for name in ('cifar-10-python.tar.gz', 'cifar-10-batches-py/', 'data_batch_1'):
        assert name in msg
    assert '--config.data.dir' in msg and "data.source='tfds'" in msg


def test_auto_falls_back_to_tfds_and_reports_everything(tmp_path, isolated_env, monkeypatch):
    calls = []

    def fake_tfds(name, data_dir=None, download=True):
        calls.append((name, data_dir))
        raise DataError('tfds:cifar10: simulated tfds failure')

    monkeypatch.setattr(data, 'load_tfds', fake_tfds)
    with pytest.raises(DataError) as e:
        data.load('cifar10', data_dir=str(tmp_path))
    msg = str(e.value)
    assert calls == [('cifar10', str(tmp_path))]
    assert f'{tmp_path} (data.dir)' in msg
    assert f'{isolated_env / ".cache" / "jaxtrain"} (default cache' in msg
    assert 'cifar-10-python.tar.gz' in msg
    assert 'simulated tfds failure' in msg
    for hint in ('data.dir', '$JAXTRAIN_DATA_DIR', '~/.cache/jaxtrain', '--config.data.dir', "data.source='tfds'"):
        assert hint in msg


def test_tfds_without_tensorflow_says_how_to_install_it(monkeypatch):
    """The tfds extra brings tensorflow-datasets but not TensorFlow: the source says the
    one command that makes it work."""
    import sys
    monkeypatch.setitem(sys.modules, 'tensorflow', None)  # import tensorflow fails
    if importlib.util.find_spec('tensorflow_datasets') is None:
        missing("tensorflow-datasets is not installed (pip install -e '.[tfds]')")
    with pytest.raises(DataError) as e:
        data.load_tfds('cifar10')
    assert str(e.value).startswith('tfds:cifar10: tensorflow is not installed, '
                                   'tensorflow-datasets needs it (pip install tensorflow)')
    assert '\n' not in str(e.value)


def test_auto_uses_tfds_result_when_no_files(tmp_path, isolated_env, monkeypatch, cifar_subset):
    small = tiny(cifar_subset)
    fake = Dataset(small['x_train'], small['y_train'], small['x_test'], small['y_test'],
                   small['class_names'], 'tfds:cifar10')
    monkeypatch.setattr(data, 'load_tfds', lambda name, data_dir=None, download=True: fake)
    assert data.load('cifar10', data_dir=str(tmp_path)) is fake


def test_auto_prefers_files_and_tfds_source_skips_them(cifar_batches_dir, isolated_env, monkeypatch):
    monkeypatch.setattr(data, 'load_tfds', lambda *a, **k: 'from tfds')
    assert data.load('cifar10', 'auto', str(cifar_batches_dir)).origin.endswith('cifar-10-batches-py')
    assert data.load('cifar10', 'tfds', str(cifar_batches_dir)) == 'from tfds'


@pytest.mark.parametrize('name, source, match', [
    ('imagenet', 'files', r"unknown dataset 'imagenet'.*cifar10"),
    ('cifar10', 'web', r"unknown data source 'web'.*auto, files, download, tfds"),
])
def test_unknown_name_or_source(name, source, match, no_tfds):
    with pytest.raises(DataError, match=match):
        data.load(name, source=source)


# ---------------------------------------------------------------------------
# malformed files
# ---------------------------------------------------------------------------

def _bad(**changes):
    batch = batch_dict()
    batch.update(changes)
    return pickle.dumps(batch, protocol=2)


def _without(key):
    batch = batch_dict()
    del batch[key]
    return pickle.dumps(batch, protocol=2)


MALFORMED = {
    'label 10': (_bad(labels=[0, 1, 2, 10]), r'labels outside 0\.\.9'),
    'label -1': (_bad(labels=[0, -1, 2, 3]), r'labels outside 0\.\.9'),
    'too few labels': (_bad(labels=[0, 1, 2]), r'3 labels for 4 images'),
    'float labels': (_bad(labels=[0.5, 1, 2, 3]), r'labels must be'),
    'width 3071': (_bad(data=np.zeros((4, 3071), np.uint8)), r'shape \(4, 3071\)'),
    'flat data': (_bad(data=np.zeros(4 * 3072, np.uint8)), r'expected \(n, 3072\)'),
    'float data': (_bad(data=np.zeros((4, 3072), np.float32)), r'dtype float32'),
    'value 256': (_bad(data=np.full((4, 3072), 256, np.int16)), r'outside 0\.\.255'),
    'no data key': (_without('data'), r"missing key 'data'"),
    'no labels key': (_without('labels'), r"missing key 'labels'"),
    'not a dict': (pickle.dumps([1, 2, 3]), r'expected a dict'),
    'truncated': (_bad()[:-100], r'not a valid pickle'),
    'garbage': (b'this is not a pickle at all\n' * 10, r'not a valid pickle'),
    'empty': (b'', r'not a valid pickle'),
}


@pytest.mark.parametrize('case', list(MALFORMED))
def test_malformed_batch_is_rejected_naming_the_file(tmp_path, case):
    raw, match = MALFORMED[case]
    out = write_dir(tmp_path, {'data_batch_3': raw})
    with pytest.raises(DataError, match=match) as e:
        data.load_cifar10_dir(out)
    assert str(out / 'data_batch_3') in str(e.value)


@pytest.mark.parametrize('meta, match', [
    ({'label_names': ['a', 'b']}, r'list of 10 names'),
    ({'label_names': list(range(10))}, r'expected strings'),
    ({'num_vis': 3072}, r"missing key 'label_names'"),
])
def test_malformed_meta(tmp_path, meta, match):
    out = write_dir(tmp_path, {'batches.meta': pickle.dumps(meta)})
    with pytest.raises(DataError, match=match) as e:
        data.load_cifar10_dir(out)
    assert str(out / 'batches.meta') in str(e.value)


def test_missing_batch_file(tmp_path):
    out = write_dir(tmp_path)
    (out / 'data_batch_4').unlink()
    with pytest.raises(DataError, match='data_batch_4'):
        data.load_cifar10_dir(out)


def test_malformed_member_in_archive_names_it(tmp_path, cifar_batches_dir):
    batches = cifar_batches_dir / 'cifar-10-batches-py'
    members = {f'cifar-10-batches-py/{p.name}': p.read_bytes() for p in batches.iterdir()}
    members['cifar-10-batches-py/test_batch'] = _bad(labels=[0, 1, 2, 11])
    archive = write_tar(tmp_path / 'cifar-10-python.tar.gz', members)
    with pytest.raises(DataError, match=r'cifar-10-python\.tar\.gz:cifar-10-batches-py/test_batch: labels'):
        data.load_cifar10_archive(archive)


# ---------------------------------------------------------------------------
# unsafe pickles
# ---------------------------------------------------------------------------

def _exec_payload(marker):
    return Reduce(exec, f'open({str(marker)!r}, "w").close()')


def test_exec_payload_is_live_with_plain_pickle(tmp_path):
    """Guards the tests below: the payload really runs code when unpickled naively."""
    marker = tmp_path / 'MARKER'
    pickle.loads(pickle.dumps({'data': _exec_payload(marker)}, protocol=2))
    assert marker.exists()


@pytest.mark.parametrize('payload, refused', [
    (lambda m: Reduce(os.system, f'touch {shlex.quote(str(m))}'), r'(posix|os|nt)\.system'),
    (_exec_payload, r'(__builtin__|builtins)\.exec'),
    (lambda m: Reduce(eval, f'open({str(m)!r}, "w")'), r'(__builtin__|builtins)\.eval'),
    (lambda m: Reduce(getattr, Reduce(__import__, 'os'), 'system'), r'(__builtin__|builtins)\.getattr'),
    (lambda m: Reduce(np.save, str(m), np.zeros(1)), r'numpy[\w.]*\.save'),  # numpy is not allowed wholesale
])
@pytest.mark.parametrize('protocol', [2, 4])
@pytest.mark.parametrize('target', ['data_batch_1', 'batches.meta'])
def test_code_running_pickle_is_refused(tmp_path, payload, refused, protocol, target):
    marker = tmp_path / 'MARKER'
    evil = pickle.dumps({'data': payload(marker), 'labels': [0]}, protocol=protocol)
    out = write_dir(tmp_path / 'root', {target: evil})
    with pytest.raises(DataError, match='refused to unpickle global ' + refused) as e:
        data.load_cifar10_dir(out)
    assert str(out / target) in str(e.value)
    assert not marker.exists()


def test_code_running_pickle_in_archive_is_refused(tmp_path):
    marker = tmp_path / 'MARKER'
    members = {f'cifar-10-batches-py/{f}': pickle.dumps(batch_dict()) for f in BATCH_FILES}
    members['cifar-10-batches-py/test_batch'] = pickle.dumps({'data': _exec_payload(marker)})
    archive = write_tar(tmp_path / 'cifar-10-python.tar.gz', members)
    with pytest.raises(DataError, match=r'test_batch: refused to unpickle global builtins\.exec'):
        data.load_cifar10_archive(archive)
    assert not marker.exists()


def test_codecs_encode_only_latin1(tmp_path):
    import _codecs
    out = write_dir(tmp_path, {'test_batch': pickle.dumps({'data': Reduce(_codecs.encode, 'x', 'rot13')},
                                                           protocol=2)})
    with pytest.raises(DataError, match=r'test_batch: not a valid pickle.*rot13'):
        data.load_cifar10_dir(out)


# ---------------------------------------------------------------------------
# unsafe or broken archives
# ---------------------------------------------------------------------------

def _archive_with(tmp_path, info):
    """A .tar.gz with valid batches except that data_batch_1 is the given special member."""
    archive = tmp_path / 'cifar-10-python.tar.gz'
    with tarfile.open(archive, 'w:gz') as tar:
        tar.addfile(info)
        for f in BATCH_FILES[1:]:
            raw = pickle.dumps(batch_dict())
            good = tarfile.TarInfo(f'cifar-10-batches-py/{f}')
            good.size = len(raw)
            tar.addfile(good, io.BytesIO(raw))
    return archive


@pytest.mark.parametrize('kind', [tarfile.SYMTYPE, tarfile.LNKTYPE, tarfile.DIRTYPE, tarfile.CHRTYPE,
                                  tarfile.FIFOTYPE])
def test_special_archive_member_is_refused(tmp_path, monkeypatch, kind):
    monkeypatch.chdir(tmp_path)  # anything extracted relative to cwd would show up in tree()
    secret = tmp_path / 'secret'
    secret.write_bytes(pickle.dumps(batch_dict()))
    info = tarfile.TarInfo('cifar-10-batches-py/data_batch_1')
    info.type = kind
    info.linkname = str(secret)
    archive = _archive_with(tmp_path, info)
    before = tree(tmp_path)
    with pytest.raises(DataError, match=r'cifar-10-batches-py/data_batch_1: refused, not a regular file'):
        data.load_cifar10_archive(archive)
    assert tree(tmp_path) == before


@pytest.mark.parametrize('name', ['/cifar-10-batches-py/data_batch_1', '../cifar-10-batches-py/data_batch_1',
                                  'x/../cifar-10-batches-py/data_batch_1'])
def test_unsafe_paths_are_never_read(tmp_path, name):
    raw = pickle.dumps(batch_dict())
    info = tarfile.TarInfo(name)
    info.size = len(raw)
    archive = tmp_path / 'a.tar'
    with tarfile.open(archive, 'w') as tar:
        tar.addfile(info, io.BytesIO(raw))
    with pytest.raises(DataError, match=r'lacks member.*data_batch_1'):
        data.load_cifar10_archive(archive)


def test_missing_member(tmp_path):
    archive = write_tar(tmp_path / 'cifar-10-python.tar.gz',
                        {f'cifar-10-batches-py/{f}': pickle.dumps(batch_dict()) for f in BATCH_FILES[:-1]})
    with pytest.raises(DataError, match=r'cifar-10-python\.tar\.gz: archive lacks member.*test_batch'):
        data.load_cifar10_archive(archive)


def test_corrupt_archives(tmp_path, cifar_archive_dir):
    good = (cifar_archive_dir / 'cifar-10-python.tar.gz').read_bytes()
    for fname, raw in (('garbage.tar.gz', b'\x1f\x8b not really gzip' * 100),
                       ('truncated.tar.gz', good[:len(good) // 2]),
                       ('empty.tar.gz', b'')):
        path = tmp_path / fname
        path.write_bytes(raw)
        with pytest.raises(DataError, match=re.escape(str(path))):
            data.load_cifar10_archive(path)
    with pytest.raises(DataError, match='nonexistent'):
        data.load_cifar10_archive(tmp_path / 'nonexistent.tar.gz')


# ---------------------------------------------------------------------------
# fuzzing: mangled pickles only ever give DataError or a valid dataset
# ---------------------------------------------------------------------------

@pytest.fixture(scope='module')
def fuzz_dir(tmp_path_factory):
    return write_dir(tmp_path_factory.mktemp('fuzz'))


@settings(max_examples=150, derandomize=True, database=None, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(protocol=st.sampled_from([2, 4, 5]), cut=st.integers(0, 10_000),
       flips=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), max_size=3))
def test_mangled_pickles(fuzz_dir, protocol, cut, flips):
    raw = bytearray(pickle.dumps(batch_dict(), protocol=protocol))
    raw = raw[:cut] if cut < len(raw) else raw
    for pos, value in flips:
        if raw:
            raw[pos % len(raw)] = value
    (fuzz_dir / 'test_batch').write_bytes(bytes(raw))
    try:
        ds = data.load_cifar10_dir(fuzz_dir)
    except DataError as e:
        assert str(fuzz_dir / 'test_batch') in str(e)
    else:
        assert ds.x_test.dtype == np.uint8 and ds.x_test.shape[1:] == (32, 32, 3)
        assert ds.y_test.dtype == np.int32 and len(ds.y_test) == len(ds.x_test)
        assert ds.y_test.min(initial=0) >= 0 and ds.y_test.max(initial=0) <= 9


# ---------------------------------------------------------------------------
# tfds
# ---------------------------------------------------------------------------

def test_real_tfds_without_download_fails_cleanly(tmp_path):
    """Here tensorflow is absent (or cifar10 unprepared): either way a DataError, no network."""
    with pytest.raises(DataError, match=r'tfds:cifar10: .*(pip install tensorflow|not prepared)'):
        data.load_tfds('cifar10', data_dir=str(tmp_path), download=False)


def test_missing_tfds_or_tensorflow(monkeypatch):
    monkeypatch.setitem(sys.modules, 'tensorflow_datasets', None)
    with pytest.raises(DataError, match='pip install tensorflow-datasets'):
        data.load_tfds('cifar10')
    monkeypatch.setitem(sys.modules, 'tensorflow_datasets', types.ModuleType('tensorflow_datasets'))
    monkeypatch.setitem(sys.modules, 'tensorflow', None)
    with pytest.raises(DataError, match=r'tensorflow is not installed.*pip install tensorflow\)'):
        data.load_tfds('cifar10')


class FakeBuilder:
    def __init__(self, prepared=True, fail=None):
        self.prepared, self.fail, self.downloaded = prepared, fail, False
        self.data_dir = '/fake/tfds/cifar10'
        self.info = types.SimpleNamespace(features={'label': types.SimpleNamespace(names=['cat', 'dog'])})

    def download_and_prepare(self):
        if self.fail:
            raise self.fail
        self.downloaded = self.prepared = True

    def is_prepared(self):
        return self.prepared

    def as_dataset(self, split, batch_size, as_supervised):
        assert batch_size == -1 and as_supervised
        n = 3 if split == 'train' else 2
        return np.full((n, 28, 28, 1), 7, np.uint8), np.arange(n, dtype=np.int64) % 2


@pytest.fixture
def fake_tfds(monkeypatch):
    """Stand-ins for tensorflow-datasets and tensorflow, recording builder() calls."""
    module = types.ModuleType('tensorflow_datasets')
    module.calls = []
    module.next_builder = FakeBuilder()

    def builder(name, data_dir=None):
        module.calls.append((name, data_dir))
        return module.next_builder

    module.builder = builder
    module.as_numpy = lambda ds: ds
    monkeypatch.setitem(sys.modules, 'tensorflow_datasets', module)
    monkeypatch.setitem(sys.modules, 'tensorflow', types.ModuleType('tensorflow'))
    return module


def test_tfds_success(fake_tfds):
    ds = data.load_tfds('mnist', data_dir='/d', download=False)
    assert fake_tfds.calls == [('mnist', '/d')]
    assert ds.origin == 'tfds:mnist' and ds.class_names == ('cat', 'dog')
    assert ds.x_train.shape == (3, 28, 28, 1) and ds.x_train.dtype == np.uint8
    assert ds.y_test.dtype == np.int32 and ds.y_test.tolist() == [0, 1]
    assert ds.image_shape == (28, 28, 1) and ds.num_classes == 2


def test_tfds_download_and_not_prepared(fake_tfds):
    fake_tfds.next_builder = FakeBuilder(prepared=False)
    with pytest.raises(DataError, match=r'tfds:cifar10: not prepared in /fake/tfds/cifar10 and download=False'):
        data.load_tfds('cifar10', download=False)
    data.load_tfds('cifar10')
    assert fake_tfds.next_builder.downloaded


def test_tfds_errors_are_wrapped(fake_tfds):
    fake_tfds.next_builder = FakeBuilder(prepared=False, fail=ConnectionError('no route to host'))
    with pytest.raises(DataError, match=r'tfds:cifar10: ConnectionError: no route to host') as e:
        data.load_tfds('cifar10')
    assert isinstance(e.value.__cause__, ConnectionError)


def test_tfds_labels_out_of_range_are_refused(fake_tfds):
    fake_tfds.next_builder.info.features['label'].names = ['cat']  # labels 0 and 1, one class
    with pytest.raises(DataError, match=r'tfds:cifar10: train labels do not match'):
        data.load_tfds('cifar10', download=False)


@pytest.mark.slow
def test_without_cifar10_tests_skip_outside_ci_and_fail_under_ci(tmp_path):
    """A checkout without ../shared/data, an empty cache and no $JAXTRAIN_DATA_DIR: the
    tests that need CIFAR-10 skip with one line naming all three ways to provide it, and
    under CI=true the same line is a failure, so a CI machine without the data is red."""
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path
    checkout = tmp_path / "checkout" / "tests"  # no shared/ beside 'checkout'
    checkout.mkdir(parents=True)
    for helper in ("conftest.py", "quick_compile.py"):
        shutil.copy(Path(__file__).parent / helper, checkout)
    (checkout / "test_needs_data.py").write_text(
        "def test_it(cifar_subset):\n    assert False, 'not skipped'\n")
    repo = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k not in ("JAXTRAIN_DATA_DIR", "CI")}
    env.update(HOME=str(tmp_path / "home"), PYTHONPATH=str(repo))
    ways = ("../shared/data", "$JAXTRAIN_DATA_DIR", "python -m jaxtrain.data download")
    for ci in ("", "true"):
        result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rsE", "-p",
                                 "no:cacheprovider", str(checkout)], cwd=checkout,
                                env=dict(env, CI=ci), capture_output=True, text=True,
                                timeout=300)
        expected, prefix = ((1, "ERROR") if ci else (0, "SKIPPED"))
        assert result.returncode == expected, result.stdout[-2000:]
        assert ("1 error" if ci else "1 skipped") in result.stdout, result.stdout[-2000:]
        said = [line for line in result.stdout.splitlines() if line.startswith(prefix)]
        assert len(said) == 1, result.stdout[-2000:]
        assert "not skipped" not in result.stdout
        for way in ways:
            assert way in said[0], said[0]
        if ci:
            assert "CI=true and no CIFAR-10 test data" in said[0], said[0]
            assert "Traceback" not in result.stdout, result.stdout[-2000:]
