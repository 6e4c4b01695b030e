"""Shared test fixtures: small CIFAR-10 copies built from the real shared data.

The shared data lives beside the repository (../shared/data); it stores
CIFAR-10 as JPEGs (see its README). Decoding only the first few thousand
images keeps every fixture cheap (well under a second each).
"""
import importlib
import io
import os
import pickle
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest

import quick_compile  # imports no JAX

# XLA's LLVM backend at -O1 for everything the session compiles, here and in the processes
# the tests start (they inherit XLA_FLAGS), set before JAX is imported: programs compile
# almost as fast as at -O0 and run as fast as at the default -O2 (quick_compile.py).
os.environ['XLA_FLAGS'] = ' '.join(filter(None, [os.environ.get('XLA_FLAGS'),
                                                 quick_compile.xla_flags(1)]))

# Python's bytecode cache on, as Python's default has it, where the environment turned it
# off (PYTHONDONTWRITEBYTECODE, set in some images): otherwise each worker rewrites every
# test module's asserts again, and every process the tests start compiles jaxtrain's
# modules from source again (3 s of each worker's collection, 0.25 s of each command).
sys.dont_write_bytecode = False
os.environ.pop('PYTHONDONTWRITEBYTECODE', None)

SHARED_DATA = Path(__file__).resolve().parents[2] / 'shared' / 'data'
NPZ_NAME = 'cifar10_jpeg.npz'

N_TRAIN = 2000      # 5 batches of 400 rows
N_TEST = 500
TRAIN_BATCHES = tuple(f'data_batch_{i}' for i in range(1, 6))


def decode_jpegs(npz_path, split, n):
    """First n images of `split` as (uint8 (n, 32, 32, 3) HWC RGB, labels), like cifar10_jpeg.py."""
    from PIL import Image

    with np.load(npz_path) as z:
        header = z['jpeg_header'].tobytes()
        offsets = z[f'{split}_offsets'][:n + 1]
        scans = z[f'{split}_scans'][:offsets[-1]]
        labels = z[f'{split}_labels'][:n]
    images = [np.asarray(Image.open(io.BytesIO(header + scans[offsets[i]:offsets[i + 1]].tobytes()))
                         .convert('RGB')) for i in range(n)]
    return np.stack(images), labels.astype(np.int32)


def write_cifar_batches(root, subset, *, bytes_keys=False, protocol=2):
    """Write `subset` as <root>/cifar-10-batches-py in the Toronto pickle format; return root.

    Train rows are split evenly into data_batch_1..5; bytes_keys mimics the
    Python-2 originals as loaded with encoding='bytes'.
    """
    key = (lambda k: k.encode()) if bytes_keys else (lambda k: k)
    text = (lambda s: s.encode()) if bytes_keys else (lambda s: s)
    out = Path(root) / 'cifar-10-batches-py'
    out.mkdir(parents=True, exist_ok=True)

    def dump(fname, obj):
        with open(out / fname, 'wb') as f:
            pickle.dump(obj, f, protocol=protocol)

    def batch(fname, x, y):
        planar = np.ascontiguousarray(x.transpose(0, 3, 1, 2).reshape(len(x), 3072))  # R, G, B planes
        dump(fname, {
            key('batch_label'): text(f'{fname} of test subset'),
            key('labels'): [int(v) for v in y],
            key('data'): planar,
            key('filenames'): [text(f'{fname}_{i:05d}.png') for i in range(len(x))],
        })

    chunks = np.array_split(np.arange(len(subset['x_train'])), len(TRAIN_BATCHES))
    for fname, idx in zip(TRAIN_BATCHES, chunks):
        batch(fname, subset['x_train'][idx], subset['y_train'][idx])
    batch('test_batch', subset['x_test'], subset['y_test'])
    dump('batches.meta', {
        key('label_names'): [text(n) for n in subset['class_names']],
        key('num_cases_per_batch'): len(chunks[0]),
        key('num_vis'): 3072,
    })
    return Path(root)


