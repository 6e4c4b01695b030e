"""Mutated real data files: the loaders load them or raise DataError, never anything else,
never hang (hypothesis deadline). Complements the crafted-pickle and archive tests in
test_data.py."""
import functools
import gzip
import shutil
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxtrain import data
from jaxtrain.data import DataError

FASHION = "/usr/share/datasets/fashion-mnist"
mutations = st.tuples(
    st.integers(0, 1 << 20),                                      # keep only this many bytes
    st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 255)), max_size=4),  # overwrite
    st.lists(st.tuples(st.integers(0, 1 << 20), st.binary(max_size=8)), max_size=2))  # insert
FUZZ = settings(max_examples=60, derandomize=True, database=None, deadline=30_000,  # a hang, not a slow example
                suppress_health_check=[HealthCheck.function_scoped_fixture])


def mutate(raw: bytes, mutation) -> bytes:
    cut, overwrites, inserts = mutation
    raw = bytearray(raw[:cut] if cut < len(raw) else raw)
    for position, value in overwrites:
        if raw:
            raw[position % len(raw)] = value
    for position, extra in inserts:
        position = position % (len(raw) + 1)
        raw[position:position] = extra
    return bytes(raw)


def check_valid(dataset, channels):
    assert dataset.x_train.dtype == np.uint8 and dataset.x_train.shape[-1] == channels
    for x, y in ((dataset.x_train, dataset.y_train), (dataset.x_test, dataset.y_test)):
        assert y.dtype == np.int32 and len(y) == len(x)
        assert y.min(initial=0) >= 0 and y.max(initial=0) < dataset.num_classes


@pytest.mark.slow
@FUZZ
@given(name=st.sampled_from(["data_batch_1", "test_batch", "batches.meta"]), mutation=mutations)
def test_mutated_real_cifar_files(cifar_batches_dir, tmp_path_factory, name, mutation):
    work = tmp_path_factory.mktemp("cifar") / "cifar-10-batches-py"
    shutil.copytree(cifar_batches_dir / "cifar-10-batches-py", work)
    (work / name).write_bytes(mutate((work / name).read_bytes(), mutation))
    try:
        check_valid(data.load_cifar10_dir(work), 3)
    except DataError as error:
        assert str(work / name) in str(error)


@functools.cache
def real_fashion_rows():
    real = data.load_idx_dir(FASHION, ("c",) * 10)
    return real.x_train[:64, ..., 0], real.y_train[:64]


def small_idx(tmp_path, images, labels):
    """Real Fashion-MNIST rows written as the four IDX files (uncompressed)."""
    for prefix in ("train", "t10k"):
        (tmp_path / f"{prefix}-images-idx3-ubyte").write_bytes(
            struct.pack(">I3I", 0x803, len(images), 28, 28) + images.tobytes())
        (tmp_path / f"{prefix}-labels-idx1-ubyte").write_bytes(
            struct.pack(">II", 0x801, len(labels)) + labels.astype(np.uint8).tobytes())
    return tmp_path


@FUZZ
@given(name=st.sampled_from(["train-images-idx3-ubyte", "train-labels-idx1-ubyte",
                             "t10k-images-idx3-ubyte"]),
       compress=st.booleans(), mutation=mutations)
def test_mutated_real_idx_files(tmp_path_factory, name, compress, mutation):
    work = small_idx(tmp_path_factory.mktemp("idx"), *real_fashion_rows())
    raw = (work / name).read_bytes()
    if compress:  # mutate the gzip stream itself
        (work / name).unlink()
        path = work / (name + ".gz")
        path.write_bytes(mutate(gzip.compress(raw), mutation))
    else:
        path = work / name
        path.write_bytes(mutate(raw, mutation))
    try:
        check_valid(data.load_idx_dir(str(work), ("c",) * 10), 1)
    except DataError as error:
        assert str(work) in str(error)
