"""jaxtrain.data.folder.load_folder: image-folder trees of real images -> uint8 arrays.

Real data: the first 2000 train / 500 test CIFAR-10 JPEGs written by the
shared script's own write_folder (its reader limited to those images), which
must load to exactly the pixels and labels of the pickle layout; and
scikit-image's sample photographs (mixed sizes and modes) for resizing and
colour conversion.
"""
import importlib.util
import io
import itertools
import os
import shutil
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import skimage
from PIL import Image

from jaxtrain import data
from jaxtrain.config import checks
from jaxtrain.data import DataError, folder
from jaxtrain.data.folder import load_folder
from jaxtrain.run import loop

REPO = Path(__file__).resolve().parents[1]
SKIMAGE_DATA = Path(skimage.__file__).parent / 'data'
BILINEAR = Image.Resampling.BILINEAR


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------

def png_bytes(w=8, h=8, seed=0, mode='RGB'):
    rng = np.random.default_rng(seed)
    shape = (h, w, 3) if mode == 'RGB' else (h, w)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8)).save(buf, 'PNG')
    return buf.getvalue()


def make_tree(root, files):
    """Write {relative path: bytes, or None for an empty folder} under root; return root."""
    root = Path(root)
    for rel, content in files.items():
        p = root / rel
        if content is None:
            p.mkdir(parents=True, exist_ok=True)
        else:
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(content)
    return root


def small_tree(root, n=3):
    """A valid tree: train/{a,b}, test/{a,b}, n 8x8 PNGs each."""
    seed = lambda split, cls, i: 100 * (split == 'test') + 10 * (cls == 'b') + i  # noqa: E731
    return make_tree(root, {f'{split}/{cls}/{i}.png': png_bytes(seed=seed(split, cls, i))
                            for split in ('train', 'test') for cls in 'ab' for i in range(n)})


def png_claiming(width, height):
    """A PNG whose header claims width x height (the data is not there)."""
    def chunk(kind, body):
        return struct.pack('>I', len(body)) + kind + body + struct.pack('>I', zlib.crc32(kind + body))
    return (b'\x89PNG\r\n\x1a\n' + chunk(b'IHDR', struct.pack('>IIBBBBB', width, height, 8, 2, 0, 0, 0))
            + chunk(b'IDAT', zlib.compress(b'')) + chunk(b'IEND', b''))


def raises_naming(path, match, fn, *args, **kwargs):
    """fn(*args) raises a one-line DataError whose message names `path` and matches `match`."""
    with pytest.raises(DataError, match=match) as info:
        fn(*args, **kwargs)
    message = str(info.value)
    assert str(path) in message, message
    assert '\n' not in message
    return message


def crop_reference(im, size):
    """The documented recipe, done here with Pillow: short side to size, centre crop."""
    w, h = im.size
    s = size / min(w, h)
    nw, nh = max(size, round(w * s)), max(size, round(h * s))
    im = im.resize((nw, nh), BILINEAR, reducing_gap=3.0)
    left, top = (nw - size) // 2, (nh - size) // 2
    return np.asarray(im.crop((left, top, left + size, top + size)))


def index(root, rel, split='train'):
    """Position of image `rel` (e.g. 'a/x.png') in a split: by class, then by path."""
    paths = []
    split_dir = Path(root) / split
    for cls in sorted(p.name for p in split_dir.iterdir() if p.is_dir() and not p.name.startswith('.')):
        paths += sorted(f'{cls}/{p.name}' for p in (split_dir / cls).iterdir()
                        if p.suffix.lower() in folder.IMAGE_EXTENSIONS and not p.name.startswith('.'))
    return paths.index(rel)


# ---------------------------------------------------------------------------
# Real CIFAR-10: the shared script's folder layout against its pickle layout
# ---------------------------------------------------------------------------