def write_tar(archive, members):
    """Write a tar (gzip if the name ends in .gz) of {member name: bytes, or None for a directory}."""
    mode = 'w:gz' if str(archive).endswith('.gz') else 'w'
    kwargs = {'compresslevel': 1} if mode == 'w:gz' else {}
    with tarfile.open(archive, mode, **kwargs) as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            if data is None:
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return Path(archive)


@pytest.fixture(scope="module")
def compile_quickly():
    """For a module that marks itself `usefixtures("compile_quickly")`: XLA at -O0 for
    what its tests compile in this process (quick_compile.py: a CNN's init alone takes
    seconds at -O2). Every run a test there compares with another is compiled so. Not for
    close comparisons of two different programs (XLA at -O0 may round them apart where
    -O1 does not)."""
    import quick_compile
    with quick_compile.in_process():
        yield


def normal(shape, seed):
    """float32 N(0, 1) draws from NumPy: each eager jax.random call compiles a threefry
    program of its own (a second or so apiece on a CPU)."""
    return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


def session_root(tmp_path_factory, worker_id) -> Path:
    """The folder every pytest-xdist worker of this session shares (a worker's own base
    folder is inside it)."""
    root = tmp_path_factory.getbasetemp()
    return root if worker_id == 'master' else root.parent


def once_per_session(tmp_path_factory, worker_id, name, make):
    """(folder, make(folder)): run by the first pytest-xdist worker that asks, read back
    (its JSON) by the others, so that a run several tests read is made once a session,
    not once a worker. The programs a test compiles after the run are read from the
    persistent compilation cache wherever the run was (one_compilation_cache)."""
    import json

    import filelock

    root = session_root(tmp_path_factory, worker_id)
    folder, result = root / name, root / f'{name}.json'
    with filelock.FileLock(str(root / f'{name}.lock')):
        if not result.exists():
            result.write_text(json.dumps(make(folder)))
    return folder, json.loads(result.read_text())


# main.py's command line, in a process whose deep built-in models are cut to their
# smallest form: the ResNets one block a stage, the ViTs two blocks. The same layers, names
# and code paths (a stage's first block is the one with the stride and the projection)
# at a fraction of the compile time; the weights files these runs start from are cut alike.
SMALL_MODELS_MAIN = """
import runpy, sys
from jaxtrain.models import resnet, vit
for name, (stages, block) in list(resnet.RESNETS.items()):
    resnet.RESNETS[name] = ((1, 1, 1, 1), block)
for name, (dim, depth, heads) in list(vit.VITS.items()):
    vit.VITS[name] = (dim, 2, heads)
sys.argv = ["main.py", *sys.argv[1:]]
runpy.run_path("main.py", run_name="__main__")
"""


def small_models_main(*args) -> list:
    """The argv that runs main.py with `args` in a process whose deep built-in models are
    cut to their smallest form (SMALL_MODELS_MAIN)."""
    import sys
    return [sys.executable, "-c", SMALL_MODELS_MAIN, *map(str, args)]


def free_port() -> int:
    """A TCP port on localhost that no one listens on now (a coordinator's, a server's)."""
    import socket
    with socket.socket() as s:
        s.bind(('localhost', 0))
        return s.getsockname()[1]


def finish(process, timeout=300):
    """A started subprocess.Popen's CompletedProcess, killed after `timeout` seconds."""
    import subprocess
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        stdout, stderr = process.communicate()
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def init_compiled(model, x):
    """A Flax model's variables (key 0, train=False) from one compiled init call, as training
    makes them: op by op, each op of a CNN's init compiles on its own (several times slower
    on a CPU)."""
    import functools

    import jax
    return jax.jit(functools.partial(model.init, train=False))(jax.random.key(0), x)


# The longest tests (a minute or more each on a 2-core CI machine) start first, so that
# with the workers (-n 2 --dist worksteal) the rest fill in around them instead of one
# of them running alone at the end.
LONGEST_FIRST = ('test_scale.py', 'test_gpu.py', 'test_parallel.py', 'test_checkpoint.py', 'test_input.py',
                 'test_weights.py', 'test_export.py')


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FIRST)))  # stable


