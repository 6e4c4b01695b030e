"""The parts of a run a user brings (jaxtrain/training/parts.py): an optimiser, a loss and an
augmentation, from Python (train_and_evaluate's arguments) and by name in the config
(optimizer.name, optimizer.kwargs, optimizer.clip_norm, train.loss, augment.fn), with the
rest of a run (parameter groups, accumulation, EMA, skipped steps, sweeps, resume, FSDP,
the logged learning rate) working with them. Runs: the CIFAR-10 subset through a small
MLP, a few dozen steps, in this process; the config keys and their resume in main.py."""
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import quick_compile
from overrides import with_overrides

import jaxtrain
from configs import fashion_mnist_mlp
from jaxtrain import ConfigError
from jaxtrain.config import defaults
from jaxtrain.runtime import report
from jaxtrain.training import losses, optim

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.usefixtures("compile_quickly")


def small_config(data_dir, **overrides):
    """configs/fashion_mnist_mlp.py (Adam, a linear decay, BatchNorm) on the CIFAR-10
    subset, one hidden layer of 32: 40 steps of 50 images."""
    config = fashion_mnist_mlp.get_config()
    return with_overrides(config, {
        "data__name": "cifar10", "data__dir": str(data_dir), "data__source": "files",
        "model__hidden_sizes": (32,), "train__batch_size": 50, "train__num_steps": 40,
        "eval__batch_size": 250, "checkpoint__every_steps": 0, **overrides})


def train(config, workdir, **parts):
    return jaxtrain.train_and_evaluate(config, str(workdir), **parts)


def learning_rates(workdir):
    return [row.get("learning_rate") for row in report.read_metrics(str(workdir))
            if report.is_train_row(row)]


def saved_config(workdir):
    return json.loads((Path(workdir) / "config.json").read_text())


def xent(logits, targets):
    return optax.softmax_cross_entropy(logits, targets)


def test_the_built_in_optimiser_and_loss_passed_from_python_train_the_same_run(
        cifar_batches_dir, tmp_path):
    """optimizer=lambda learning_rate: optax.adam(learning_rate) receives the config's
    schedule (linear decay: the rows log the rate it used), and loss= the per-example
    cross-entropy: the built-in run's test loss, and the run records both as passed."""
    built_in = train(small_config(cifar_batches_dir), tmp_path / "built_in")
    passed = train(small_config(cifar_batches_dir), tmp_path / "passed",
                   optimizer=lambda learning_rate: optax.adam(learning_rate), loss=xent)
    assert passed["test_loss"] == pytest.approx(built_in["test_loss"], abs=1e-6)
    rates = learning_rates(tmp_path / "passed")
    assert rates == learning_rates(tmp_path / "built_in") and rates[0] > rates[-1] > 0
    config = saved_config(tmp_path / "passed")
    assert config["optimizer"]["name"] == ("python:test_parts:test_the_built_in_optimiser_and_"
                                           "loss_passed_from_python_train_the_same_run."
                                           "<locals>.<lambda>")
    assert config["train"]["loss"] == "python:test_parts:xent"


def test_a_python_optimiser_keeps_groups_frozen_layers_accumulation_ema_and_skipping(
        cifar_batches_dir, tmp_path):
    """A function of the learning rate is called with each parameter group's schedule (the
    head's at a quarter of the rate), a frozen group keeps its weights, and accumulation,
    the EMA and train.nonfinite='skip' run as with the built-in: the same optimiser
    written by hand trains the built-in run bit for bit."""
    overrides = {"optimizer__name": "sgd", "optimizer__momentum": 0.0,
                 "optimizer__learning_rate": 0.05, "train__accumulate_steps": 2,
                 "train__ema_decay": 0.9, "train__nonfinite": "skip",
                 "optimizer__groups__head": defaults.param_group("Dense_1/.*", lr_scale=0.25),
                 "optimizer__groups__first": defaults.param_group("Dense_0/bias", freeze=True)}
    built_in = train(small_config(cifar_batches_dir, **overrides), tmp_path / "built_in")
    passed = train(small_config(cifar_batches_dir, **overrides), tmp_path / "passed",
                   optimizer=lambda learning_rate: optax.chain(
                       optax.add_decayed_weights(0.0), optax.sgd(learning_rate)))
    assert passed["params_sha256"] == built_in["params_sha256"]
    assert passed["test_accuracy_ema"] == built_in["test_accuracy_ema"]
    restored = jaxtrain.restore(str(tmp_path / "passed"))
    np.testing.assert_array_equal(restored.state.params["Dense_0"]["bias"], 0.0)