@pytest.fixture(scope='session')
def cifar_script(shared_data_dir, cifar_subset):
    """The shared cifar10_jpeg.py, its reader limited to the first images of each split.

    Limited to the images of cifar_subset (2000 train, 500 test), its writers
    produce exactly what they write for those images from all 60,000: the
    same files, names and numbering (NNNN counts a class's images in split
    order), and the same pickles.
    """
    spec = importlib.util.spec_from_file_location('cifar10_jpeg_for_tests',
                                                  shared_data_dir / 'cifar10_jpeg.py')
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    counts = {'train': len(cifar_subset['x_train']), 'test': len(cifar_subset['x_test'])}
    every = script.jpeg_files
    script.jpeg_files = lambda split, npz=script.NPZ: itertools.islice(every(split, npz), counts[split])
    return script


@pytest.fixture(scope='session')
def cifar_folder(tmp_path_factory, cifar_script):
    """<root>/{train,test}/<class>/NNNN.jpg, written by the script's own write_folder."""
    root = tmp_path_factory.mktemp('cifar_folder')
    cifar_script.write_folder(str(root))
    return root


@pytest.fixture(scope='session')
def cifar_from_folder(cifar_folder):
    return load_folder(cifar_folder, cache_dir=None, workers=1)


def test_cifar_folder_equals_the_pickle_layout(cifar_script, cifar_folder, cifar_from_folder,
                                               cifar_subset, tmp_path):
    ref = data.load_cifar10_dir(cifar_script.write_batches(str(tmp_path)))  # the script's pickles
    np.testing.assert_array_equal(ref.x_train, cifar_subset['x_train'])
    ds = cifar_from_folder
    assert ds.class_names == ref.class_names == data.CIFAR10_CLASSES
    assert ds.origin == os.fspath(cifar_folder)
    for split in ('train', 'test'):
        x, y = getattr(ds, f'x_{split}'), getattr(ds, f'y_{split}')
        x_ref, y_ref = getattr(ref, f'x_{split}'), getattr(ref, f'y_{split}')
        assert x.dtype == np.uint8 and x.flags.c_contiguous and y.dtype == np.int32
        assert x.shape == x_ref.shape
        # The folder is ordered by class, then by file number = order within the split.
        order = np.argsort(y_ref, kind='stable')
        np.testing.assert_array_equal(y, y_ref[order])
        np.testing.assert_array_equal(x, x_ref[order])
    # and the numbering really is that: the 3rd cat of the test split is test/cat/0002.jpg
    k = np.flatnonzero(ref.y_test == 3)[2]
    with Image.open(cifar_folder / 'test' / 'cat' / '0002.jpg') as im:
        np.testing.assert_array_equal(np.asarray(im.convert('RGB')), ref.x_test[k])


FORKED_LOAD = """
import sys
import numpy as np
from jaxtrain.data import folder
assert folder._mp_context().get_start_method() == 'fork'  # a fresh process: JAX not started
ds = folder.load_folder(sys.argv[1], cache_dir=None, workers=2)
np.savez(sys.argv[2], x_train=ds.x_train, y_train=ds.y_train, x_test=ds.x_test, y_test=ds.y_test)
"""


@pytest.mark.slow
def test_worker_processes_give_identical_arrays(cifar_folder, cifar_from_folder, tmp_path, monkeypatch):
    """workers=2 and 3 (2500 files in 10 and 13 chunks) against workers=1, both ways of starting workers.

    workers=N is this process and a pool of N - 1 more.
    """
    def assert_same(got):
        for k in ('x_train', 'y_train', 'x_test', 'y_test'):
            np.testing.assert_array_equal(got[k], getattr(cifar_from_folder, k))

    # Forked workers writing into shared memory; in a fresh process, as this
    # one may have started JAX already (other tests), which rules fork out.
    subprocess.run([sys.executable, '-c', FORKED_LOAD, str(cifar_folder), str(tmp_path / 'forked.npz')],
                   check=True, cwd=REPO)
    with np.load(tmp_path / 'forked.npz') as z:
        assert_same(z)
    # A process whose JAX backends run threads must not fork: it gets a fork server.
    monkeypatch.setattr(folder, '_jax_backends_started', lambda: True)
    assert folder._mp_context().get_start_method() != 'fork'
    via_server = load_folder(cifar_folder, cache_dir=None, workers=3)
    assert_same({k: getattr(via_server, k) for k in ('x_train', 'y_train', 'x_test', 'y_test')})


