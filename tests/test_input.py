"""Streaming input (jaxtrain/training/batches.py): the same batches and parameters as the
device path, exact resume after SIGKILL, disjoint shards over processes, corrupt files,
ImageNet's recipe."""
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
import quick_compile
from conftest import free_port, small_models_main
import fork_server
from overrides import with_overrides

import jaxtrain
from configs import cifar_seed_cnn
from jaxtrain import data
from jaxtrain.config import checks
from jaxtrain.data import folder_stream
from jaxtrain.errors import ConfigError
from jaxtrain.run import loop
from jaxtrain.runtime import mesh as mesh_lib
from jaxtrain.runtime import report
from jaxtrain.training import batches, checkpoint, inputs
from jaxtrain.training import step as step_lib

pytestmark = pytest.mark.usefixtures("compile_quickly")  # conftest.py

REPO = Path(__file__).resolve().parents[1]


def small_config(data_dir, **overrides):
    """seed_cnn with BatchNorm, alternating flips and shifts: 40 steps of 50 an epoch."""
    config = cifar_seed_cnn.get_config()
    config.data.dir = str(data_dir)
    config.data.source = "files"
    config.model.batch_norm = True
    config.augment.flip = True
    config.augment.alternate_flip = True
    config.augment.translate = 2
    config.train.batch_size = 50
    config.train.num_steps = 60
    config.train.log_every_steps = 10
    config.checkpoint.every_steps = 20
    config.eval.batch_size = 250
    return with_overrides(config, overrides)


def digest(*arrays) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


# ---------------------------------------------------------------- placement

def test_auto_places_what_fits_on_the_device_and_streams_the_rest():
    memory = (1000, "test memory")
    assert batches.choose_placement("auto", 500, 0.5, memory)[0] == "device"
    placement, why = batches.choose_placement("auto", 501, 0.5, memory)
    assert placement == "stream"
    assert "over data.device_fraction=0.5 of test memory" in why
    assert batches.choose_placement("device", 10**15, 0.5, memory) == ("device",
                                                                       "data.placement='device'")


