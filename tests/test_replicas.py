"""Many runs in one program (train.replicas, sweep): each replica is its single run, the
reports and checkpoints hold every replica, resume is exact, bad sweeps are refused."""
import json
import subprocess
import sys
import time
from pathlib import Path

import jax
import ml_collections
import numpy as np
import pytest
import quick_compile
import fork_server
from overrides import with_overrides
from tolerances import ELEMENTWISE, NETWORK_PASS

import jaxtrain
from configs import cifar_seed_cnn
from jaxtrain import ConfigError
from jaxtrain.config import checks
from jaxtrain.config.defaults import get_config, param_group
from jaxtrain.run import loop
from jaxtrain.runtime import report
from jaxtrain.training import replicas

# No compile_quickly (conftest.py): these tests hold a vmapped program and a single run's
# to NETWORK_PASS of each other, and XLA at -O0 rounds the two apart on a Xeon with AVX-512 (the
# seed CNN's replica 3 by 7e-5 of its test loss after 24 steps; within 2e-7 at the
# session's -O1).

REPO = Path(__file__).resolve().parents[1]


def small_config(data_dir, **overrides):
    """A float32 BatchNorm seed CNN (or MLP) on the 2,000-image subset, 24 steps of 50
    with flips and translations: every replica differs in init, order and augmentation."""
    config = cifar_seed_cnn.get_config()
    config.data.dir = str(data_dir)
    config.data.source = "files"
    config.model.batch_norm = True
    config.model.hidden_sizes = (64, 32)
    config.train.precision = "float32"
    config.augment.flip = True
    config.augment.translate = 2
    config.optimizer.learning_rate = 0.02
    config.train.batch_size = 50
    config.train.num_steps = 24
    config.checkpoint.every_steps = 12
    config.eval.batch_size = 250
    return with_overrides(config, overrides)


def test_replicas_cross_seeds_with_every_sweep_point():
    config = get_config()
    config.seed, config.train.replicas = 5, 2
    config.sweep.optimizer.learning_rate = (0.05, 0.1, 0.2)
    config.sweep.train.label_smoothing = (0.0, 0.1)
    runs = replicas.runs(config)
    assert len(runs) == 12
    assert [run.seed for run in runs] == [5, 6] * 6
    assert runs[3].settings == {"optimizer.learning_rate": 0.05, "train.label_smoothing": 0.1}
    assert runs[11].settings == {"optimizer.learning_rate": 0.2, "train.label_smoothing": 0.1}
    single = replicas.run_config(config, runs[3])
    assert (single.seed, single.optimizer.learning_rate, single.train.label_smoothing,
            single.train.replicas) == (6, 0.05, 0.1, 1)
    assert replicas.runs(single) is None and replicas.runs(get_config()) is None
    values = replicas.hyperparams(runs)
    np.testing.assert_allclose(values["learning_rate"], [0.05] * 4 + [0.1] * 4 + [0.2] * 4)


