"""Your own data (an .npz of arrays) and CIFAR-100, on real CIFAR-10 images."""
import pickle

import numpy as np
import pytest
from conftest import write_tar
from overrides import with_overrides

from configs import cifar_seed_cnn
from jaxtrain import data
from jaxtrain.run import loop

COARSE = 20


def cifar100_files(subset, *, bytes_keys=False):
    """{file name: pickle bytes} in the exact layout and keys of cifar-100-python: `train`
    and `test` (data, fine_labels, coarse_labels, filenames, batch_label) and `meta`
    (fine_label_names, coarse_label_names). Real CIFAR-10 images, labels spread over the
    100 fine classes; coarse = fine // 5."""
    key = (lambda k: k.encode()) if bytes_keys else (lambda k: k)
    rng = np.random.default_rng(0)

    def batch(x, name):
        fine = rng.integers(0, 100, len(x))
        return pickle.dumps({
            key('filenames'): [f'{name}_{i}.png' for i in range(len(x))],
            key('batch_label'): f'{name} batch 1 of 1',
            key('fine_labels'): [int(v) for v in fine],
            key('coarse_labels'): [int(v) // 5 for v in fine],
            key('data'): np.ascontiguousarray(x.transpose(0, 3, 1, 2).reshape(len(x), 3072)),
        }, protocol=2)

    return {'train': batch(subset['x_train'][:300], 'train'),
            'test': batch(subset['x_test'][:100], 'test'),
            'meta': pickle.dumps({key('fine_label_names'): [f'fine{i}' for i in range(100)],
                                  key('coarse_label_names'): [f'coarse{i}' for i in range(COARSE)]},
                                 protocol=2)}


@pytest.fixture(scope='module')
def cifar100_root(cifar_subset, tmp_path_factory):
    root = tmp_path_factory.mktemp('cifar100')
    (root / 'cifar-100-python').mkdir()
    for name, raw in cifar100_files(cifar_subset).items():
        (root / 'cifar-100-python' / name).write_bytes(raw)
    return root


def test_cifar100_fine_and_coarse_labels(cifar100_root, cifar_subset):
    fine = data.load('cifar100', 'files', str(cifar100_root))
    coarse = data.load('cifar100', 'files', str(cifar100_root), label='coarse')
    assert fine.num_classes == 100 and coarse.num_classes == COARSE
    assert fine.class_names[7] == 'fine7' and coarse.class_names[3] == 'coarse3'
    np.testing.assert_array_equal(fine.x_train, cifar_subset['x_train'][:300])  # HWC, exact
    np.testing.assert_array_equal(coarse.y_train, fine.y_train // 5)
    assert fine.x_test.shape == (100, 32, 32, 3) and fine.y_train.dtype == np.int32


def test_cifar100_archive_with_bytes_keys(cifar_subset, tmp_path):
    files = cifar100_files(cifar_subset, bytes_keys=True)
    write_tar(tmp_path / 'cifar-100-python.tar.gz',
              {f'cifar-100-python/{name}': raw for name, raw in files.items()})
    dataset = data.load('cifar100', 'files', str(tmp_path), label='coarse')
    assert dataset.num_classes == COARSE and len(dataset.x_train) == 300
    assert dataset.origin.endswith('cifar-100-python.tar.gz')


def test_cifar100_errors_name_the_file(cifar100_root, cifar_subset, tmp_path):
    with pytest.raises(data.DataError, match=r"data.label='medium'.*'fine'.*'coarse'"):
        data.load('cifar100', 'files', str(cifar100_root), label='medium')
    files = cifar100_files(cifar_subset)
    (tmp_path / 'cifar-100-python').mkdir()
    for name, raw in files.items():
        (tmp_path / 'cifar-100-python' / name).write_bytes(raw)
    (tmp_path / 'cifar-100-python' / 'meta').write_bytes(
        pickle.dumps({'fine_label_names': ['only', 'two']}))
    with pytest.raises(data.DataError, match=r"cifar-100-python/meta: fine_label_names must "
                                             r"be a list of 100 names"):
        data.load('cifar100', 'files', str(tmp_path))
    (tmp_path / 'cifar-100-python' / 'test').unlink()
    with pytest.raises(data.DataError, match=r"cifar-100-python/test: cannot read"):
        data.load('cifar100', 'files', str(tmp_path))


# ---------------------------------------------------------------- arrays

@pytest.fixture(scope='module')
def arrays_npz(cifar_subset, tmp_path_factory):
    path = tmp_path_factory.mktemp('arrays') / 'mine.npz'
    np.savez(path, x_train=cifar_subset['x_train'], y_train=cifar_subset['y_train'],
             x_test=cifar_subset['x_test'], y_test=cifar_subset['y_test'],
             class_names=np.array(cifar_subset['class_names']))
    return path


def test_arrays_load_as_given(arrays_npz, cifar_subset):
    for where in (arrays_npz, arrays_npz.parent):  # the file, or a folder holding one
        dataset = data.load('arrays', data_dir=str(where))
        np.testing.assert_array_equal(dataset.x_train, cifar_subset['x_train'])
        np.testing.assert_array_equal(dataset.y_test, cifar_subset['y_test'])
        assert dataset.class_names == cifar_subset['class_names']
        assert dataset.origin == str(arrays_npz)


def test_grey_arrays_without_class_names(tmp_path):
    rng = np.random.default_rng(0)
    path = tmp_path / 'grey.npz'
    np.savez(path, x_train=rng.integers(0, 256, (20, 28, 28), np.uint8),
             y_train=np.arange(20) % 3, x_test=rng.integers(0, 256, (6, 28, 28), np.uint8),
             y_test=np.arange(6) % 3)
    dataset = data.load('arrays', data_dir=str(path))
    assert dataset.image_shape == (28, 28, 1) and dataset.class_names == ('0', '1', '2')


@pytest.mark.parametrize('arrays,message', [
    ({'x_train': np.zeros((4, 8, 8, 3), np.uint8), 'y_train': np.zeros(4, int)},
     r'missing array\(s\) x_test, y_test'),
    ({'x_train': np.zeros((4, 8, 8, 3), np.float32), 'y_train': np.zeros(4, int),
      'x_test': np.zeros((2, 8, 8, 3), np.uint8), 'y_test': np.zeros(2, int)},
     r'x_train is float32 \(4, 8, 8, 3\); expected uint8'),
    ({'x_train': np.zeros((4, 8, 8, 3), np.uint8), 'y_train': np.zeros(3, int),
      'x_test': np.zeros((2, 8, 8, 3), np.uint8), 'y_test': np.zeros(2, int)},
     r'y_train is int64 \(3,\); expected integer labels \(4,\)'),
    ({'x_train': np.zeros((4, 8, 8, 3), np.uint8), 'y_train': np.zeros(4, int),
      'x_test': np.zeros((2, 9, 9, 3), np.uint8), 'y_test': np.zeros(2, int)},
     r'x_test images are \(9, 9, 3\), x_train images are \(8, 8, 3\)'),
    ({'x_train': np.zeros((4, 8, 8, 3), np.uint8), 'y_train': np.array([0, 1, 2, 5]),
      'x_test': np.zeros((2, 8, 8, 3), np.uint8), 'y_test': np.zeros(2, int),
      'class_names': np.array(['a', 'b'])}, r'label 5 but only 2 class_names'),
    ({'x_train': np.zeros((4, 8, 8, 3), np.uint8), 'y_train': np.zeros(4, int),
      'x_test': np.zeros((2, 8, 8, 3), np.uint8), 'y_test': np.array([None, 1], object)},
     r'refused, holds Python objects'),
], ids=['missing', 'float_images', 'label_count', 'sizes', 'class_names', 'pickled'])
def test_bad_arrays_are_refused_naming_the_file(tmp_path, arrays, message):
    path = tmp_path / 'bad.npz'
    np.savez(path, **arrays)
    with pytest.raises(data.DataError, match=message) as error:
        data.load('arrays', data_dir=str(path))
    assert str(error.value).startswith(str(path))


def test_own_data_needs_data_dir(tmp_path):
    with pytest.raises(data.DataError, match=r"data.name='arrays' reads data.dir"):
        data.load('arrays')
    with pytest.raises(data.DataError, match=r"exactly one, found 0"):
        data.load('arrays', data_dir=str(tmp_path))
    (tmp_path / 'not.npz').write_bytes(b'garbage')
    with pytest.raises(data.DataError, match=r'not.npz: not a readable .npz file'):
        data.load('arrays', data_dir=str(tmp_path))
    with pytest.raises(data.DataError, match=r"unknown dataset 'imagenet'; supported: arrays, "
                                             r"cifar10, cifar100, fashion_mnist, folder, mnist"):
        data.load('imagenet')


@pytest.mark.slow
def test_a_short_run_trains_on_an_npz(arrays_npz, tmp_path):
    config = cifar_seed_cnn.get_config()
    config = with_overrides(config, {'data__name': 'arrays', 'data__dir': str(arrays_npz),
                                     'train__batch_size': 50, 'train__num_steps': 40,
                                     'eval__batch_size': 250})
    summary = loop.train_and_evaluate(config, str(tmp_path))
    assert summary['steps'] == 40 and 0.0 <= summary['test_accuracy'] <= 1.0
    assert np.isfinite(summary['test_loss'])