@pytest.mark.parametrize("overrides, message", [
    ({"data__placement": "disk"}, "config.data.placement='disk': must be one of auto, device"),
    ({"data__device_fraction": 0.0}, "config.data.device_fraction=0.0: must be in (0, 1]"),
    ({"augment__crop": "random_resized"}, "needs data.name='folder' and data.placement='stream'"),
    ({"augment__crop_scale": (0.5, 0.2)}, "config.augment.crop_scale=(0.5, 0.2)"),
])
def test_bad_input_settings_are_named(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        checks.check_config(small_config("unused", **overrides))


# ---------------------------------------------------------------- same batches, same parameters

def test_the_stream_reads_exactly_the_device_paths_batches(cifar_subset):
    """Every step of two epochs: the uint8 images and labels the device path gathers
    (x[order[step]]) are those the stream delivers, and the orders are the same."""
    x, y = cifar_subset["x_train"], cifar_subset["y_train"]
    batch, steps_per_epoch = 64, len(x) // 64
    key = jax.random.key(3)
    mesh = mesh_lib.create_mesh()
    stream = batches.Stream(x, y, key, batch_size=batch, steps_per_epoch=steps_per_epoch,
                            total_steps=2 * steps_per_epoch, sharding=mesh_lib.batch_sharded(mesh))
    device_hashes, stream_hashes = [], []
    stream.open(0)
    try:
        for epoch in range(2):
            order = np.asarray(step_lib.epoch_order(key, epoch, len(x))[0])
            key_data = np.asarray(jax.random.key_data(key))
            np.testing.assert_array_equal(order, batches.epoch_permutation(key_data, epoch, len(x)))
            for step in range(steps_per_epoch):
                picked = order[step * batch:(step + 1) * batch]
                device_hashes.append(digest(x[picked], y[picked]))
                images, labels, indices = (np.asarray(a) for a in stream.next())
                np.testing.assert_array_equal(indices, picked)
                stream_hashes.append(digest(images, labels))
    finally:
        stream.close()
    assert stream_hashes == device_hashes
    assert len(set(device_hashes)) == len(device_hashes)  # the steps differ from each other


@pytest.fixture(scope="module")
def device_run(cifar_batches_dir, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("device_run")
    return workdir, loop.train_and_evaluate(
        small_config(cifar_batches_dir, data__placement="device"), str(workdir))


@pytest.mark.slow
def test_device_and_stream_end_with_identical_parameters(device_run, cifar_batches_dir, tmp_path,
                                                         capfd):
    """The two compiled programs differ (a gather inside the step, or a batch passed in),
    yet XLA computes the same bits: params_sha256 is equal, not merely close."""
    _, device = device_run
    stream = loop.train_and_evaluate(small_config(cifar_batches_dir, data__placement="stream"),
                                      str(tmp_path))
    assert device["data_placement"] == "device" and stream["data_placement"] == "stream"
    assert stream["params_sha256"] == device["params_sha256"]
    for key in ("test_accuracy", "test_loss", "train_loss"):
        assert stream[key] == device[key], key
    assert device["input_wait_fraction"] == 0.0
    assert 0.0 <= stream["input_wait_fraction"] < 1.0
    rows = report.read_metrics(str(tmp_path))
    assert [r["step"] for r in rows] == list(range(10, 61, 10))
    assert all(0.0 <= r["input_wait_fraction"] <= 1.0 for r in rows)
    capfd.readouterr()
    restored = jaxtrain.restore(str(tmp_path))  # a checkpoint with the Grain item, read quietly
    assert restored.step == 60
    assert "could not be restored" not in capfd.readouterr().err


def test_a_streamed_folders_statistics_come_from_a_sample(cifar_jpeg_folder):
    """(and its images are load_folder's pixels: a streamed folder trains as its arrays do)"""
    dataset = folder_stream.load_folder_stream(cifar_jpeg_folder, workers=1, cache_dir=None)
    assert isinstance(dataset.x_train, folder_stream.FolderImages)
    assert dataset.x_train.shape == (640, 32, 32, 3) and dataset.x_test.shape == (100, 32, 32, 3)
    decoded = data.load("folder", data_dir=str(cifar_jpeg_folder), workers=1)
    np.testing.assert_array_equal(dataset.x_train[np.array([5, 600])],
                                  decoded.x_train[[5, 600]])
    np.testing.assert_array_equal(dataset.y_train, decoded.y_train)
    config = small_config(cifar_jpeg_folder, data__mean=(), data__std=())
    # 640 images < STATS_IMAGES: the sample is the whole split, so the statistics are equal
    assert (inputs.channel_stats(dataset, config.data)
            == inputs.channel_stats(decoded, config.data))


def test_random_resized_crops_depend_on_seed_epoch_and_image_only(imagenet_folder):
    dataset = folder_stream.load_folder_stream(imagenet_folder, image_size=48, workers=1,
                                               cache_dir=None)
    crops = dataset.x_train.with_random_crop(0, (0.08, 1.0), (3 / 4, 4 / 3), True)
    first = crops.read(np.array([0, 5, 9]), epoch=0)
    assert first.shape == (3, 48, 48, 3) and first.dtype == np.uint8
    np.testing.assert_array_equal(first, crops.read(np.array([0, 5, 9]), epoch=0))
    np.testing.assert_array_equal(first[1], crops.read(np.array([5]), epoch=0)[0])
    assert not np.array_equal(first, crops.read(np.array([0, 5, 9]), epoch=1))
    other_seed = dataset.x_train.with_random_crop(1, (0.08, 1.0), (3 / 4, 4 / 3), True)
    assert not np.array_equal(first, other_seed.read(np.array([0, 5, 9]), epoch=0))
    whole = dataset.x_train.with_random_crop(0, (1.0, 1.0), (1.0, 1.0), False)
    assert whole.read(np.array([0]), 0).shape == (1, 48, 48, 3)


# ---------------------------------------------------------------- real processes

STREAM_RUN = ["--config=configs/cifar_seed_cnn.py", "--config.data.name=folder",
              "--config.data.placement=stream", "--config.data.workers=2",
              "--config.data.mean=()", "--config.data.std=()",
              "--config.model.batch_norm=True", "--config.augment.flip=True",
              "--config.augment.translate=2", "--config.train.batch_size=8",
              "--config.train.num_steps=160", "--config.train.log_every_steps=10",
              "--config.checkpoint.every_steps=50", "--config.eval.every_epochs=0"]


def start_main(workdir, data_dir, *extra):
    return fork_server.Popen([sys.executable, "main.py", f"--workdir={workdir}", *STREAM_RUN,
                             f"--config.data.dir={data_dir}", *extra], cwd=REPO,
                             env=quick_compile.env(1), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)


def wait_for_step(workdir, step, process, timeout=300):
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert process.poll() is None, process.communicate()
        if (Path(workdir) / "metrics.jsonl").exists() and any(
                r["step"] >= step for r in report.read_metrics(str(workdir))):
            return
        time.sleep(0.02)
    raise AssertionError(f"step {step} not reached")


@pytest.mark.slow
def test_a_sigkilled_streaming_run_resumes_bit_identical(cifar_jpeg_folder, tmp_path):
    """Two epochs of 80 steps from JPEG files, 2 Grain workers; killed past step 90,
    resumed from the Grain iterator state of its newest checkpoint."""
    reference = start_main(tmp_path / "reference", cifar_jpeg_folder)
    killed = start_main(tmp_path / "killed", cifar_jpeg_folder)
    wait_for_step(tmp_path / "killed", 90, killed)
    import psutil  # (a dependency of Grain)
    workers = [c for c in psutil.Process(killed.pid).children(recursive=True)
               if "spawn_main" in " ".join(c.cmdline())]
    assert len(workers) == 2
    killed.kill()
    killed.wait()
    gone, alive = psutil.wait_procs(workers, timeout=15)  # they notice and exit
    assert not alive
    out, err = reference.communicate(timeout=600)
    assert reference.returncode == 0, err
    assert not (tmp_path / "killed" / "summary.json").exists()
    saved = max(int(p.name) for p in (tmp_path / "killed" / "checkpoints").iterdir()
                if p.name.isdigit())
    assert 50 <= saved < 160  # mid-run; the newest may still be in flight when killed
    assert (tmp_path / "killed" / "checkpoints" / str(saved) / "input"
            / "process_0-of-1.json").is_file()
    rerun = start_main(tmp_path / "killed", cifar_jpeg_folder)
    out, err = rerun.communicate(timeout=600)
    assert rerun.returncode == 0, err
    assert f"resumed from checkpoint step {saved}" in out
    summary = json.loads((tmp_path / "killed" / "summary.json").read_text())
    expected = json.loads((tmp_path / "reference" / "summary.json").read_text())
    assert summary["resumed_from_step"] == saved
    assert summary["params_sha256"] == expected["params_sha256"]
    for key in ("test_accuracy", "test_loss", "train_loss"):
        assert summary[key] == expected[key], key


@pytest.mark.slow
def test_a_corrupt_image_mid_epoch_names_the_file_and_keeps_the_checkpoint(cifar_jpeg_folder,
                                                                           tmp_path):
    root = tmp_path / "data"
    shutil.copytree(cifar_jpeg_folder, root)
    files = sorted((p for p in (root / "train").rglob("*.jpg")),
                   key=lambda p: (p.parent.name, p.name))  # the folder's image order
    data_key = jax.random.split(jax.random.key(0))[1]  # prepare.setup's, for seed 0
    order = batches.epoch_permutation(np.asarray(jax.random.key_data(data_key)), 0, len(files))
    bad = files[order[12 * 8 + 3]]  # read by step 12 (batch 8), after checkpoint 10
    bad.write_bytes(bad.read_bytes()[:200])
    process = start_main(tmp_path / "run", root, "--config.checkpoint.every_steps=10",
                         "--config.data.mean=(0.5,)", "--config.data.std=(0.25,)")
    out, err = process.communicate(timeout=300)
    assert process.returncode == 1, err
    assert err.strip().splitlines() == [f"error: {bad}: cannot decode image "
                                        + err.split("cannot decode image ", 1)[1].strip()]
    assert "Traceback" not in err
    manager = checkpoint.create_manager(checkpoint.checkpoint_dir(str(tmp_path / "run")),
                                        create=False)
    try:
        assert manager.latest_step() == 10
        meta = checkpoint.read_meta(manager)
        assert meta["step"] == 10 and meta["input"]["position"] == 10
    finally:
        manager.close()
    # The checkpoint's iterator state damaged: one line, nothing deleted.
    state = tmp_path / "run" / "checkpoints" / "10" / "input" / "process_0-of-1.json"
    state.write_text(state.read_text()[:5])
    process = start_main(tmp_path / "run", root, "--config.checkpoint.every_steps=10",
                         "--config.data.mean=(0.5,)", "--config.data.std=(0.25,)")
    out, err = process.communicate(timeout=300)
    assert process.returncode == 1, err
    assert re.fullmatch(rf"error: checkpoint {tmp_path}/run/checkpoints/10: its data iterator "
                        r"state cannot be restored \(JSONDecodeError: [^\n]+\); nothing was "
                        r"deleted; no older checkpoint is on disk\n", err), err
    assert state.read_text() == '{"nex'


SHARD_SCRIPT = """
import json, sys
import jax, numpy as np
from jaxtrain.runtime import mesh, processes
from jaxtrain.training import batches
processes.initialize(sys.argv[1], 2, int(sys.argv[2]))
images = np.arange(600 * 2 * 2 * 1, dtype=np.uint32).reshape(600, 2, 2, 1).astype(np.uint8)
labels = np.arange(600, dtype=np.int32)
key = jax.random.key(7)
stream = batches.Stream(images, labels, key, batch_size=64, steps_per_epoch=9, total_steps=9,
                        sharding=mesh.batch_sharded(mesh.create_mesh()))
stream.open(0)
steps = []
for _ in range(9):
    images_, labels_, indices = stream.next()
    local = [np.asarray(s.data) for s in sorted(indices.addressable_shards,
                                                 key=lambda s: s.index[0].start)]
    local_labels = [np.asarray(s.data) for s in sorted(labels_.addressable_shards,
                                                        key=lambda s: s.index[0].start)]
    assert np.array_equal(np.concatenate(local), np.concatenate(local_labels))
    steps.append(np.concatenate(local).tolist())
stream.close()
print(json.dumps({"process": jax.process_index(), "devices": jax.local_device_count(),
                  "steps": steps}))
"""


@pytest.mark.slow
def test_two_processes_stream_disjoint_shards_that_make_up_the_epoch():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "SLURM_", "OMPI_"))}
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count=4 {quick_compile.xla_flags()}"
    env["PYTHONPATH"] = str(REPO)
    address = f"localhost:{free_port()}"
    processes = [fork_server.Popen([sys.executable, "-c", SHARD_SCRIPT, address, str(i)],
                                   cwd=REPO, env=env, text=True, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE) for i in range(2)]
    results = []
    for process in processes:
        out, err = process.communicate(timeout=300)
        assert process.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert [r["devices"] for r in results] == [4, 4]
    order = step_lib.epoch_order(jax.random.key(7), 0, 600)[0]
    for step in range(9):
        first, second = (set(r["steps"][step]) for r in results)
        assert len(first) == len(second) == 32 and not first & second
        assert first | second == set(np.asarray(order[step * 64:(step + 1) * 64]).tolist())


