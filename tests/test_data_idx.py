"""MNIST-format IDX loading on the real Fashion-MNIST files (Debian's dataset-fashion-mnist)."""
import gzip
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

from jaxtrain import data

SYSTEM_DIR = Path("/usr/share/datasets/fashion-mnist")
FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
         "t10k-labels-idx1-ubyte")


@pytest.fixture(scope="module")
def fashion():
    if not (SYSTEM_DIR / (FILES[0] + ".gz")).exists():
        pytest.fail(f"{SYSTEM_DIR} is missing: apt-get install dataset-fashion-mnist "
                    "(.ci/run does this)")
    return data.load("fashion_mnist", "files", str(SYSTEM_DIR))


@pytest.fixture
def raw_copy(tmp_path):
    """An uncompressed copy of the four files, to be damaged by a test."""
    for name in FILES:
        with gzip.open(SYSTEM_DIR / (name + ".gz")) as src, open(tmp_path / name, "wb") as dst:
            shutil.copyfileobj(src, dst)
    return tmp_path


def test_real_files_load(fashion):
    assert fashion.x_train.shape == (60000, 28, 28, 1) and fashion.x_train.dtype == np.uint8
    assert fashion.x_test.shape == (10000, 28, 28, 1)
    assert fashion.y_train.dtype == np.int32
    assert np.bincount(fashion.y_train).tolist() == [6000] * 10
    assert np.bincount(fashion.y_test).tolist() == [1000] * 10
    assert fashion.class_names[0] == "T-shirt/top" and fashion.class_names[9] == "Ankle boot"
    # the first training image is an ankle boot (label 9) on a black background
    assert fashion.y_train[0] == 9 and fashion.x_train[0, 0, 0, 0] == 0
    assert fashion.x_train[0].max() == 255


def test_uncompressed_files_load_the_same(fashion, raw_copy):
    again = data.load("fashion_mnist", "files", str(raw_copy))
    np.testing.assert_array_equal(again.x_train, fashion.x_train)
    np.testing.assert_array_equal(again.y_test, fashion.y_test)


def test_the_debian_location_is_a_default(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("JAXTRAIN_DATA_DIR", raising=False)
    assert data.load("fashion_mnist", "files").origin == str(SYSTEM_DIR)


def test_a_subfolder_named_after_the_dataset_is_found(raw_copy, tmp_path_factory):
    root = tmp_path_factory.mktemp("root")
    shutil.copytree(raw_copy, root / "fashion-mnist")
    assert data.load("fashion_mnist", "files", str(root)).origin == str(root / "fashion-mnist")


def rewrite(path, transform):
    path.write_bytes(transform(path.read_bytes()))


@pytest.mark.parametrize("name,transform,message", [
    (FILES[0], lambda b: b"\x00\x00\x09\x03" + b[4:], "type 0x09"),
    (FILES[0], lambda b: b"\x1f\x8b" + b[2:], "not an IDX file"),
    (FILES[0], lambda b: b"\x00\x00\x08\x02" + b[4:], "with 2 dimensions"),
    (FILES[0], lambda b: b[:-100], "the file has 47039900"),
    (FILES[0], lambda b: b[:10], "truncated IDX header"),
    (FILES[1], lambda b: b[:4] + struct.pack(">I", 59999) + b[8:-1], "59999 labels for the 60000"),
    (FILES[3], lambda b: b[:-1] + b"\x0a", "labels outside 0..9"),
    (FILES[2], lambda b: b[:8] + struct.pack(">II", 14, 56) + b[16:],
     r"images are \(14, 56\)"),
])
def test_malformed_files_name_the_file_and_the_problem(raw_copy, name, transform, message):
    rewrite(raw_copy / name, transform)
    with pytest.raises(data.DataError, match=message) as error:
        data.load("fashion_mnist", "files", str(raw_copy))
    assert str(raw_copy / name) in str(error.value)


def test_a_corrupt_gzip_is_a_data_error(tmp_path):
    for name in FILES:
        shutil.copy(SYSTEM_DIR / (name + ".gz"), tmp_path / (name + ".gz"))
    rewrite(tmp_path / (FILES[0] + ".gz"), lambda b: b[:1000])
    with pytest.raises(data.DataError, match=FILES[0]):
        data.load("fashion_mnist", "files", str(tmp_path))


def test_missing_files_list_where_it_looked(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setitem(data._SYSTEM_DIRS, "fashion_mnist", (str(tmp_path / "system"),))
    with pytest.raises(data.DataError) as error:
        data.load("fashion_mnist", "files", str(tmp_path / "mine"))
    text = str(error.value)
    assert str(tmp_path / "mine") in text and str(tmp_path / "system") in text
    assert "train-images-idx3-ubyte" in text and "dataset-fashion-mnist" in text