OPTIMIZERS = {  # name -> overrides: each optimiser at a rate it trains this MLP with
    "adam": dict(optimizer__name="adam", optimizer__learning_rate=1e-3),
    "adamw": dict(optimizer__name="adamw", optimizer__learning_rate=3e-3,
                  optimizer__weight_decay=0.05),
    "sgd": dict(optimizer__name="sgd", optimizer__learning_rate=0.1, optimizer__nesterov=True),
    "muon": dict(optimizer__name="sgd", optimizer__learning_rate=0.05, optimizer__groups=dict(
        kernels=param_group(r"Dense_\d+/kernel", name="muon", momentum=0.95, lr_scale=0.4))),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_replica_is_its_single_run_with_every_optimizer(name, cifar_batches_dir, tmp_path):
    """Replica 1 of two (seed 1) against the single run with seed 1, 40 steps of an MLP
    without BatchNorm: the same test loss within ELEMENTWISE and parameters within
    NETWORK_PASS.
    (They are two programs, one vmapped, whose sums round apart by ~1e-7, as those of 1
    and 2 devices do. Adam normalises each gradient, so where a gradient is zero but for
    rounding (a weight on an input that is constant over the batch, before BatchNorm) it
    grows that rounding into whole steps: the BatchNorm MLP of configs/fashion_mnist_mlp.py
    parts by ~1e-3 of its test loss in 40 steps between replica and single run, and by
    3e-4 between 1 and 2 devices. docs/training.md says so.)"""
    overrides = dict(model__name="mlp", model__batch_norm=False, augment__translate=0,
                     train__num_steps=40, checkpoint__every_steps=0, **OPTIMIZERS[name])
    both = loop.train_and_evaluate(small_config(cifar_batches_dir, train__replicas=2,
                                                **overrides), str(tmp_path / "both"))
    single = loop.train_and_evaluate(small_config(cifar_batches_dir, seed=1, **overrides),
                                     str(tmp_path / "single"))
    replica = both["replicas"][1]
    assert replica["seed"] == 1
    assert replica["test_loss"] == pytest.approx(single["test_loss"], rel=ELEMENTWISE, abs=0)
    params = jax.device_get(jaxtrain.restore(str(tmp_path / "both"), replica=1).state.params)
    alone = jax.device_get(jaxtrain.restore(str(tmp_path / "single")).state.params)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(alone)):
        np.testing.assert_allclose(a, b, rtol=0, atol=NETWORK_PASS)


def test_a_sweep_of_a_shape_changing_key_is_refused_naming_it():
    config = get_config()
    config.sweep.model = ml_collections.ConfigDict({"widths": ((32, 64, 64), (64, 128, 128))})
    with pytest.raises(ConfigError, match=r"sweep\.model\.widths: model\.widths changes the "
                                          r"model's shapes or the compiled program"):
        checks.check_config(config)
    config = get_config()
    config.sweep.optimizer.learning_rate = (0.1, -0.1)
    with pytest.raises(ConfigError, match=r"sweep\.optimizer\.learning_rate=\(0\.1, -0\.1\): "
                                          r"must be \(\) or a tuple of values each > 0"):
        checks.check_config(config)


@pytest.mark.slow
def test_main_refuses_a_sweep_of_a_shape_changing_key_in_one_line(tmp_path):
    result = fork_server.run(
        [sys.executable, "main.py", "--config=configs/cifar_seed_cnn.py",
         f"--workdir={tmp_path}", "--config.sweep.train.batch_size=(32,64)"],
        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: config.sweep.train.batch_size: train.batch_size changes the model's shapes or "
        "the compiled program, so its values cannot share one program; sweepable: "
        + ", ".join(replicas.SWEEPABLE) + " (run one config per value instead)"]
    assert not list(tmp_path.iterdir())


def test_replicas_need_the_data_on_the_devices(cifar_batches_dir, tmp_path):
    config = small_config(cifar_batches_dir, train__replicas=2, data__placement="stream")
    with pytest.raises(ConfigError, match="needs the training data on the devices"):
        loop.train_and_evaluate(config, str(tmp_path))


def params_of(workdir, replica=None):
    classifier = jaxtrain.restore(str(workdir), replica=replica)
    return jax.device_get((classifier.state.params, classifier.state.batch_stats))


def assert_same_run(replicated_summary, replica, single_summary, replicated_dir, single_dir):
    """Replica `replica` of a replicated run ended where its single run did (NETWORK_PASS)."""
    result = replicated_summary["replicas"][replica]
    np.testing.assert_allclose(result["test_loss"], single_summary["test_loss"],
                               rtol=NETWORK_PASS)
    np.testing.assert_allclose(result["train_loss"], single_summary["train_loss"],
                               rtol=NETWORK_PASS)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=NETWORK_PASS,
                                                         atol=NETWORK_PASS),
                 params_of(replicated_dir, replica), params_of(single_dir))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["seed_cnn", "mlp"])