def test_a_transformation_brings_its_own_rate_and_resumes_exactly_when_passed_again(
        cifar_batches_dir, tmp_path):
    """An optax.GradientTransformation is used as it is: no learning_rate is logged (the
    config's schedule is not what it uses). Trained 20 steps and resumed to 40 with the
    same transformation and loss passed again, it ends where 40 steps in one go end;
    resumed without them, or with another optimiser, it stops in one line."""
    def focal(logits, targets):
        return losses.Focal(1.0)(logits, targets)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))
    overrides = {"optimizer__schedule": "constant", "checkpoint__every_steps": 20}
    whole = train(small_config(cifar_batches_dir, **overrides), tmp_path / "whole",
                  optimizer=tx, loss=focal)
    assert set(learning_rates(tmp_path / "whole")) == {None}
    workdir = tmp_path / "resumed"
    train(small_config(cifar_batches_dir, train__num_steps=20, **overrides), workdir,
          optimizer=tx, loss=focal)
    with pytest.raises(ConfigError, match=r"config.train.loss: the run in .* was trained with a "
                                          r"loss passed from Python \('python:test_parts:.*"
                                          r"focal'\), this run has 'softmax_xent'; pass it "
                                          r"again \(train_and_evaluate\(..., loss=...\)\)"):
        train(small_config(cifar_batches_dir, **overrides), workdir, optimizer=tx)
    resumed = train(small_config(cifar_batches_dir, **overrides), workdir, optimizer=tx,
                    loss=focal)
    assert resumed["resumed_from_step"] == 20
    assert resumed["params_sha256"] == whole["params_sha256"]
    assert resumed["test_loss"] == whole["test_loss"]


def test_a_sweep_sweeps_the_rate_a_python_optimiser_function_receives(cifar_batches_dir,
                                                                     tmp_path):
    """sweep.optimizer.learning_rate reaches the function: each replica's rows log its own
    rate, and the replicas train apart."""
    config = small_config(cifar_batches_dir, optimizer__schedule="constant",
                          train__num_steps=20, sweep__optimizer__learning_rate=(1e-4, 1e-2))
    summary = train(config, tmp_path, optimizer=lambda learning_rate: optax.lion(learning_rate))
    rows = [row for row in report.read_metrics(str(tmp_path)) if report.is_train_row(row)]
    for replica, rate in enumerate((1e-4, 1e-2)):
        logged = [row["learning_rate"] for row in rows if row["replica"] == replica]
        assert logged and logged == pytest.approx([rate] * len(logged))
    first, second = summary["replicas"]
    assert first["test_loss"] != second["test_loss"]


def test_an_identity_augmentation_is_the_run_without_one_and_noise_is_keyed(cifar_batches_dir,
                                                                           tmp_path):
    """augment= runs inside the step on float32 images in [0, 1] after the built-ins: the
    identity leaves the run bit for bit as it is (the other keys untouched), noise from its
    key changes it, and the same noise twice is the same run."""
    def noise(images, key):
        return jnp.clip(images + 0.1 * jax.random.normal(key, images.shape), 0.0, 1.0)
    config = lambda: small_config(cifar_batches_dir, train__num_steps=20, augment__flip=True)
    plain = train(config(), tmp_path / "plain")
    identity = train(config(), tmp_path / "identity", augment=lambda images, key: images)
    noisy = [train(config(), tmp_path / f"noisy{i}", augment=noise) for i in range(2)]
    assert identity["params_sha256"] == plain["params_sha256"]
    assert noisy[0]["params_sha256"] == noisy[1]["params_sha256"] != plain["params_sha256"]


