"""Bigger models and batches: train.accumulate_steps, model.remat, parallel.fsdp and
bench --memory, on real CIFAR-10 images (several CPU devices in subprocesses)."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import quick_compile
import test_parallel
from conftest import init_compiled
from tolerances import ELEMENTWISE, NETWORK_PASS, TRAINING_STEPS
import fork_server
from overrides import with_overrides
from test_parallel import finish, free_port

import jaxtrain
from jaxtrain import ConfigError, models
from jaxtrain.config import checks
from jaxtrain.config.defaults import get_config
from jaxtrain.run import loop
from jaxtrain.runtime import mesh as mesh_lib
from jaxtrain.runtime import report
from jaxtrain.training import placement

pytestmark = pytest.mark.usefixtures("compile_quickly")  # conftest.py

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def arrays32(tmp_path_factory, cifar_subset):
    """Real CIFAR-10 as a data.name='arrays' file: 256 training, 16 test images, 32 px."""
    path = tmp_path_factory.mktemp("arrays32") / "cifar32.npz"
    np.savez(path, x_train=cifar_subset["x_train"][:256], y_train=cifar_subset["y_train"][:256],
             x_test=cifar_subset["x_test"][:16], y_test=cifar_subset["y_test"][:16],
             class_names=np.array(cifar_subset["class_names"]))
    return path


def small_config(npz, **overrides):
    config = get_config()
    config.data.name, config.data.dir = "arrays", str(npz)
    config.train.precision = "float32"
    config.train.batch_size = 32
    config.train.num_steps = 10
    config.train.log_every_steps = 1
    config.eval.every_epochs = 0
    config.checkpoint.every_epochs = 0
    config.optimizer.learning_rate = 0.05
    return with_overrides(config, overrides)


def final_params(workdir):
    return jax.device_get(jaxtrain.restore(workdir).state.params)


def max_difference(a, b) -> float:
    return max(float(np.max(np.abs(x - y))) for x, y in zip(jax.tree.leaves(a),
                                                             jax.tree.leaves(b)))


# ---------------------------------------------------------------- accumulation

@pytest.mark.slow
def test_accumulating_four_micro_batches_is_the_whole_batch_without_batchnorm(arrays32,
                                                                             tmp_path):
    """An MLP without BatchNorm: 10 steps of batch 32 as 4 x 8 give the parameters of
    10 plain steps of 32 (the mean of the micro-batches' mean gradients is the batch's)."""
    mlp = dict(model__name="mlp", model__batch_norm=False, model__hidden_sizes=(64, 32))
    for k in (1, 4):
        loop.train_and_evaluate(small_config(arrays32, train__accumulate_steps=k, **mlp),
                                str(tmp_path / f"k{k}"))
    whole, accumulated = final_params(tmp_path / "k1"), final_params(tmp_path / "k4")
    assert max_difference(whole, accumulated) < NETWORK_PASS
    rows = {k: [json.loads(line)["train_loss"] for line in
                open(tmp_path / f"k{k}" / report.METRICS_FILE) if "train_loss" in line]
            for k in (1, 4)}
    np.testing.assert_allclose(rows[4], rows[1], rtol=NETWORK_PASS)
    summary = json.loads((tmp_path / "k4" / report.SUMMARY_FILE).read_text())
    assert summary["steps"] == 10  # optimiser steps, not micro-batches


@pytest.mark.slow
def test_accumulation_with_batchnorm_trains_and_resumes_exactly(arrays32, tmp_path):
    """seed_cnn with BatchNorm, K=4: BatchNorm sees micro-batches of 8, so the run is not
    the K=1 run; killed (here: stopped at step 5) and resumed, it is bit for bit the
    uninterrupted one."""
    bn = dict(model__name="seed_cnn", model__batch_norm=True, train__accumulate_steps=4,
              checkpoint__every_steps=5)
    loop.train_and_evaluate(small_config(arrays32, **bn), str(tmp_path / "whole"))
    loop.train_and_evaluate(small_config(arrays32, train__num_steps=5, **bn),
                            str(tmp_path / "resumed"))
    loop.train_and_evaluate(small_config(arrays32, **bn), str(tmp_path / "resumed"))
    whole = json.loads((tmp_path / "whole" / report.SUMMARY_FILE).read_text())
    resumed = json.loads((tmp_path / "resumed" / report.SUMMARY_FILE).read_text())
    assert resumed["resumed_from_step"] == 5
    assert resumed["params_sha256"] == whole["params_sha256"]
    assert np.isfinite(whole["test_loss"]) and whole["train_loss"] < 2.3

    loop.train_and_evaluate(small_config(arrays32, **dict(bn, train__accumulate_steps=1)),
                            str(tmp_path / "k1"))
    assert max_difference(final_params(tmp_path / "whole"), final_params(tmp_path / "k1")) > 1e-4


def test_micro_batches_take_an_equal_share_of_every_devices_rows():
    from jaxtrain.training import step as step_lib
    rows = np.arange(16)  # 4 devices x 4 rows each: device d holds rows 4d .. 4d + 3
    micro = np.asarray(step_lib.micro_batches(jnp.asarray(rows), 2))
    assert micro.shape == (2, 8)
    for batch in micro:
        assert sorted(np.bincount(batch // 4, minlength=4)) == [2, 2, 2, 2]
    assert sorted(micro.ravel()) == list(rows)


def test_accumulate_steps_must_divide_the_batch():
    config = small_config("x.npz", train__accumulate_steps=3)
    with pytest.raises(ConfigError, match=r"config.train.accumulate_steps=3: must divide "
                                          r"train.batch_size=32"):
        checks.check_config(config)


def test_the_batch_per_device_must_split_into_micro_batches():
    mesh = mesh_lib.create_mesh(jax.devices() * 1)
    placement.check_batch_split(32, mesh, 4)
    with pytest.raises(ConfigError, match=r"accumulate_steps=64 does not divide the batch per "
                                          r"device \(32 / 1 devices = 32 images\): use one of "
                                          r"1, 2, 4, 8, 16, 32, or a batch_size that is a "
                                          r"multiple of 64 \(e\.g\. 64\)$"):
        placement.check_batch_split(32, mesh, 64)


# ---------------------------------------------------------------- remat

def loss_and_grads(model, variables, images, labels):
    def loss_fn(params):
        logits, _ = model.apply({**variables, "params": params}, images, train=True,
                                mutable=["batch_stats"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    return jax.value_and_grad(loss_fn)(variables["params"])


@pytest.mark.slow
@pytest.mark.parametrize("name, size", [("cifar_cnn", 32), ("resnet18", 32), ("vit_tiny", 32)])
def test_remat_gives_the_same_loss_and_gradients(name, size, cifar_subset):
    config = get_config()
    config.model.name = name
    images = jnp.asarray(cifar_subset["x_train"][:4, :size, :size], jnp.float32) / 255 - 0.5
    labels = jnp.asarray(cifar_subset["y_train"][:4])
    results = {}
    for remat in (False, True):
        config.model.remat = remat
        model = models.create_model(config.model, 10, jnp.float32)
        # the same remat with less to compile (two inits, two gradients): two of ViT-T's
        # twelve blocks; two stages of one basic block each instead of ResNet-18's four of
        # two (a block with an identity shortcut, then one with a strided projection)
        if name == "vit_tiny":
            model = model.clone(depth=2)
        elif name == "resnet18":
            model = model.clone(stage_sizes=(1, 1))
        variables = init_compiled(model, images[:1])
        results[remat] = (variables, jax.jit(loss_and_grads, static_argnums=0)(
            model, variables, images, labels))
        jaxpr = str(jax.make_jaxpr(lambda v: loss_and_grads(model, v, images, labels))(variables))
        assert ("remat" in jaxpr or "checkpoint" in jaxpr) == remat
    (plain_vars, (plain_loss, plain_grads)), (remat_vars, (remat_loss, remat_grads)) = (
        results[False], results[True])
    # the same parameter names and shapes: checkpoints and weights load either way
    assert jax.tree.structure(plain_vars) == jax.tree.structure(remat_vars)
    assert max_difference(plain_vars, remat_vars) == 0.0
    assert abs(float(plain_loss) - float(remat_loss)) < ELEMENTWISE
    assert max_difference(plain_grads, remat_grads) < ELEMENTWISE


def test_remat_is_refused_for_a_model_without_blocks():
    config = small_config("x.npz", model__name="mlp", model__remat=True)
    with pytest.raises(ConfigError, match="config.model.remat=True: applies to cifar_cnn"):
        checks.check_config(config)


# ---------------------------------------------------------------- fsdp layout

def test_fsdp_splits_big_tensors_along_a_dimension_that_divides():
    assert mesh_lib.fsdp_spec((3, 3, 64, 128), 8) == jax.sharding.PartitionSpec(
        None, None, None, "fsdp")
    assert mesh_lib.fsdp_spec((768, 3072), 4) == jax.sharding.PartitionSpec(None, "fsdp")
    assert mesh_lib.fsdp_spec((3072, 768), 4) == jax.sharding.PartitionSpec("fsdp", None)
    assert mesh_lib.fsdp_spec((10, 1001), 8) == jax.sharding.PartitionSpec()  # none divides
    assert mesh_lib.fsdp_spec((256,), 8) == jax.sharding.PartitionSpec()  # small: replicated
    assert mesh_lib.fsdp_spec((4096, 7), 1) == jax.sharding.PartitionSpec()


# ---------------------------------------------------------------- several devices

def devices_env(count: int, backend_level: int = quick_compile.LEVEL) -> dict:
    """`count` CPU devices, XLA's LLVM backend at -O`backend_level` (quick_compile.py)."""
    env = test_parallel.devices_env(count, backend_level)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "tests")])
    return env