# ---------------------------------------------------------------- ImageNet's recipe

@pytest.mark.slow
def test_the_imagenet_recipe_runs_a_few_steps_at_64_px(imagenet_folder, tmp_path):
    """The recipe's command with ResNet-50 cut to one bottleneck a stage (the stem, the
    strided blocks and the projections all in; conftest.small_models_main)."""
    result = fork_server.run(
        small_models_main("--config=configs/imagenet_resnet50.py", f"--workdir={tmp_path}",
                          f"--config.data.dir={imagenet_folder}", "--config.data.image_size=64",
                          "--config.data.workers=2", "--config.train.batch_size=8",
                          "--config.train.num_steps=3", "--config.train.log_every_steps=1",
                          "--config.eval.batch_size=8", "--config.train.precision=float32"),
        cwd=REPO, env=quick_compile.env(0), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "data on the host, streamed" in result.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["config"]["model"]["name"] == "resnet50"
    assert summary["steps"] == 3 and summary["data_placement"] == "stream"
    assert np.isfinite(summary["test_loss"])
    assert [r["step"] for r in report.read_metrics(str(tmp_path))] == [1, 2, 3]


@pytest.mark.slow
def test_bench_input_only_times_the_loader_alone(cifar_jpeg_folder, tmp_path):
    result = fork_server.run(
        [sys.executable, "-m", "jaxtrain.bench", "--config=configs/imagenet_resnet50.py",
         "--input-only", "--batches=5", f"--json={tmp_path / 'batches.json'}",
         f"--config.data.dir={cifar_jpeg_folder}", "--config.data.image_size=48",
         "--config.data.workers=2", "--config.train.batch_size=16"],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "input only:" in result.stdout and "2 worker processes" in result.stdout
    measured = json.loads((tmp_path / "batches.json").read_text())
    assert measured["batches"] == 5 and measured["batch_size"] == 16
    assert measured["image_shape"] == [48, 48, 3] and measured["augment_crop"] == "random_resized"
    assert measured["images_per_second"] > 0 and measured["first_batch_seconds"] > 0