@pytest.mark.parametrize("part,value,message", [
    ("loss", lambda logits, targets: optax.softmax_cross_entropy(logits, targets).mean(),
     r"loss: returned \(\) for logits and targets of shape \(2, 10\); expected \(2,\), one "
     "loss per example"),
    ("loss", lambda logits: logits, "loss: cannot be traced on logits and targets of shape "
                                    r"\(2, 10\): TypeError"),
    ("augment", lambda images, key: (images * 255).astype(jnp.uint8),
     r"augment: returned uint8 \(2, 32, 32, 3\) for float32 images of shape \(2, 32, 32, 3\); "
     "expected the same shape and dtype"),
    ("optimizer", lambda learning_rate: "adam", "optimizer: the function passed returned str"),
])
def test_a_part_that_does_not_fit_stops_before_training_in_one_line(cifar_batches_dir,
                                                                     tmp_path, part, value,
                                                                     message):
    error = ConfigError if part != "optimizer" else TypeError
    with pytest.raises(error, match=message):
        train(small_config(cifar_batches_dir), tmp_path, **{part: value})
    assert not (tmp_path / "checkpoints").exists() or not any(
        (tmp_path / "checkpoints").iterdir())


def test_a_loss_named_in_the_config_is_imported_and_checked_and_settings_that_would_be_lost_stop(
        cifar_batches_dir, tmp_path, monkeypatch):
    """train.loss='package.module:function' is imported and traced before training; a
    weight decay or a sweep of a built-in optimiser's setting, which an optimiser passed
    from Python would never see, stop in one line."""
    (tmp_path / "userlosses.py").write_text(
        "def batch_mean(logits, targets):\n    return (logits * targets).sum(-1).mean()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match=r"config.train.loss='userlosses:batch_mean': returned "
                                          r"\(\) for logits and targets of shape \(2, 10\)"):
        train(small_config(cifar_batches_dir, train__loss="userlosses:batch_mean"),
              tmp_path / "a")
    with pytest.raises(ConfigError, match="config.train.loss='userlosses:nothing': module "
                                          "'userlosses' has no function 'nothing'"):
        train(small_config(cifar_batches_dir, train__loss="userlosses:nothing"), tmp_path / "b")
    adam = lambda learning_rate: optax.adam(learning_rate)
    with pytest.raises(ConfigError, match=r"config.optimizer.weight_decay=0.1: an optimiser "
                                          "passed from Python brings its own weight decay"):
        train(small_config(cifar_batches_dir, optimizer__weight_decay=0.1), tmp_path / "c",
              optimizer=adam)
    with pytest.raises(ConfigError, match="config.sweep.optimizer.b1: an optimiser passed from "
                                          "Python takes only the learning rate"):
        train(small_config(cifar_batches_dir, sweep__optimizer__b1=(0.8, 0.9)), tmp_path / "d",
              optimizer=adam)


def test_the_built_in_losses_per_example():
    logits = jnp.asarray([[2.0, -1.0, 0.5], [0.0, 0.0, 3.0]])
    targets = jax.nn.one_hot(jnp.asarray([0, 1]), 3)
    xent_values = losses.softmax_xent(logits, targets)
    np.testing.assert_allclose(losses.Focal(0.0)(logits, targets), xent_values, rtol=1e-6)
    p = jax.nn.softmax(logits)[jnp.arange(2), jnp.asarray([0, 1])]
    np.testing.assert_allclose(losses.Focal(2.0)(logits, targets),
                               -(1 - p) ** 2 * jnp.log(p), rtol=1e-5)
    sigmoid = jax.nn.sigmoid(logits)
    np.testing.assert_allclose(
        losses.sigmoid_xent(logits, targets),
        -jnp.sum(targets * jnp.log(sigmoid) + (1 - targets) * jnp.log(1 - sigmoid), -1),
        rtol=1e-5)
    assert losses.Focal(2.0) == losses.Focal(2.0)  # equal static arguments: one program