def test_replica_k_is_the_single_run_with_its_seed_and_settings(name, cifar_batches_dir,
                                                                 tmp_path):
    """Two seeds x two label smoothings through main's path (setup, keys, injected
    hyperparameters, vmapped chunks and evaluation): replica 3 (seed 1, smoothing 0.1)
    is the single run of seed 1 with smoothing 0.1, float32, 24 steps.

    The seed CNN trains at a small rate: at 0.01-0.02 this LeNet multiplies any
    rounding difference about threefold a step from step ~10 on (measured: a single
    run compiled as one scan and as a call per step part by 1e-3 after 32 steps), so
    no two differently compiled programs agree to NETWORK_PASS there; at 0.0005 they do."""
    rate = 0.0005 if name == "seed_cnn" else 0.02
    replicated = small_config(cifar_batches_dir, model__name=name, train__replicas=2,
                              optimizer__learning_rate=rate)
    replicated.sweep.train.label_smoothing = (0.0, 0.1)
    summary = loop.train_and_evaluate(replicated, str(tmp_path / "replicated"))
    single = small_config(cifar_batches_dir, model__name=name, seed=1,
                          train__label_smoothing=0.1, optimizer__learning_rate=rate)
    single_summary = loop.train_and_evaluate(single, str(tmp_path / "single"))
    assert [(r["seed"], r["settings"]["train.label_smoothing"]) for r in summary["replicas"]] \
        == [(0, 0.0), (1, 0.0), (0, 0.1), (1, 0.1)]
    assert_same_run(summary, 3, single_summary, tmp_path / "replicated", tmp_path / "single")
    losses = [r["test_loss"] for r in summary["replicas"]]
    assert len(set(losses)) == 4  # four runs of their own
    assert summary["test_loss"] == pytest.approx(np.mean(losses))
    assert summary["test_accuracy_std"] == pytest.approx(
        np.std([r["test_accuracy"] for r in summary["replicas"]]))
    best = max(range(4), key=lambda r: summary["replicas"][r]["test_accuracy"])
    assert summary["best"]["replica"] == best
    assert jaxtrain.restore(str(tmp_path / "replicated")).replica == best

    rows = report.read_metrics(str(tmp_path / "replicated"))
    assert [(r["step"], r["replica"]) for r in rows[:4]] == [(rows[0]["step"], k) for k in range(4)]
    assert {r["train.label_smoothing"] for r in rows} == {0.0, 0.1}
    assert sorted({r["seed"] for r in rows}) == [0, 1]
    final = [r for r in rows if r["step"] == 24]
    assert [r["test_loss"] for r in final] == pytest.approx(losses)
    assert (tmp_path / "replicated" / report.PLOT_FILE).stat().st_size > 10_000
    with pytest.raises(ValueError, match=r"replicas 0 \.\. 3"):
        jaxtrain.restore(str(tmp_path / "replicated"), replica=4)
    with pytest.raises(ValueError, match="single run"):
        jaxtrain.restore(str(tmp_path / "single"), replica=0)