def probe(spec: dict, devices: int, tmp_path, backend_level: int = quick_compile.LEVEL) -> dict:
    spec_file, out_file = tmp_path / f"spec{devices}.json", tmp_path / f"out{devices}.json"
    spec_file.write_text(json.dumps(spec))
    done = fork_server.run([sys.executable, str(REPO / "tests" / "scale_probe.py"), str(spec_file),
                           str(out_file)], env=devices_env(devices, backend_level),
                           capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(out_file.read_text())


# The CIFAR recipe's conv net (cifar_cnn, 2.4M parameters) at 32 px, SGD with momentum:
# BatchNorm, 4-D kernels, a step per call (ResNet-18, which it replaces, took twice the time)
CNN = dict(model="cifar_cnn", steps=5, batch_size=16)
# ViT-T's width and heads (192, 3) with 2 of its 12 blocks, AdamW; jaxtrain's own ViT class named
# as a model of your own, since no config key sets the depth of vit_tiny; it scans its chunks as
# vit_tiny does. 32 px: 4 patches and the class token.
VIT_KWARGS = dict(dim=192, depth=2, heads=3)
VIT = dict(model="jaxtrain.models.vit:ViT", kwargs=VIT_KWARGS, loop="scan", steps=5,
           batch_size=8, optimizer="adamw", learning_rate=1e-3)


def layout_runs(root, name, spec, npz, layouts) -> list:
    """One run of `spec` per fsdp size in `layouts`, each in a workdir of its own under
    root; the fsdp=4 run saves a checkpoint at step 3 too."""
    runs = []
    for fsdp in layouts:
        workdir = root / f"{name}_fsdp{fsdp}"
        workdir.mkdir()
        runs.append(dict(spec, name=f"{name}_fsdp{fsdp}", workdir=str(workdir), npz=str(npz),
                         fsdp=fsdp, checkpoint_every=3 if fsdp == 4 else 0))
    return runs


def check_fsdp_trains_as_the_replicated_run(out, name, fsdp):
    assert out["devices"] == 8
    replicated = out["runs"][f"{name}_fsdp1"]
    assert replicated["fsdp"] == 1 and len(replicated["losses"]) == 5
    run = out["runs"][f"{name}_fsdp{fsdp}"]
    assert run["fsdp"] == fsdp
    np.testing.assert_allclose([run["losses"][s] for s in sorted(run["losses"])],
                               [replicated["losses"][s] for s in sorted(run["losses"])],
                               rtol=0, atol=TRAINING_STEPS)


def check_devices_hold_a_share_of_the_parameters_and_optimiser_state(out, name, fsdp):
    replicated = out["runs"][f"{name}_fsdp1"]
    total = replicated["params_and_opt_bytes"]
    assert replicated["params_and_opt_bytes_per_device"] == [total] * 8
    held = out["runs"][f"{name}_fsdp{fsdp}"]["params_and_opt_bytes_per_device"]
    assert len(held) == 8
    # about 1/fsdp each: the small tensors (biases, norms, counters) stay replicated
    assert total / fsdp <= max(held) < 1.1 * total / fsdp, (name, fsdp, held, total)


def check_a_checkpoint_resumes_onto_another_layout(out, root, tmp_path):
    """Saved at step 3 on 8 devices with fsdp=4, resumed on 2 with fsdp=2: steps 4 and 5
    are those of the uninterrupted run."""
    saved = root / "cnn_fsdp4"
    workdir = tmp_path / "resumed"
    shutil.copytree(saved, workdir)
    shutil.rmtree(workdir / "checkpoints" / "5")
    spec = json.loads((saved / "spec.json").read_text())
    resumed = probe({"runs": [dict(spec, name="resumed", workdir=str(workdir), fsdp=2)]}, 2,
                    tmp_path)["runs"]["resumed"]
    assert resumed["resumed_from_step"] == 3 and resumed["fsdp"] == 2
    uninterrupted = out["runs"]["cnn_fsdp4"]["losses"]
    for step in ("4", "5"):
        assert abs(resumed["losses"][step] - uninterrupted[step]) < NETWORK_PASS


def check_memory_analysis_shows_what_each_knob_saves(out):
    memory = out["memory"]
    baseline = memory["baseline"]
    for info in memory.values():
        assert info["peak_bytes"] > info["temporaries_bytes"] > 0
        assert info["devices"] == 8 and info["batch_size"] == 256
    # micro-batches of 8 per device instead of 32: the activations a quarter
    assert memory["accumulate4"]["temporaries_bytes"] < 0.5 * baseline["temporaries_bytes"]
    # (remat compiles and is reported; XLA:CPU schedules the recomputation early and
    # saves nothing here, see BENCHMARKS.md: its saving is measured on the GPU)
    assert memory["remat"]["remat"] is True and baseline["remat"] is False
    assert memory["fsdp8"]["fsdp"] == 8
    assert (memory["fsdp8"]["params_bytes_per_device"]
            < 0.2 * baseline["params_bytes_per_device"])


@pytest.mark.slow
def test_bad_layouts_stop_with_one_line_and_write_nothing(tmp_path, arrays32):
    for i, (flag, message) in enumerate((
            ("--config.parallel.fsdp=3", "config.parallel.fsdp=3 does not divide the 8 "
                                         "devices: use one of 1, 2, 4, 8"),
            ("--config.train.accumulate_steps=8", "config.train.accumulate_steps=8 does not "
                                                  "divide the batch per device (32 / 8 devices "
                                                  "= 4 images)"))):
        workdir = tmp_path / f"w{i}"
        done = fork_server.run(
            [sys.executable, "main.py", "--config=configs/default.py", f"--workdir={workdir}",
             "--config.data.name=arrays", f"--config.data.dir={arrays32}",
             "--config.train.batch_size=32", flag], cwd=REPO, env=devices_env(8),
            capture_output=True, text=True, timeout=300)
        assert done.returncode == 2, done.stderr[-2000:]
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and message in lines[0], done.stderr
        assert not workdir.exists() or not any(workdir.iterdir())


def check_two_processes_of_four_devices_train_with_fsdp(out, tmp_path, arrays32):
    """The ViT with fsdp=8 over 2 processes x 4 devices (main.py): every parameter split
    across both processes; the losses are the one-process run's."""
    address = f"localhost:{free_port()}"
    args = ["main.py", "--config=configs/default.py", f"--workdir={tmp_path}",
            "--config.data.name=arrays", f"--config.data.dir={arrays32}",
            f"--config.model.name={VIT['model']}",
            *[f"--config.model.kwargs.{k}={v}" for k, v in VIT_KWARGS.items()],
            f"--config.train.loop={VIT['loop']}", "--config.optimizer.name=adamw",
            "--config.optimizer.learning_rate=1e-3", "--config.train.precision=float32",
            "--config.train.batch_size=8", "--config.train.num_steps=5",
            "--config.train.log_every_steps=1", "--config.train.compilation_cache=",
            "--config.eval.batch_size=16", "--config.eval.every_epochs=0",
            "--config.checkpoint.every_epochs=0", "--config.parallel.fsdp=8",
            f"--coordinator_address={address}", "--num_processes=2"]
    processes = [fork_server.Popen([sys.executable, *args, f"--process_id={i}"], cwd=REPO,
                                   env=devices_env(4), text=True, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE) for i in range(2)]
    results = [finish(p) for p in processes]
    for i, result in enumerate(results):
        assert result.returncode == 0, f"process {i}:\n{result.stderr[-3000:]}"
    summary = json.loads((tmp_path / report.SUMMARY_FILE).read_text())
    assert (summary["device_count"], summary["process_count"], summary["fsdp"]) == (8, 2, 8)
    rows = [json.loads(line) for line in open(tmp_path / report.METRICS_FILE)]
    losses = {str(row["step"]): row["train_loss"] for row in rows if "train_loss" in row}
    single = out["runs"]["vit_fsdp8"]["losses"]
    assert sorted(losses) == sorted(single)
    for step in single:
        assert abs(losses[step] - single[step]) < NETWORK_PASS


def test_the_largest_batch_search_brackets_the_limit(monkeypatch):
    """memory.largest_batch on a step whose peak is 100 MB + 1 MB an image, limit 612 MB:
    512 fits, 520 does not, found in a few compiles (here: faked analyses)."""
    from jaxtrain.perf import memory
    seen = []

    def fake_step_memory(config):
        seen.append(config.train.batch_size)
        return {"peak_bytes": 100_000_000 + config.train.batch_size * 1_000_000}
    monkeypatch.setattr(memory, "step_memory", fake_step_memory)
    found = memory.largest_batch(get_config(), 612_000_000, multiple=8, start=128, max_probes=6)
    assert (found["largest_batch"], found["smallest_failing_batch"], found["exact"]) == (
        512, 520, True)
    assert len(seen) <= 5 and seen[0] == 128
    assert [p["fits"] for p in found["probes"]] == [p["batch_size"] <= 512 for p in found["probes"]]
    nothing = memory.largest_batch(get_config(), 50_000_000, multiple=8, start=64)
    assert nothing["largest_batch"] is None and nothing["smallest_failing_batch"] == 8


# The 8-device runs: two tests, each a chain of subprocesses of its own, so that
# pytest-xdist runs them side by side (a module fixture would be made once per worker).

@pytest.mark.slow
def test_fsdp_4_x_data_2_and_the_memory_analysis_on_eight_devices(tmp_path, arrays32):
    """cifar_cnn on 8 CPU devices, replicated and with fsdp 4 x data 2, and bench --memory's
    analyses (memory.step_memory) of its step at batch 256 (32 a device), plain and with
    each knob, compiled for shapes only (one subprocess): the same losses, each device a
    quarter of the bytes; the fsdp run's checkpoint at step 3 resumes on 2 devices with
    fsdp=2."""
    root = tmp_path / "runs"
    root.mkdir()
    base = dict(model="cifar_cnn", npz=str(arrays32), batch_size=256)
    memory = [dict(base, name="baseline"), dict(base, name="accumulate4", accumulate_steps=4),
              dict(base, name="remat", remat=True), dict(base, name="fsdp8", fsdp=8)]
    out = probe({"runs": layout_runs(root, "cnn", CNN, arrays32, (1, 4)), "memory": memory}, 8,
                tmp_path)
    check_fsdp_trains_as_the_replicated_run(out, "cnn", 4)
    check_devices_hold_a_share_of_the_parameters_and_optimiser_state(out, "cnn", 4)
    check_memory_analysis_shows_what_each_knob_saves(out)
    (tmp_path / "resume").mkdir()
    check_a_checkpoint_resumes_onto_another_layout(out, root, tmp_path / "resume")


@pytest.mark.slow
def test_fsdp_8_trains_as_replicated_in_one_process_and_in_two(tmp_path, arrays32):
    """The ViT on 8 CPU devices, replicated and with fsdp=8 (one subprocess): the same
    losses, each device an eighth of the bytes; then fsdp=8 over two processes."""
    root = tmp_path / "runs"
    root.mkdir()
    out = probe({"runs": layout_runs(root, "vit", VIT, arrays32, (1, 8))}, 8, tmp_path)
    check_fsdp_trains_as_the_replicated_run(out, "vit", 8)
    check_devices_hold_a_share_of_the_parameters_and_optimiser_state(out, "vit", 8)
    (tmp_path / "two").mkdir()
    check_two_processes_of_four_devices_train_with_fsdp(out, tmp_path / "two", arrays32)