def test_an_optax_optimiser_by_name_takes_its_kwargs_the_schedule_and_clipping():
    config = defaults.get_config().optimizer
    with config.unlocked():
        config.update(name="lion", learning_rate=0.01, weight_decay=0.1,
                      kwargs={"b1": 0.5}, clip_norm=1.0)
    schedule = optim.create_schedule(config, 10)
    tx = optim.create_optimizer(config, schedule)
    expected = optax.chain(optax.clip_by_global_norm(1.0),
                           optax.lion(schedule, b1=0.5, weight_decay=0.1))
    params = {"w": jnp.asarray([1.0, -2.0, 3.0])}
    grads = {"w": jnp.asarray([30.0, 40.0, 0.0])}  # norm 50: clipped to 1
    got, _ = tx.update(grads, tx.init(params), params)
    want, _ = expected.update(grads, expected.init(params), params)
    np.testing.assert_array_equal(got["w"], want["w"])
    config.name, config.kwargs = "adafactor", {"no_such_argument": 1}
    with pytest.raises(ConfigError, match=r"config.optimizer.kwargs=\{'no_such_argument': 1\}: "
                                          "optax's adafactor cannot take them"):
        optim.create_optimizer(config, schedule)


PARTS_MODULE = '''
import jax, jax.numpy as jnp

def noise(images, key):
    return jnp.clip(images + 0.05 * jax.random.normal(key, images.shape), 0.0, 1.0)
'''

NAMED_CONFIG = '''
from configs import fashion_mnist_mlp

def get_config():
    config = fashion_mnist_mlp.get_config()
    config.data.name, config.data.dir, config.data.source = "cifar10", {data!r}, "files"
    config.model.hidden_sizes = (32,)
    config.train.batch_size, config.train.num_steps, config.eval.batch_size = 50, 20, 250
    config.optimizer.name, config.optimizer.learning_rate = "lion", 1e-4
    config.optimizer.schedule, config.optimizer.kwargs = "constant", {{"b1": 0.95}}
    config.optimizer.clip_norm = 1.0
    config.train.loss, config.train.focal_gamma = "focal", 1.5
    config.augment.fn = "userparts:noise"
    config.parallel.fsdp = 2
    return config
'''


@pytest.mark.slow
def test_the_config_names_every_part_and_main_py_resumes_such_a_run(cifar_batches_dir,
                                                                     tmp_path):
    """optax's lion by name with its kwargs and clipping, the focal loss and an imported
    augmentation, FSDP-sharded over two devices, in main.py; rerun longer, it resumes."""
    (tmp_path / "userparts.py").write_text(PARTS_MODULE)
    (tmp_path / "named.py").write_text(textwrap.dedent(NAMED_CONFIG.format(
        data=str(cifar_batches_dir))))
    env = quick_compile.env(0)
    env.update(PYTHONPATH=f"{tmp_path}:{REPO}", XLA_FLAGS=env["XLA_FLAGS"]
               + " --xla_force_host_platform_device_count=2")
    workdir = tmp_path / "run"
    for steps in (20, 40):
        done = subprocess.run([sys.executable, "main.py", f"--config={tmp_path / 'named.py'}",
                               f"--workdir={workdir}", f"--config.train.num_steps={steps}"],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((workdir / report.SUMMARY_FILE).read_text())
    assert summary["resumed_from_step"] == 20 and summary["steps"] == 40
    assert np.isfinite(summary["test_loss"])
    rates = learning_rates(workdir)
    assert rates == pytest.approx([1e-4] * len(rates))