SERVED_LOAD_THEN_LEAK = """
import sys
from multiprocessing import shared_memory
from jaxtrain.data import folder
folder._jax_backends_started = lambda: True  # as after a jit call: the pool is not forked
folder.load_folder(sys.argv[1], cache_dir=None, workers=2)
# what a Grain worker leaves when a stream closes mid-batch: a block no one unlinks
block = shared_memory.SharedMemory(create=True, size=64)
"""


@pytest.mark.slow  # a process of its own, with a fork server
def test_a_folder_decoded_by_a_fork_server_leaves_the_tracker_quiet(tmp_path):
    """The pool's first lock starts multiprocessing's resource tracker, which reads
    PYTHONWARNINGS then, once: a streaming run's one-line error stays one line even when
    the test split was decoded by a fork server before Grain's workers started (seen as
    a "leaked shared_memory objects" warning under the error of test_input's corrupt image)."""
    root = small_tree(tmp_path / 'tree')
    result = subprocess.run([sys.executable, '-c', SERVED_LOAD_THEN_LEAK, str(root)], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ''


# ---------------------------------------------------------------------------
# Real photographs of mixed sizes and modes (scikit-image's samples)
# ---------------------------------------------------------------------------

@pytest.fixture(scope='session')
def photos(tmp_path_factory):
    """train/{colour,grey,other}, test/{colour,grey} of PNG, JPEG, BMP and WebP files.

    Modes: RGB, RGBA, P (with and without transparency), L, I;16 and CMYK.
    """
    root = tmp_path_factory.mktemp('photos')
    src = {name: Image.open(SKIMAGE_DATA / name) for name in
           ('astronaut.png', 'coffee.png', 'chelsea.png', 'camera.png', 'moon.png', 'coins.png',
            'horse.png')}
    colour, grey, other = (root / 'train' / c for c in ('colour', 'grey', 'other'))
    for d in (colour, grey, other, root / 'test' / 'colour', root / 'test' / 'grey'):
        d.mkdir(parents=True)
    shutil.copy(SKIMAGE_DATA / 'astronaut.png', colour)
    shutil.copy(SKIMAGE_DATA / 'coffee.png', colour)
    shutil.copy(SKIMAGE_DATA / 'rocket.jpg', colour)          # a real JPEG: the draft() path
    src['chelsea.png'].quantize(64).save(colour / 'chelsea_palette.png')
    rgba = src['chelsea.png'].convert('RGBA')
    rgba.putalpha(Image.linear_gradient('L').resize(rgba.size))
    rgba.save(colour / 'chelsea_rgba.png')
    pal = src['chelsea.png'].quantize(16)
    pal.save(colour / 'chelsea_palette_transparent.PNG', transparency=0)  # tRNS; upper-case suffix
    shutil.copy(SKIMAGE_DATA / 'camera.png', grey)             # L
    src['camera.png'].save(grey / 'camera.jpg', quality=90)     # grey JPEG
    moon16 = np.asarray(src['moon.png']).astype(np.uint16) * 257
    Image.fromarray(moon16).save(grey / 'moon16.png')           # I;16
    src['coffee.png'].save(other / 'coffee.bmp')
    src['chelsea.png'].save(other / 'chelsea.webp', lossless=True)
    src['coffee.png'].convert('CMYK').save(other / 'coffee_cmyk.jpg', quality=95)
    shutil.copy(SKIMAGE_DATA / 'horse.png', other)              # RGBA original
    shutil.copy(SKIMAGE_DATA / 'coins.png', root / 'test' / 'grey')
    shutil.copy(SKIMAGE_DATA / 'chelsea.png', root / 'test' / 'colour')
    # ignored: other extensions, hidden files and folders
    (colour / 'notes.txt').write_text('not an image')
    (colour / '.hidden.png').write_bytes(b'garbage')
    make_tree(root, {'train/.ipynb_checkpoints/x.png': b'garbage', 'train/grey/.cache/y.jpg': b'garbage',
                     'train/readme.png': b'garbage beside the class folders'})
    return root


@pytest.fixture(scope='session')
def photos_64(photos):
    return load_folder(photos, image_size=64, cache_dir=None, workers=1)


def test_photos_load_cropped(photos, photos_64):
    ds = photos_64
    assert ds.class_names == ('colour', 'grey', 'other')
    assert ds.x_train.shape == (13, 64, 64, 3) and ds.x_test.shape == (2, 64, 64, 3)
    assert ds.y_train.tolist() == [0] * 6 + [1] * 3 + [2] * 4
    assert ds.y_test.tolist() == [0, 1]
    assert ds.image_shape == (64, 64, 3)


def test_centre_crop_is_pillows_resize_then_crop(photos, photos_64):
    coffee = Image.open(photos / 'train/colour/coffee.png').convert('RGB')  # 600 x 400
    got = photos_64.x_train[index(photos, 'colour/coffee.png')]
    np.testing.assert_array_equal(got, crop_reference(coffee, 64))
    # the middle of the picture, not an edge: close to a fair (no reducing_gap) resample of it
    fair = np.asarray(coffee.resize((96, 64), BILINEAR).crop((16, 0, 80, 64)), np.int16)
    assert np.abs(got.astype(np.int16) - fair).mean() < 1.5
    shifted = np.asarray(coffee.resize((96, 64), BILINEAR).crop((0, 0, 64, 64)), np.int16)
    assert np.abs(got.astype(np.int16) - shifted).mean() > 10


def test_jpeg_draft_stays_close_to_a_full_decode(photos, photos_64):
    got = photos_64.x_train[index(photos, 'colour/rocket.jpg')].astype(np.int16)
    full = crop_reference(Image.open(photos / 'train/colour/rocket.jpg').convert('RGB'), 64)
    assert np.abs(got - full).mean() < 2.0


def test_modes_become_rgb(photos, photos_64):
    x = photos_64.x_train
    at = lambda rel: x[index(photos, rel)]  # noqa: E731
    chelsea = crop_reference(Image.open(SKIMAGE_DATA / 'chelsea.png').convert('RGB'), 64)
    # RGBA: alpha is dropped (not composited), so the colours are chelsea's own
    np.testing.assert_array_equal(at('colour/chelsea_rgba.png'), chelsea)
    # lossless BMP and WebP give exactly the PNG's pixels
    np.testing.assert_array_equal(at('other/chelsea.webp'), chelsea)
    coffee = crop_reference(Image.open(SKIMAGE_DATA / 'coffee.png').convert('RGB'), 64)
    np.testing.assert_array_equal(at('other/coffee.bmp'), coffee)
    # palette images (with and without transparency): their palette colours
    for name in ('chelsea_palette.png', 'chelsea_palette_transparent.PNG'):
        pal = Image.open(photos / 'train/colour' / name).convert('RGBA').convert('RGB')
        np.testing.assert_array_equal(at(f'colour/{name}'), crop_reference(pal, 64))
    # grey -> three equal channels, the grey image's own values
    camera = at('grey/camera.png')
    assert (camera[..., 0] == camera[..., 1]).all() and (camera[..., 0] == camera[..., 2]).all()
    np.testing.assert_array_equal(camera[..., 0],
                                  crop_reference(Image.open(SKIMAGE_DATA / 'camera.png'), 64))
    # 16-bit grey is scaled, not clipped: moon * 257 gives moon back
    moon = crop_reference(Image.open(SKIMAGE_DATA / 'moon.png'), 64)
    np.testing.assert_array_equal(at('grey/moon16.png')[..., 0], moon)
    # CMYK JPEG: back to about coffee's colours
    assert np.abs(at('other/coffee_cmyk.jpg').astype(np.int16) - coffee).mean() < 6
    assert at('other/horse.png').shape == (64, 64, 3)


def test_exact_resize_and_rectangular_size(photos):
    ds = load_folder(photos, image_size=(48, 80), resize='exact', cache_dir=None, workers=1)
    assert ds.x_train.shape == (13, 48, 80, 3)
    coffee = Image.open(SKIMAGE_DATA / 'coffee.png').convert('RGB')
    np.testing.assert_array_equal(ds.x_train[index(photos, 'colour/coffee.png')],
                                  np.asarray(coffee.resize((80, 48), BILINEAR, reducing_gap=3.0)))
    cropped = load_folder(photos, image_size=(48, 80), cache_dir=None, workers=1)
    astronaut = Image.open(SKIMAGE_DATA / 'astronaut.png')  # 512 x 512 -> 80 x 80 -> rows 16..64
    expected = np.asarray(astronaut.resize((80, 80), BILINEAR, reducing_gap=3.0))[16:64]
    np.testing.assert_array_equal(cropped.x_train[index(photos, 'colour/astronaut.png')], expected)


def test_one_channel(photos):
    ds = load_folder(photos, image_size=64, channels=1, cache_dir=None, workers=1)
    assert ds.x_train.shape == (13, 64, 64, 1) and ds.image_shape == (64, 64, 1)
    coffee = Image.open(SKIMAGE_DATA / 'coffee.png').convert('L')
    np.testing.assert_array_equal(ds.x_train[index(photos, 'colour/coffee.png'), ..., 0],
                                  crop_reference(coffee, 64))
    camera = crop_reference(Image.open(SKIMAGE_DATA / 'camera.png'), 64)
    np.testing.assert_array_equal(ds.x_train[index(photos, 'grey/camera.png'), ..., 0], camera)


def test_val_is_accepted_without_test(tmp_path):
    root = make_tree(tmp_path, {'train/a/0.png': png_bytes(), 'val/a/0.png': png_bytes(seed=1)})
    ds = load_folder(root, cache_dir=None)
    assert ds.x_test.shape == (1, 8, 8, 3) and ds.class_names == ('a',)


def test_links_inside_the_root_are_followed(tmp_path):
    root = small_tree(tmp_path / 'root', n=2)
    os.symlink(root / 'train' / 'a' / '0.png', root / 'train' / 'b' / 'alias.png')
    os.symlink(root / 'test' / 'a', root / 'test' / 'a' / 'loop')  # a cycle is walked once
    ds = load_folder(root, cache_dir=None)
    assert ds.y_train.tolist() == [0, 0, 1, 1, 1]
    np.testing.assert_array_equal(ds.x_train[4], ds.x_train[0])  # b/alias.png is a/0.png
    assert ds.y_test.tolist() == [0, 0, 1, 1]


# ---------------------------------------------------------------------------
# Errors name the file
# ---------------------------------------------------------------------------

def test_truncated_jpeg(tmp_path):
    jpeg = (SKIMAGE_DATA / 'rocket.jpg').read_bytes()
    root = small_tree(tmp_path)
    bad = make_tree(root, {'train/b/cut.jpg': jpeg[:len(jpeg) // 2]}) / 'train/b/cut.jpg'
    raises_naming(bad, 'truncated', load_folder, root, image_size=32, cache_dir=None)


def test_garbage_png(tmp_path):
    root = small_tree(tmp_path)
    bad = make_tree(root, {'test/a/zz.png': b'this is not an image'}) / 'test/a/zz.png'
    raises_naming(bad, 'cannot decode', load_folder, root, cache_dir=None)


def test_a_file_is_only_given_to_the_allowed_decoders(tmp_path):
    root = small_tree(tmp_path)
    gif = io.BytesIO()
    Image.new('RGB', (8, 8)).save(gif, 'GIF')
    bad = make_tree(root, {'train/a/really_a_gif.png': gif.getvalue()}) / 'train/a/really_a_gif.png'
    raises_naming(bad, 'cannot decode', load_folder, root, cache_dir=None)


def test_errors_from_worker_processes(tmp_path):
    """With workers, the first bad file in walking order is reported, whichever fails first."""
    root = small_tree(tmp_path, n=40)  # 160 files: several chunks over three processes
    make_tree(root, {'train/a/0_bad.png': b'garbage', 'train/b/9_bad.jpg': b'garbage too'})
    raises_naming(root / 'train/a/0_bad.png', 'cannot decode', load_folder, root, cache_dir=None,
                  workers=3)


def test_empty_class_folder(tmp_path):
    root = small_tree(tmp_path)
    make_tree(root, {'train/c/notes.txt': b'no images here'})
    raises_naming(root / 'train' / 'c', 'empty class folder', load_folder, root, cache_dir=None)


def test_test_class_missing_from_train(tmp_path):
    root = small_tree(tmp_path)
    make_tree(root, {'test/zebra/0.png': png_bytes()})
    raises_naming(root / 'test' / 'zebra', "class 'zebra' is not in", load_folder, root, cache_dir=None)


def test_missing_folders_and_no_images(tmp_path):
    raises_naming(tmp_path / 'nowhere', 'no such directory', load_folder, tmp_path / 'nowhere')
    raises_naming(tmp_path / 'train', 'missing', load_folder, tmp_path)
    make_tree(tmp_path, {'train/a/0.png': png_bytes()})
    raises_naming(tmp_path / 'test', r'missing \(and no val/', load_folder, tmp_path)
    empty = make_tree(tmp_path / 'empty', {'train/readme.txt': b'', 'test/a/0.png': png_bytes()})
    raises_naming(empty / 'train', 'no images', load_folder, empty, cache_dir=None)


@pytest.mark.parametrize('width, height, max_pixels, match', [
    (100_000, 100_000, 10**12, 'decompression bomb'),  # Pillow's error (over 2x its limit)
    (10_000, 10_000, 10**12, 'decompression bomb'),    # Pillow's warning (over its limit)
    (5_000, 5_000, 10**6, 'over max_pixels=1000000'),  # ours, from the header
])
@pytest.mark.parametrize('image_size', [None, 8])
def test_decompression_bomb_header(tmp_path, width, height, max_pixels, match, image_size):
    root = small_tree(tmp_path)
    bomb = make_tree(root, {'train/a/00.png': png_claiming(width, height)}) / 'train/a/00.png'
    raises_naming(bomb, 'refused.*' + match, load_folder, root, image_size=image_size,
                  cache_dir=None, max_pixels=max_pixels)


def test_max_pixels(tmp_path):
    root = small_tree(tmp_path)
    raises_naming(root / 'train/a/0.png', 'over max_pixels=63', load_folder, root, image_size=4,
                  cache_dir=None, max_pixels=63)
    assert load_folder(root, cache_dir=None, max_pixels=64).x_train.shape == (6, 8, 8, 3)


def test_symlinks_out_of_the_root_are_refused(tmp_path):
    outside = make_tree(tmp_path / 'outside', {'c/0.png': png_bytes(), 'img.png': png_bytes()})
    root = small_tree(tmp_path / 'root')
    os.symlink(outside / 'img.png', root / 'train' / 'a' / 'evil.png')
    raises_naming(root / 'train' / 'a' / 'evil.png', 'refused, symbolic link', load_folder, root,
                  cache_dir=None)
    os.unlink(root / 'train' / 'a' / 'evil.png')
    os.symlink(outside / 'c', root / 'train' / 'c')
    raises_naming(root / 'train' / 'c', 'outside', load_folder, root, cache_dir=None)
    os.unlink(root / 'train' / 'c')
    os.symlink(outside / 'c', root / 'train' / 'a' / 'sub')  # deeper down too
    raises_naming(root / 'train' / 'a' / 'sub', 'outside', load_folder, root, cache_dir=None)
    os.unlink(root / 'train' / 'a' / 'sub')
    shutil.move(root / 'test', tmp_path / 'test_elsewhere')
    os.symlink(tmp_path / 'test_elsewhere', root / 'test')
    raises_naming(root / 'test', 'outside', load_folder, root, cache_dir=None)
    # a link to something load_folder ignores anyway is no error
    shutil.rmtree(root / 'test', ignore_errors=True)
    os.unlink(root / 'test')
    shutil.copytree(tmp_path / 'test_elsewhere', root / 'test')
    os.symlink(outside / 'img.png', root / 'train' / 'a' / 'notes.txt')
    assert load_folder(root, cache_dir=None).x_train.shape == (6, 8, 8, 3)


def test_broken_symlink(tmp_path):
    root = small_tree(tmp_path)
    os.symlink(root / 'train' / 'a' / 'gone.png', root / 'train' / 'a' / 'dangling.png')
    raises_naming(root / 'train' / 'a' / 'dangling.png', 'broken symbolic link', load_folder, root,
                  cache_dir=None)


def test_differing_sizes_need_image_size(tmp_path):
    root = small_tree(tmp_path)
    odd = make_tree(root, {'train/b/odd.png': png_bytes(9, 8)}) / 'train/b/odd.png'
    message = raises_naming(odd, 'data.image_size', load_folder, root, cache_dir=None)
    assert '9x8' in message and str(root / 'train/a/0.png') in message
    assert load_folder(root, image_size=8, cache_dir=None).x_train.shape == (7, 8, 8, 3)


@pytest.mark.parametrize('kwargs, match', [
    ({'resize': 'stretch'}, 'data.resize'), ({'channels': 4}, 'data.channels'),
    ({'image_size': 0}, 'data.image_size'), ({'image_size': (32, 32, 3)}, 'data.image_size'),
    ({'image_size': 'big'}, 'data.image_size'), ({'workers': -1}, 'data.workers'),
])
def test_bad_arguments(tmp_path, kwargs, match):
    with pytest.raises(DataError, match=match):
        load_folder(small_tree(tmp_path), cache_dir=None, **kwargs)


# ---------------------------------------------------------------------------
# Cache
# ---------------------------------------------------------------------------

@pytest.fixture
def count_decodes(monkeypatch):
    """Counts files decoded in this process (workers=1 decodes in-process)."""
    calls = []
    real = folder._decode_file

    def counted(path, *args):
        calls.append(path)
        return real(path, *args)
    monkeypatch.setattr(folder, '_decode_file', counted)
    return calls


def cache_files(cache):
    return sorted((cache / folder.CACHE_SUBDIR).glob('*.npz'))


def same(a, b):
    for k in ('x_train', 'y_train', 'x_test', 'y_test'):
        np.testing.assert_array_equal(getattr(a, k), getattr(b, k))
    assert a.class_names == b.class_names


def test_cache_hit_decodes_nothing(tmp_path, count_decodes):
    root, cache = small_tree(tmp_path / 'root'), tmp_path / 'cache'
    first = load_folder(root, cache_dir=cache, workers=1)
    assert len(count_decodes) == 12 and len(cache_files(cache)) == 1
    second = load_folder(root, cache_dir=cache, workers=1)
    assert len(count_decodes) == 12  # nothing decoded
    same(first, second)
    assert second.x_train.dtype == np.uint8 and second.y_train.dtype == np.int32
    assert not list((cache / folder.CACHE_SUBDIR).glob('*.tmp'))


def test_changes_invalidate_the_cache(tmp_path, count_decodes):
    root, cache = small_tree(tmp_path / 'root'), tmp_path / 'cache'
    load_folder(root, cache_dir=cache, workers=1)
    st = os.stat(root / 'train/a/1.png')
    os.utime(root / 'train/a/1.png', ns=(st.st_atime_ns, st.st_mtime_ns + 1000))  # touched
    load_folder(root, cache_dir=cache, workers=1)
    assert len(count_decodes) == 24 and len(cache_files(cache)) == 2
    make_tree(root, {'test/b/new.png': png_bytes(seed=7)})                      # added
    ds = load_folder(root, cache_dir=cache, workers=1)
    assert len(count_decodes) == 37 and ds.x_test.shape[0] == 7
    os.unlink(root / 'train/b/0.png')                                             # removed
    ds = load_folder(root, cache_dir=cache, workers=1)
    assert len(count_decodes) == 49 and ds.x_train.shape[0] == 5
    load_folder(root, image_size=4, cache_dir=cache, workers=1)                   # other settings
    assert len(count_decodes) == 61 and len(cache_files(cache)) == 5
    load_folder(root, image_size=4, cache_dir=cache, workers=1)
    assert len(count_decodes) == 61


@pytest.mark.parametrize('damage', ['garbage', 'truncated', 'wrong arrays'])
def test_corrupt_cache_is_rewritten(tmp_path, count_decodes, damage):
    root, cache = small_tree(tmp_path / 'root'), tmp_path / 'cache'
    good = load_folder(root, cache_dir=cache, workers=1)
    [path] = cache_files(cache)
    if damage == 'garbage':
        path.write_bytes(b'not a zip file')
    elif damage == 'truncated':
        path.write_bytes(path.read_bytes()[:1000])
    else:
        with np.load(path) as z:
            arrays = dict(z)
        arrays['x_train'] = arrays['x_train'][:, :4]
        np.savez(path, **arrays)
    again = load_folder(root, cache_dir=cache, workers=1)
    assert len(count_decodes) == 24
    same(good, again)
    with np.load(path) as z:  # rewritten whole
        np.testing.assert_array_equal(z['x_train'], good.x_train)
    load_folder(root, cache_dir=cache, workers=1)
    assert len(count_decodes) == 24


def test_no_cache_and_unwritable_cache(tmp_path, monkeypatch):
    root = small_tree(tmp_path / 'root')
    monkeypatch.setenv('HOME', str(tmp_path / 'home'))
    load_folder(root, cache_dir=None)
    assert not (tmp_path / 'home').exists()
    blocker = tmp_path / 'a_file'
    blocker.write_text('')
    ds = load_folder(root, cache_dir=blocker)  # cannot make a folder there: a warning, no error
    assert ds.x_train.shape == (6, 8, 8, 3)
    load_folder(root)  # the default, ~/.cache/jaxtrain
    assert len(list((tmp_path / 'home/.cache/jaxtrain/folders').glob('*.npz'))) == 1


@pytest.mark.slow
def test_a_short_run_trains_on_a_folder(cifar_folder, tmp_path, monkeypatch):
    """main's path: data.name='folder' through data.load_config, cached in ~/.cache/jaxtrain."""
    from configs import cifar_seed_cnn

    monkeypatch.setenv('HOME', str(tmp_path / 'home'))
    config = cifar_seed_cnn.get_config()
    config.data.name, config.data.dir = 'folder', str(cifar_folder)
    config.data.image_size = 32
    config.train.batch_size, config.train.num_steps, config.eval.batch_size = 50, 30, 250
    summary = loop.train_and_evaluate(config, str(tmp_path / 'run'))
    assert summary['steps'] == 30 and np.isfinite(summary['test_loss'])
    assert list((tmp_path / 'home' / '.cache' / 'jaxtrain' / 'folders').glob('*.npz'))


def test_the_folder_and_cifar100_configs_check():
    from configs import cifar100_resnet18, folder

    for module in (folder, cifar100_resnet18):
        config = module.get_config()
        checks.check_config(config)
        assert config.model.name == 'resnet18'
    assert folder.get_config().data.name == 'folder'
    assert cifar100_resnet18.get_config().data.name == 'cifar100'