@pytest.mark.slow
def test_a_learning_rate_sweep_is_three_runs_each_its_own_single_run(cifar_batches_dir,
                                                                      tmp_path, capsys):
    rates = (0.01, 0.03, 0.1)
    config = small_config(cifar_batches_dir, model__name="mlp", seed=3)
    config.sweep.optimizer.learning_rate = rates
    summary = loop.train_and_evaluate(config, str(tmp_path / "sweep"))
    out = capsys.readouterr().out
    assert "optimizer.learning_rate=0.03: test_accuracy=" in out
    assert "3 replicas: test_accuracy=" in out
    rows = report.read_metrics(str(tmp_path / "sweep"))
    curves = {rate: [r["train_loss"] for r in rows if r["optimizer.learning_rate"] == rate]
              for rate in rates}
    assert len({tuple(c) for c in curves.values()}) == 3  # three trajectories
    assert [p["settings"]["optimizer.learning_rate"] for p in summary["sweep_points"]] \
        == list(rates)
    # curves.png: a labelled line per replica, named by its seed and swept rate
    legend = report.curves_figure(rows).axes[0].get_legend()
    assert [text.get_text() for text in legend.get_texts()] == [
        f"seed 3, learning_rate={rate:g}" for rate in rates]
    assert (tmp_path / "sweep" / report.PLOT_FILE).is_file()
    for replica, rate in enumerate(rates):
        single = small_config(cifar_batches_dir, model__name="mlp", seed=3,
                              optimizer__learning_rate=rate)
        single_summary = loop.train_and_evaluate(single, str(tmp_path / f"single{replica}"))
        assert_same_run(summary, replica, single_summary, tmp_path / "sweep",
                        tmp_path / f"single{replica}")
        single_rows = report.read_metrics(str(tmp_path / f"single{replica}"))
        np.testing.assert_allclose(curves[rate], [r["train_loss"] for r in single_rows],
                                   rtol=NETWORK_PASS)
        assert [r["learning_rate"] for r in rows if r["replica"] == replica] == pytest.approx(
            [r["learning_rate"] for r in single_rows])


# ---------------------------------------------------------------- SIGKILL, then resume

LONG_RUN = ["--config=configs/cifar_seed_cnn.py", "--config.data.source=files",
            "--config.model.batch_norm=True", "--config.augment.flip=True",
            "--config.train.batch_size=4", "--config.train.num_steps=600",
            "--config.train.replicas=2", "--config.sweep.optimizer.learning_rate=(0.01,0.02)",
            "--config.train.log_every_steps=50", "--config.checkpoint.every_steps=100",
            "--config.eval.every_epochs=0"]


def start_main(workdir, data_dir):
    """main.py with LONG_RUN's flags in a child process, XLA's LLVM backend at -O1 (its 600
    steps run as fast as at -O2; quick_compile.py)."""
    return fork_server.Popen([sys.executable, "main.py", f"--workdir={workdir}", *LONG_RUN,
                             f"--config.data.dir={data_dir}"], cwd=REPO, env=quick_compile.env(1),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_sigkill_then_rerun_of_a_replicated_run_is_bit_identical(cifar_batches_dir, tmp_path):
    """Two seeds x two learning rates, killed past two checkpoints and run again: the
    same four runs, to the bit, as an uninterrupted run (the two run side by side)."""
    killed = start_main(tmp_path / "killed", cifar_batches_dir)
    metrics = tmp_path / "killed" / report.METRICS_FILE
    deadline = time.time() + 300
    while not (metrics.exists()
               and any(r["step"] >= 250 for r in report.read_metrics(str(metrics.parent)))):
        assert killed.poll() is None and time.time() < deadline, killed.communicate()
        time.sleep(0.05)
    killed.kill()
    killed.wait()
    assert not (tmp_path / "killed" / report.SUMMARY_FILE).exists()
    rerun = start_main(tmp_path / "killed", cifar_batches_dir)
    reference = start_main(tmp_path / "reference", cifar_batches_dir)
    for process in (rerun, reference):
        out, err = process.communicate(timeout=600)
        assert process.returncode == 0, err
    expected = json.loads((tmp_path / "reference" / report.SUMMARY_FILE).read_text())
    summary = json.loads((tmp_path / "killed" / report.SUMMARY_FILE).read_text())
    assert 200 <= summary["resumed_from_step"] < 600
    assert summary["params_sha256"] == expected["params_sha256"]
    assert summary["replicas"] == expected["replicas"]
    rows = report.read_metrics(str(tmp_path / "killed"))
    assert [(r["step"], r["replica"]) for r in rows] == [
        (step, k) for step in range(50, 601, 50) for k in range(4)]
    timing = ("seconds", "input_wait_fraction")
    assert ([{k: v for k, v in r.items() if k not in timing} for r in rows]
            == [{k: v for k, v in r.items() if k not in timing}
                for r in report.read_metrics(str(tmp_path / "reference"))])