@pytest.fixture(scope='session', autouse=True)
def no_internet_downloads():
    """data.source='auto' downloads what it cannot find: in tests, from a closed local
    port (refused at once), never from the internet. The download tests pass their own."""
    import os
    os.environ.setdefault('JAXTRAIN_DOWNLOAD_MIRROR', 'http://127.0.0.1:9/')


@pytest.fixture(scope='session', autouse=True)
def one_compilation_cache():
    """JAX's persistent compilation cache on in each worker from its start, in the folder
    every run of the session shares (train.compilation_cache's default under this HOME).
    JAX keeps the first folder a process sets (xla_cache.enable), so otherwise a test that
    trains in this process with HOME pointed at an empty folder of its own would move every
    program the worker compiled after it into that folder, shared with no one."""
    from jaxtrain.config import defaults
    from jaxtrain.runtime import xla_cache
    xla_cache.enable(defaults.get_config().train.compilation_cache)


IN_CI = os.environ.get('CI', '').lower() in ('true', '1')


def missing(reason):
    """What a test needs is not here (data, a build, an optional package): outside CI the
    test is skipped with the reason; under CI=true it fails with that one line, since a CI
    machine that tests less must not go green. Callable in a test, a fixture or at module level."""
    if IN_CI:
        pytest.fail(f'CI=true and {reason}', pytrace=False)
    pytest.skip(reason, allow_module_level=True)


def require_module(name, install):
    """The module `name`, or missing() saying how to install it."""
    try:
        return importlib.import_module(name)
    except ImportError as error:
        missing(f'{name} cannot be imported ({error}): {install}')


HOW_TO_GET_DATA = ('no CIFAR-10 test data: put shared/data (its cifar10_jpeg.npz) beside the '
                   'checkout as ../shared/data, set $JAXTRAIN_DATA_DIR to a folder holding '
                   'cifar-10-batches-py, or run `python -m jaxtrain.data download cifar10` '
                   '(into ~/.cache/jaxtrain)')


@pytest.fixture(scope='session')
def shared_data_dir():
    """../shared/data beside the repository (the JPEG copy); without it the tests that
    need those exact files are skipped (failed under CI=true), saying how to get the data."""
    if not (SHARED_DATA / NPZ_NAME).is_file():
        missing(HOW_TO_GET_DATA)
    return SHARED_DATA


@pytest.fixture(scope='session')
def cifar_subset():
    """First 2000 train / 500 test real CIFAR-10 images as numpy arrays: the JPEG copy in
    ../shared/data, else a CIFAR-10 in $JAXTRAIN_DATA_DIR or the cache (where `python -m
    jaxtrain.data download cifar10` puts it), else every test that needs them is skipped
    (failed under CI=true) with one line saying how to provide it."""
    npz = SHARED_DATA / NPZ_NAME
    if npz.is_file():
        x_train, y_train = decode_jpegs(npz, 'train', N_TRAIN)
        x_test, y_test = decode_jpegs(npz, 'test', N_TEST)
        with np.load(npz) as z:
            class_names = tuple(str(c) for c in z['classes'])
        return {'x_train': x_train, 'y_train': y_train, 'x_test': x_test, 'y_test': y_test,
                'class_names': class_names}
    from jaxtrain import data
    try:
        cached = data.load('cifar10', 'files', data.CACHE_DIR)
    except data.DataError:
        missing(HOW_TO_GET_DATA)
    return {'x_train': cached.x_train[:N_TRAIN], 'y_train': cached.y_train[:N_TRAIN],
            'x_test': cached.x_test[:N_TEST], 'y_test': cached.y_test[:N_TEST],
            'class_names': cached.class_names}


@pytest.fixture(scope='session')
def write_cifar():
    """The batch writer, for tests that need their own small CIFAR directories."""
    return write_cifar_batches


@pytest.fixture(scope='session')
def cifar_batches_dir(tmp_path_factory, worker_id, cifar_subset):
    """Root dir (what users pass as data.dir) holding cifar-10-batches-py/ with str keys; one
    folder for every worker of the session, so that a run made once a session
    (once_per_session) has the data.dir of every test that reads it."""
    root = session_root(tmp_path_factory, worker_id) / 'cifar_str_keys'
    import filelock
    with filelock.FileLock(f'{root}.lock'):
        if not (root / 'cifar-10-batches-py' / 'batches.meta').exists():  # written last
            write_cifar_batches(root, cifar_subset)
    return root


@pytest.fixture(scope='session')
def cifar_bytes_keys_dir(tmp_path_factory, cifar_subset):
    """Like cifar_batches_dir but with bytes keys and values, as the Python-2 originals."""
    return write_cifar_batches(tmp_path_factory.mktemp('cifar_bytes_keys'), cifar_subset, bytes_keys=True)


@pytest.fixture(scope='session')
def cifar_archive_dir(tmp_path_factory, cifar_batches_dir):
    """Dir holding cifar-10-python.tar.gz of the str-key batches (members under cifar-10-batches-py/)."""
    batches = cifar_batches_dir / 'cifar-10-batches-py'
    root = tmp_path_factory.mktemp('cifar_archive')
    members = {'cifar-10-batches-py': None}  # the real archive has a directory entry too
    members.update({f'cifar-10-batches-py/{p.name}': p.read_bytes() for p in sorted(batches.iterdir())})
    write_tar(root / 'cifar-10-python.tar.gz', members)
    return root


def write_jpeg_folder(root, npz_path, counts):
    """root/{train,test}/<class>/NNNNN.jpg: the shared copy's own JPEG files (not re-encoded)
    of the first counts[split] images of each split."""
    with np.load(npz_path) as z:
        header = z['jpeg_header'].tobytes()
        classes = [str(c) for c in z['classes']]
        for split, n in counts.items():
            offsets, scans, labels = (z[f'{split}_offsets'][:n + 1], z[f'{split}_scans'],
                                      z[f'{split}_labels'][:n])
            for i in range(n):
                folder = Path(root) / split / classes[labels[i]]
                folder.mkdir(parents=True, exist_ok=True)
                (folder / f'{i:05d}.jpg').write_bytes(
                    header + scans[offsets[i]:offsets[i + 1]].tobytes())
    return Path(root)


@pytest.fixture(scope='session')
def cifar_jpeg_folder(tmp_path_factory, shared_data_dir):
    """640 training and 100 test images of real CIFAR-10 as JPEG files in class folders."""
    return write_jpeg_folder(tmp_path_factory.mktemp('cifar_jpeg_folder'),
                             shared_data_dir / NPZ_NAME, {'train': 640, 'test': 100})


@pytest.fixture(scope='session')
def imagenet_folder(tmp_path_factory):
    """An ImageNet-layout folder (train/<wnid>/*.JPEG, val/<wnid>/*.JPEG) of real
    photographs (scikit-image's samples) cut into crops of mixed sizes: 4 classes,
    8 training and 2 validation images each."""
    import skimage
    from PIL import Image

    photos = Path(skimage.__file__).parent / 'data'
    sources = [Image.open(photos / name).convert('RGB')
               for name in ('astronaut.png', 'coffee.png', 'chelsea.png', 'rocket.jpg')]
    rng = np.random.default_rng(0)
    root = tmp_path_factory.mktemp('imagenet')
    for label, photo in enumerate(sources):
        wnid = f'n0{1440764 + label}'
        for split, n in (('train', 8), ('val', 2)):
            folder = root / split / wnid
            folder.mkdir(parents=True)
            for i in range(n):
                w, h = photo.size
                cw, ch = int(rng.integers(w // 3, w)), int(rng.integers(h // 3, h))
                left, top = int(rng.integers(0, w - cw)), int(rng.integers(0, h - ch))
                photo.crop((left, top, left + cw, top + ch)).save(
                    folder / f'{wnid}_{i}.JPEG', quality=85)
    return root
