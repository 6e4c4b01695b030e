"""End-to-end training on a real CIFAR-10 subset (2,000 train / 500 test images)."""
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import once_per_session
from tolerances import BFLOAT16_PASS, ELEMENTWISE, NETWORK_PASS, TRAINING_STEPS
from overrides import with_overrides

import jaxtrain
from configs import cifar, cifar_seed_cnn, default
from jaxtrain import ConfigError, TrainingError, data, models
from jaxtrain.run import loop
from jaxtrain.runtime import report
from jaxtrain.training import augment, evaluation, inputs, optim, prepare, train_state
from jaxtrain.training import chunks as chunks_lib
from jaxtrain.training import step as step_lib

pytestmark = pytest.mark.usefixtures("compile_quickly")  # conftest.py


def small_config(data_dir, base=cifar, **overrides):
    """The shipped recipe, scaled down to run in seconds on a CPU."""
    config = base.get_config()
    config.data.dir = str(data_dir)
    config.data.source = "files"
    config.model.widths = (16, 32, 64)
    config.model.stem_width = 8
    config.train.batch_size = 100
    config.train.num_epochs = 4
    config.eval.batch_size = 200  # 500 test images: the last batch is padded
    config.eval.tta = "flip"
    return with_overrides(config, overrides)


def short_config(data_dir):
    return small_config(data_dir, train__log_every_steps=5, train__precision="float32")


@pytest.fixture(scope="module")
def short_run(cifar_batches_dir, tmp_path_factory, worker_id):
    """The scaled-down recipe in float32; the summary train_and_evaluate returned."""
    workdir, summary = once_per_session(
        tmp_path_factory, worker_id, "short_run",
        lambda workdir: loop.train_and_evaluate(short_config(cifar_batches_dir), str(workdir)))
    return workdir, short_config(cifar_batches_dir), summary


@pytest.mark.slow
def test_short_run_learns_well_above_chance(short_run):
    _, _, summary = short_run
    assert summary["test_accuracy"] > 0.30  # chance is 0.10
    assert summary["steps"] == 80 and summary["epochs"] == 4


@pytest.mark.slow
def test_a_bfloat16_run_takes_the_float32_runs_steps_and_keeps_float32_weights(
        cifar_batches_dir, tmp_path):
    """The recipe's mixed precision on a GPU ('auto'), asked for here: computed in
    bfloat16, the weights kept in float32; its first 5 steps are the float32 run's to
    bfloat16's precision. The recipe with the MLP: the precision reaches every model alike
    (test_models.py: cifar_cnn's convolutions in bfloat16), and XLA:CPU's bfloat16
    convolutions take minutes to compile and run."""
    runs = {}
    for precision in ("float32", "bfloat16"):
        config = small_config(cifar_batches_dir, train__log_every_steps=5, train__num_steps=5,
                              eval__tta="none", model__name="mlp", model__hidden_sizes=(64,),
                              model__batch_norm=True)
        assert config.train.precision == "auto"  # float32 here, on a CPU
        config.train.precision = precision
        runs[precision] = loop.train_and_evaluate(config, str(tmp_path / precision))
    summary = runs["bfloat16"]
    assert summary["precision"] == "bfloat16"
    assert summary["steps"] == 5 and np.isfinite(summary["test_loss"])
    bfloat16, float32 = ([row["train_loss"] for row in report.read_metrics(str(tmp_path / p))
                          if row["step"] == 5] for p in ("bfloat16", "float32"))
    assert bfloat16 == pytest.approx(float32, rel=BFLOAT16_PASS) and bfloat16 != float32
    params = jaxtrain.restore(str(tmp_path / "bfloat16")).state.params
    assert {leaf.dtype for leaf in jax.tree.leaves(params)} == {jnp.dtype("float32")}


@pytest.mark.slow
def test_summary_json_has_what_users_compare(short_run):
    workdir, config, summary = short_run
    with open(workdir / "summary.json") as f:
        written = json.load(f)
    for key in ("test_accuracy", "test_loss", "train_seconds", "compile_seconds",
                "total_seconds", "images_per_second", "epochs", "steps", "device_kind",
                "device_count", "jax_version", "config"):
        assert key in written, key
    assert written["test_accuracy"] == pytest.approx(summary["test_accuracy"])
    assert written["config"]["train"]["log_every_steps"] == 5
    assert written["device_count"] == jax.device_count()
    assert written["jax_version"] == jax.__version__
    assert 0 < written["train_seconds"] < written["total_seconds"]
    assert written["compile_seconds"] > 0 and written["images_per_second"] > 0


@pytest.mark.slow
def test_metrics_jsonl_has_one_record_per_logging_interval(short_run):
    """A row every train.log_every_steps (whatever the chunks' lengths), the last at the
    run's last step."""
    workdir, config, summary = short_run
    records = report.read_metrics(str(workdir))
    every = config.train.log_every_steps
    assert [r["step"] for r in records] == list(range(every, summary["steps"] + 1, every))
    for r in records:
        assert {"step", "epoch", "train_loss", "train_accuracy", "learning_rate",
                "seconds"} <= set(r)
    evaluated = [r for r in records if "test_accuracy" in r]
    assert [r["epoch"] for r in evaluated] == [1.0, 2.0, 3.0, 4.0]  # eval.every_epochs = 1
    assert evaluated[-1]["test_accuracy"] == pytest.approx(summary["test_accuracy"])
    assert records[-1]["train_loss"] < records[0]["train_loss"]
    seconds = [r["seconds"] for r in records]
    assert seconds == sorted(seconds)


@pytest.mark.slow
def test_tensorboard_and_plot_are_written(short_run):
    from tensorboard.backend.event_processing import event_accumulator

    workdir, _, _ = short_run
    events = event_accumulator.EventAccumulator(str(workdir / report.TENSORBOARD_DIR))
    events.Reload()
    assert [e.step for e in events.Scalars("train_loss")] == list(range(5, 81, 5))
    assert len(events.Scalars("test_accuracy")) == 4
    with open(workdir / report.PLOT_FILE, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_same_seed_gives_the_same_run_and_another_seed_does_not(cifar_batches_dir, tmp_path):
    def run(seed, name):  # every random draw: init, order, flips and shifts
        config = small_config(cifar_batches_dir, base=cifar_seed_cnn, train__batch_size=50,
                              train__num_steps=15, model__batch_norm=True,
                              augment__flip=True, augment__translate=2)
        config.seed = seed
        return loop.train_and_evaluate(config, str(tmp_path / name))

    a, b, c = run(0, "a"), run(0, "b"), run(1, "c")
    assert (a["train_loss"], a["test_loss"]) == (b["train_loss"], b["test_loss"])
    assert a["test_loss"] != c["test_loss"]


@pytest.mark.slow
def test_scan_and_python_loops_compute_the_same_steps(cifar_batches_dir, tmp_path):
    results = {}
    for kind in ("scan", "python"):
        config = small_config(cifar_batches_dir, base=cifar_seed_cnn, train__batch_size=50,
                              train__num_steps=30, train__log_every_steps=10,
                              train__loop=kind, augment__flip=True, augment__translate=2)
        loop.train_and_evaluate(config, str(tmp_path / kind))
        results[kind] = report.read_metrics(str(tmp_path / kind))
    for scan, python in zip(results["scan"], results["python"]):
        assert scan["step"] == python["step"]
        assert scan["train_loss"] == pytest.approx(python["train_loss"], rel=TRAINING_STEPS)
    assert results["scan"][-1]["test_loss"] == pytest.approx(results["python"][-1]["test_loss"],
                                                             rel=TRAINING_STEPS)


@pytest.mark.slow
def test_seed_recipe_learns_with_tiny_batches(cifar_batches_dir, tmp_path):
    config = small_config(cifar_batches_dir, base=cifar_seed_cnn, train__batch_size=4,
                          train__num_epochs=2, train__log_every_steps=250,
                          optimizer__learning_rate=0.005)  # 1,000 steps, not 25,000
    summary = loop.train_and_evaluate(config, str(tmp_path))
    assert summary["steps"] == 1000
    assert summary["test_accuracy"] > 0.20


@pytest.mark.slow
def test_non_finite_loss_stops_with_the_step(cifar_batches_dir, tmp_path):
    config = small_config(cifar_batches_dir, base=cifar_seed_cnn, train__num_steps=20,
                          optimizer__learning_rate=1e8)
    with pytest.raises(TrainingError, match=r"non-finite training loss at step \d+"):
        loop.train_and_evaluate(config, str(tmp_path))
    assert os.path.exists(tmp_path / report.METRICS_FILE)


@pytest.mark.slow
def test_padded_eval_batches_give_the_same_metrics(cifar_batches_dir):
    dataset = data.load("cifar10", "files", str(cifar_batches_dir))
    config = small_config(cifar_batches_dir, model__widths=(8, 16, 16))
    model = models.create_model(config.model, 10, np.float32)
    tx = optim.create_optimizer(config.optimizer,
                                      optim.create_schedule(config.optimizer, 1))
    state = made_up_state(model, tx, (32, 32, 3))
    results = []
    for batch_size in (500, 300, 7):
        arrays = inputs.batch_for_eval(dataset.x_test, dataset.y_test, batch_size)
        assert int(arrays[2].sum()) == 500
        results.append(evaluation.evaluate(state, *arrays, mean=(0.5,), std=(0.25,), tta="flip",
                                           pad_mode="reflect"))
    for other in results[1:]:
        assert float(other["accuracy"]) == pytest.approx(float(results[0]["accuracy"]))
        assert float(other["loss"]) == pytest.approx(float(results[0]["loss"]),
                                                     rel=NETWORK_PASS)


@pytest.mark.parametrize("key,value,message", [
    ("train__precision", "float16", "config.train.precision='float16'"),
    ("eval__tta", "rotate", "config.eval.tta='rotate'"),
    ("train__batch_size", 0, "config.train.batch_size=0"),
    ("train__batch_size", 4000, "config.train.batch_size=4000 is larger than the training "
                                "split (2000 images): use a smaller one, e.g. "
                                "--config.train.batch_size=128 (15 steps an epoch)"),
    ("data__mean", (0.5, 0.5), "config.data.mean=(0.5, 0.5)"),
    ("model__stem_init", "pca", "config.model.stem_init='pca'"),
    ("model__stem_width", 7, "config.model.stem_width=7: a whitened stem needs an even width"),
])
def test_bad_config_values_name_the_key(cifar_batches_dir, tmp_path, key, value, message):
    config = small_config(cifar_batches_dir, **{"model__stem_init": "whiten", key: value})
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        loop.train_and_evaluate(config, str(tmp_path))


@pytest.mark.slow
def test_a_whitened_stem_stays_fixed_while_the_rest_trains(cifar_batches_dir, tmp_path):
    config = small_config(cifar_batches_dir, model__stem_init="whiten", model__stem_width=8,
                          model__widths=(8, 16, 16), train__num_epochs=1, eval__tta="none")
    run = prepare.setup(config)
    initial = jax.device_get(run.state.params)
    np.testing.assert_array_equal(initial["Conv_0"]["kernel"], run.stem_kernel)
    summary = loop.train_and_evaluate(config, str(tmp_path))
    assert summary["test_accuracy"] > 0.15
    trained = jaxtrain.restore(str(tmp_path)).state.params  # the optimiser state restores too
    np.testing.assert_array_equal(trained["Conv_0"]["kernel"], run.stem_kernel)
    assert not np.allclose(trained["Conv_0"]["bias"], initial["Conv_0"]["bias"])
    assert not np.allclose(trained["Dense_0"]["kernel"], initial["Dense_0"]["kernel"])


def made_up_state(model, tx, image_shape, seed=0):
    """A TrainState of `model`'s variables as model.init shapes them (jax.eval_shape: no
    init program compiled, which takes seconds for a CNN on a CPU), drawn by NumPy for
    `seed`: weights at 1/sqrt(fan-in), BatchNorm's scales about 1, biases and means about
    0, variances in [0.5, 2]."""
    shapes = jax.eval_shape(lambda x: model.init(jax.random.key(0), x, train=False),
                            jax.ShapeDtypeStruct((1, *image_shape), jnp.float32))
    rng = np.random.default_rng(seed)

    def draw(path, leaf):
        name = jax.tree_util.keystr(path)
        if len(leaf.shape) > 1:
            value = rng.standard_normal(leaf.shape) / np.sqrt(np.prod(leaf.shape[:-1]))
        elif "'var'" in name:
            value = rng.uniform(0.5, 2.0, leaf.shape)
        elif "'scale'" in name:
            value = 1 + 0.1 * rng.standard_normal(leaf.shape)
        else:
            value = 0.1 * rng.standard_normal(leaf.shape)
        return np.asarray(value, leaf.dtype)
    variables = jax.tree_util.tree_map_with_path(draw, shapes)
    return jax.jit(lambda v: train_state.TrainState.create(
        apply_fn=model.apply, params=v["params"], tx=tx,
        batch_stats=v.get("batch_stats", {})))(variables)


def host_copy(tree):
    """A copy on the device through the host (no copy program compiled per shape, as
    jnp.copy's are): for the chunks, which donate their input state."""
    return jax.tree.map(lambda leaf: jnp.asarray(np.array(leaf)), tree)


# ---------------------------------------------------------------- the epoch driver

def recording_step(state, images, labels, key, mirror=None, *, spec):
    """Stands in for step.train_step: the 'state' records the augmented image that each
    example (its label is its index) was trained on."""
    seen = augment.augment_batch(images, key, mirror=mirror, **dict(spec.augment))
    return state.at[labels].set(seen), {"loss": jnp.zeros(()), "accuracy": jnp.zeros(())}


def distinct_images(n, seed=0):
    images = np.random.default_rng(seed).integers(0, 256, (n, 4, 4, 1), dtype=np.uint8)
    assert not np.any(np.all(images == images[:, :, ::-1], axis=(1, 2, 3)))  # none symmetric
    return images, np.arange(n, dtype=np.int32)


def record_epoch(loop, augment_kwargs, epochs, n=12, batch=3):
    """{epoch: the images each example was trained on}, by the loop's compiled chunks,
    one chunk per epoch and two; checks both give the same."""
    x, y = distinct_images(n)
    spec = step_lib.StepSpec(batch_size=batch, mean=(0.0,), std=(1.0,), augment=augment_kwargs,
                             num_classes=n, label_smoothing=0.0)
    key = jax.random.key(11)
    steps = n // batch
    run_chunk = chunks_lib.compile_chunks(loop, jnp.zeros_like(x), x, y, key, {steps, steps // 2},
                                          spec)
    seen = {}
    for epoch in epochs:
        whole, _ = run_chunk(jnp.zeros_like(x), key, epoch, 0, steps)
        half, _ = run_chunk(jnp.zeros_like(x), key, epoch, 0, steps // 2)
        half, _ = run_chunk(half, key, epoch, steps // 2, steps - steps // 2)
        np.testing.assert_array_equal(np.asarray(half), np.asarray(whole))
        seen[epoch] = np.asarray(whole)
    return x, key, seen


@pytest.mark.slow
@pytest.mark.parametrize("loop", ["scan", "python"])
def test_alternating_flip_mirrors_base_xor_odd_epoch(monkeypatch, loop):
    monkeypatch.setattr(step_lib, "train_step", recording_step)
    kwargs = dict(flip=True, alternate_flip=True, translate=0, pad_mode="reflect")
    x, key, seen = record_epoch(loop, kwargs, epochs=(0, 1, 2))
    base = np.asarray(jax.random.bernoulli(jax.random.fold_in(key, augment.FLIP_STREAM), 0.5,
                                           (len(x),)))
    assert 0 < base.sum() < len(x)  # both kinds present, or the test proves little
    for epoch, images in seen.items():
        mirrored = np.all(images == x[:, :, ::-1], axis=(1, 2, 3))
        assert np.all(mirrored | np.all(images == x, axis=(1, 2, 3)))
        np.testing.assert_array_equal(mirrored, base ^ (epoch % 2 == 1))
    np.testing.assert_array_equal(seen[0], seen[2])


@pytest.mark.slow
@pytest.mark.parametrize("loop", ["scan", "python"])
def test_without_alternate_flip_the_epoch_keeps_its_old_order_and_keys(monkeypatch, loop):
    """The derivation from before the epoch driver: order and augmentation key from
    split(fold_in(key, epoch)), step s augmented with fold_in(augment_key, s)."""
    monkeypatch.setattr(step_lib, "train_step", recording_step)
    kwargs = dict(flip=True, alternate_flip=False, translate=1, pad_mode="constant")
    x, key, seen = record_epoch(loop, kwargs, epochs=(0, 3))
    for epoch, images in seen.items():
        order_key, augment_key = jax.random.split(jax.random.fold_in(key, epoch))
        order = np.asarray(jax.random.permutation(order_key, len(x)))
        expected = np.zeros_like(x)
        for step in range(len(x) // 3):
            indices = order[step * 3:(step + 1) * 3]
            expected[indices] = augment.augment_batch(x[indices],
                                                      jax.random.fold_in(augment_key, step),
                                                      **kwargs)
        np.testing.assert_array_equal(images, expected)


@pytest.mark.slow
def test_real_steps_split_into_chunks_equal_one_chunk_per_epoch():
    """A small BatchNorm MLP trained by the real step: chunking is invisible, in both loops."""
    model_config = default.get_config().model
    model_config.name, model_config.hidden_sizes, model_config.batch_norm = "mlp", (32,), True
    model = models.create_model(model_config, 10, jnp.float32)
    tx = optax.sgd(0.05, momentum=0.9)
    rng = np.random.default_rng(1)
    x = rng.integers(0, 256, (64, 8, 8, 3), dtype=np.uint8)
    y = rng.integers(0, 10, 64).astype(np.int32)
    spec = step_lib.StepSpec(batch_size=16, mean=(0.5,), std=(0.25,), num_classes=10,
                       label_smoothing=0.1, augment=dict(
                           flip=True, alternate_flip=True, translate=1, pad_mode="reflect"))
    key = jax.random.key(2)
    initial = train_state.create_train_state(jax.random.key(0), model, tx, (8, 8, 3))
    results = {}
    for kind in ("scan", "python"):
        run_chunk = chunks_lib.compile_chunks(kind, initial, x, y, key, {2, 4}, spec)
        for chunks in ((4,), (2, 2)):
            state = jax.tree.map(jnp.copy, initial)  # the chunks donate their input state
            for epoch in range(2):
                first = 0
                for length in chunks:
                    state, _ = run_chunk(state, key, epoch, first, length)
                    first += length
            results[kind, chunks] = jax.device_get((state.params, state.batch_stats))
    reference = results["scan", (4,)]
    for name, result in results.items():
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=NETWORK_PASS,
                                                             atol=NETWORK_PASS * 0.1),
                     result, reference)


@pytest.mark.slow
def test_a_paced_chunk_runs_in_calls_of_its_seconds_and_stops_between_them():
    """train.chunk_seconds: one while-loop program for every chunk length, run in calls
    sized by the time a step took; each step the scanned chunk's, bit for bit, and the
    chunk stops after the call where progress() says so."""
    model_config = default.get_config().model
    model_config.name, model_config.hidden_sizes, model_config.batch_norm = "mlp", (32,), True
    model = models.create_model(model_config, 10, jnp.float32)
    rng = np.random.default_rng(1)
    x = rng.integers(0, 256, (64, 8, 8, 3), dtype=np.uint8)
    y = rng.integers(0, 10, 64).astype(np.int32)
    spec = step_lib.StepSpec(batch_size=16, mean=(0.5,), std=(0.25,), num_classes=10,
                       label_smoothing=0.1, augment=dict(flip=True, translate=1,
                                                                pad_mode="reflect"))
    key = jax.random.key(2)
    initial = train_state.create_train_state(jax.random.key(0), model,
                                             optax.sgd(0.05, momentum=0.9), (8, 8, 3))
    whole = chunks_lib.compile_chunks("scan", initial, x, y, key, {4}, spec)
    pace = chunks_lib.Pace(1e-9)  # every call one step
    paced = chunks_lib.compile_chunks("scan", initial, x, y, key, {4}, spec, pace=pace,
                                      paced=True)
    assert len(paced.programs) == 1 and len(whole.programs) == 1
    expected, expected_out = whole(jax.tree.map(jnp.copy, initial), key, 1, 0, 4)
    calls = []
    state, out = paced(jax.tree.map(jnp.copy, initial), key, 1, 0, 4,
                       lambda done, metrics: calls.append(done) is None and False)
    assert calls == [1, 2, 3, 4]
    np.testing.assert_array_equal(out["per_step"]["loss"], expected_out["per_step"]["loss"])
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(state.params),
                 jax.device_get(expected.params))
    pace.seconds = 1e9  # a whole chunk a call, once a step's time is known
    calls.clear()
    paced(jax.tree.map(jnp.copy, initial), key, 1, 0, 4, lambda done, m: calls.append(done))
    assert calls == [4]
    pace.seconds, pace.step_seconds = 1e-9, None
    state, out = paced(jax.tree.map(jnp.copy, initial), key, 1, 0, 4, lambda done, m: done >= 2)
    assert out["per_step"]["loss"].shape == (2,) and int(state.step) == 2


@pytest.mark.slow
@pytest.mark.parametrize("name", ["seed_cnn", "mlp"])
def test_replicas_trained_together_equal_their_single_runs(name):
    """compile_chunks(replicas=True): three runs with a leading replica axis (each its own
    initial weights, order, flips and translations) end where each run alone does, float32,
    BatchNorm, two epochs of chunks in both loops (issue #18's first step)."""
    model_config = default.get_config().model
    model_config.name, model_config.batch_norm, model_config.hidden_sizes = name, True, (32,)
    model = models.create_model(model_config, 10, jnp.float32)
    tx = optax.sgd(0.05, momentum=0.9)
    shape = (32, 32, 3) if name == "seed_cnn" else (8, 8, 3)  # LeNet needs 32 px
    rng = np.random.default_rng(3)
    x = rng.integers(0, 256, (64, *shape), dtype=np.uint8)
    y = rng.integers(0, 10, 64).astype(np.int32)
    spec = step_lib.StepSpec(batch_size=16, mean=(0.5,), std=(0.25,), num_classes=10,
                       label_smoothing=0.1, augment=dict(
                           flip=True, alternate_flip=True, translate=1, pad_mode="reflect"))
    seeds = (0, 1, 2)
    singles = [made_up_state(model, tx, shape, s) for s in seeds]
    keys = [jax.random.key(10 + s) for s in seeds]
    together = jax.tree.map(lambda *leaves: np.stack([np.asarray(leaf) for leaf in leaves]),
                            *singles)
    stacked_keys = jnp.stack(keys)

    def train_two_epochs(run_chunk, state, key):
        for epoch in range(2):
            state, summary = run_chunk(state, key, epoch, 0, 2)
            state, summary = run_chunk(state, key, epoch, 2, 2)
        return state, summary

    single_runs = {}  # each loop's single program, compiled once, trains the three alone
    for kind in ("scan", "python"):
        run_single = chunks_lib.compile_chunks(kind, singles[0], x, y, keys[0], {2}, spec)
        single_runs[kind] = [train_two_epochs(run_single, host_copy(s), k)
                             for s, k in zip(singles, keys)]
    for kind, paced in (("scan", False), ("scan", True), ("python", False)):
        pace = chunks_lib.Pace(60.0) if paced else None
        alone = single_runs[kind]
        run_chunk = chunks_lib.compile_chunks(kind, together, x, y, stacked_keys, {2}, spec,
                                              replicas=True, pace=pace, paced=paced)
        state, summary = train_two_epochs(run_chunk, host_copy(together), stacked_keys)
        losses = summary["per_step"]["loss"]
        assert losses.shape == (3, 2)
        for k, (single, single_summary) in enumerate(alone):
            replica = jax.tree.map(lambda leaf: np.asarray(leaf)[k],
                                   (state.params, state.batch_stats))
            jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=NETWORK_PASS,
                                                                 atol=NETWORK_PASS),
                         replica, (single.params, single.batch_stats))
            np.testing.assert_allclose(losses[k], single_summary["per_step"]["loss"],
                                       rtol=NETWORK_PASS)
        assert not np.allclose(losses[0], losses[1])  # runs of their own


@pytest.mark.slow
def test_a_skipped_step_uses_up_its_slot_of_the_schedule():
    """nonfinite='skip': the parameters and moments stay, but the schedule moves on with
    state.step, so the rate used next is schedule(state.step), the one the log shows."""
    model_config = default.get_config().model
    model_config.name, model_config.hidden_sizes = "mlp", (16,)
    model = models.create_model(model_config, 10, jnp.float32)
    schedule = optax.linear_schedule(0.1, 0.0, 10)
    tx = optax.chain(optax.add_decayed_weights(1e-4), optax.sgd(schedule, momentum=0.9))
    state = train_state.create_train_state(jax.random.key(0), model, tx, (4, 4, 1))
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (8, 4, 4, 1), dtype=np.uint8)
    labels = rng.integers(0, 10, 8).astype(np.int32)
    spec = step_lib.StepSpec(mean=(0.5,), std=(0.25,), num_classes=10, label_smoothing=0.0,
                             skip_nonfinite=True)
    step = jax.jit(functools.partial(step_lib.train_step, spec=spec))
    state, _ = step(state, images, labels, jax.random.key(1))
    bad = jax.jit(functools.partial(step_lib.train_step, spec=spec.replace(std=(0.0,))))  # x / 0
    skipped, metrics = bad(state, images, labels, jax.random.key(2))
    assert not np.isfinite(metrics["loss"])
    assert int(skipped.step) == 2
    counts = [leaf for leaf in jax.tree.leaves(
        skipped.opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByScheduleState))
        if isinstance(leaf, optax.ScaleByScheduleState)]
    assert [int(c.count) for c in counts] == [2]
    jax.tree.map(np.testing.assert_array_equal, skipped.params, state.params)
    momentum = [s for s in jax.tree.leaves(skipped.opt_state, is_leaf=lambda x: isinstance(
        x, optax.TraceState)) if isinstance(s, optax.TraceState)]
    before = [s for s in jax.tree.leaves(state.opt_state, is_leaf=lambda x: isinstance(
        x, optax.TraceState)) if isinstance(s, optax.TraceState)]
    jax.tree.map(np.testing.assert_array_equal, momentum, before)


# ---------------------------------------------------------------- test-time augmentation

MEAN, STD = (0.5,), (0.25,)


@pytest.fixture(scope="module")
def tta_setup(cifar_subset):
    config = small_config("unused")
    config.model.widths, config.model.stem_width = (8, 16, 16), 8
    config.model.head_scale = 30.0  # logits of order 1, so that TTA visibly changes them
    model = models.create_model(config.model, 10, jnp.float32)
    state = made_up_state(model, optax.sgd(0.1), (32, 32, 3))
    # 500 images in batches of 200: 100 padding rows, random images (not black) so that
    # TTA would change their logits if they were ever picked
    arrays = list(inputs.batch_for_eval(cifar_subset["x_test"], cifar_subset["y_test"], 200))
    noise = np.random.default_rng(0).integers(0, 256, (100, 32, 32, 3), dtype=np.uint8)
    arrays[0][-1, 100:] = noise
    return state, tuple(arrays)


@functools.partial(jax.jit, static_argnames="tta")
def per_view_logits(state, images, tta):
    """predict_logits as it was: one forward per TTA view."""
    views, weights = augment.tta_views(images, tta, "reflect")
    variables = {"params": state.params, "batch_stats": state.batch_stats}
    return sum(w * state.apply_fn(variables, step_lib.normalize(v, MEAN, STD), train=False)
               for w, v in zip(weights, views))


def logits(state, arrays, tta, tta_images=None):
    return np.asarray(evaluation.eval_logits(state, arrays[0], arrays[2], mean=MEAN, std=STD,
                                             tta=tta, pad_mode="reflect", tta_images=tta_images))


def evaluate(state, arrays, tta, tta_images=None):
    metrics = evaluation.evaluate(state, *arrays, mean=MEAN, std=STD, tta=tta, pad_mode="reflect",
                                  tta_images=tta_images)
    return float(metrics["loss"]), float(metrics["accuracy"])


@pytest.mark.slow
@pytest.mark.parametrize("tta", ["flip", "flip_translate"])
def test_stacked_tta_is_the_per_view_loop(tta_setup, tta):
    state, arrays = tta_setup
    images = jnp.asarray(arrays[0][0, :50])
    stacked = evaluation.predict_logits(state, images, mean=MEAN, std=STD, tta=tta,
                                        pad_mode="reflect")
    np.testing.assert_allclose(np.asarray(stacked), np.asarray(per_view_logits(state, images, tta)),
                               atol=NETWORK_PASS, rtol=NETWORK_PASS)


@pytest.mark.slow
def test_tta_fraction_one_is_the_old_full_evaluation_and_zero_is_none(tta_setup):
    state, (x, y, valid) = tta_setup
    assert inputs.tta_image_count(1.0, 500) is None and inputs.tta_image_count(0.0, 500) == 0
    old = [per_view_logits(state, jnp.asarray(batch), "flip") for batch in x]
    losses = [optax.softmax_cross_entropy_with_integer_labels(logits, labels)
              for logits, labels in zip(old, y)]
    count = valid.sum()
    old_loss = sum(float(jnp.sum(l * v)) for l, v in zip(losses, valid)) / count
    old_accuracy = sum(float(jnp.sum((jnp.argmax(l, -1) == labels) * v))
                       for l, labels, v in zip(old, y, valid)) / count
    loss, accuracy = evaluate(state, (x, y, valid), "flip")
    assert loss == pytest.approx(old_loss, rel=NETWORK_PASS)
    assert accuracy == pytest.approx(old_accuracy)
    assert evaluate(state, (x, y, valid), "flip", 0) == evaluate(state, (x, y, valid), "none")
    assert evaluate(state, (x, y, valid), "none", 50) == evaluate(state, (x, y, valid), "none")


@pytest.mark.slow
@pytest.mark.parametrize("fraction,count", [(0.1, 50), (0.99, 495)])
def test_partial_tta_goes_to_exactly_the_least_confident_valid_images(tta_setup, fraction,
                                                                      count):
    state, arrays = tta_setup
    assert inputs.tta_image_count(fraction, 500) == count
    assert inputs.tta_image_count(0.3, 10) == 3  # not 4 from 0.30000000000000004 x 10
    plain, full = logits(state, arrays, "none"), logits(state, arrays, "flip")
    mixed = logits(state, arrays, "flip", count)
    plain, full, mixed = (a.reshape(-1, 10) for a in (plain, full, mixed))
    valid = arrays[2].reshape(-1) > 0
    assert np.all(np.abs(full - plain).max(-1) > 1e-4)  # TTA changes every row, padding too
    confidence = jax.nn.softmax(plain).max(-1)
    assert len(np.unique(confidence[valid])) == valid.sum()  # no ties
    expected = np.zeros(len(valid), bool)
    expected[np.flatnonzero(valid)[np.argsort(confidence[valid])[:count]]] = True
    tta_rows = np.all(np.isclose(mixed, full, rtol=NETWORK_PASS, atol=NETWORK_PASS), axis=-1)
    plain_rows = np.all(mixed == plain, axis=-1)
    np.testing.assert_array_equal(tta_rows, expected)
    np.testing.assert_array_equal(plain_rows, ~expected)
    assert not np.any(tta_rows[~valid])  # padding never gets TTA
    loss, accuracy = evaluate(state, arrays, "flip", count)
    labels = arrays[1].reshape(-1)
    want = optax.softmax_cross_entropy_with_integer_labels(mixed, labels)[valid].mean()
    assert loss == pytest.approx(float(want), rel=NETWORK_PASS)
    assert accuracy == pytest.approx(float(np.mean(mixed.argmax(-1)[valid] == labels[valid])))


@pytest.mark.slow
@pytest.mark.parametrize("tta,tta_images", [("none", None), ("flip", None), ("flip", 50)])
def test_the_batch_by_batch_evaluation_is_evaluate(tta_setup, tta, tta_images):
    """compile_evaluation (one call per batch: stoppable, with progress) computes what
    evaluate does in one program, for one run and for two replicas; should_stop ends it
    between two batches."""
    state, arrays = tta_setup
    kwargs = dict(mean=MEAN, std=STD, tta=tta, pad_mode="reflect", tta_images=tta_images)
    whole = evaluation.evaluate(state, *arrays, **kwargs)
    by_batch = evaluation.compile_evaluation(state, *arrays, **kwargs)
    done = []
    metrics = by_batch(state, *arrays, progress=done.append)
    assert sum(done) == by_batch.batches == 3 + (1 if tta_images else 0)  # 50 images: 1 batch
    for name in ("loss", "accuracy"):
        assert float(metrics[name]) == pytest.approx(float(whole[name]), rel=ELEMENTWISE, abs=0)
    pair = jax.tree.map(lambda x: jnp.stack([x, x]), state)
    pair = pair.replace(params=jax.tree.map(lambda x: x.at[1].multiply(0.5), pair.params))
    replicated = evaluation.compile_evaluation(pair, *arrays, **kwargs, replicas=True)
    both = replicated(pair, *arrays)
    other = evaluation.evaluate(jax.tree.map(lambda x: x[1], pair), *arrays, **kwargs)
    for name in ("loss", "accuracy"):
        assert float(both[name][0]) == pytest.approx(float(whole[name]), rel=ELEMENTWISE,
                                                     abs=0)
        assert float(both[name][1]) == pytest.approx(float(other[name]), rel=ELEMENTWISE,
                                                     abs=0)
    asked = []
    with pytest.raises(evaluation.EvaluationStopped):
        by_batch(state, *arrays, should_stop=lambda: asked.append(1) or len(asked) == 2)
    assert len(asked) == 2  # stopped after the second batch, the third never ran


# ---------------------------------------------------------------- weight EMA

def ema_config(data_dir, **overrides):
    """A BatchNorm MLP, float32, a checkpoint every step (its parameter history)."""
    config = cifar_seed_cnn.get_config()
    config.data.dir = str(data_dir)
    config.data.source = "files"
    config.model.name = "mlp"
    config.model.batch_norm = True
    config.model.hidden_sizes = (32,)
    config.optimizer.learning_rate = 0.05
    config.train.batch_size = 100
    config.train.num_steps = 10
    config.train.precision = "float32"
    config.checkpoint.every_steps = 1
    config.checkpoint.keep = 10
    config.eval.every_epochs = 0
    config.eval.batch_size = 250
    return with_overrides(config, overrides)


def checkpoint_tree(workdir, step):
    import orbax.checkpoint as ocp

    return ocp.StandardCheckpointer().restore(
        os.path.join(workdir, "checkpoints", str(step), "state"))


@pytest.mark.slow
def test_the_ema_is_a_numpy_ema_of_the_parameter_history(cifar_batches_dir, tmp_path, capsys):
    decay = 0.7
    config = ema_config(cifar_batches_dir, train__ema_decay=decay)
    summary = loop.train_and_evaluate(config, str(tmp_path))
    console = capsys.readouterr().out.splitlines()  # the EMA's columns beside the raw ones
    header = next(line for line in console if line.split()[:2] == ["epoch", "step"])
    assert header.split()[4:8] == ["test_loss", "test_acc", "loss_ema", "acc_ema"]
    last_row = [line.split() for line in console if line.split()[1:2] == ["10"]][-1]
    assert last_row[7] == f"{summary['test_accuracy_ema']:.2%}"
    initial = prepare.setup(config).state  # the same seed: the weights before step 1
    expected = jax.tree.map(np.asarray, {"params": initial.params,
                                         "batch_stats": initial.batch_stats})
    for step in range(1, 11):
        saved = checkpoint_tree(str(tmp_path), step)
        expected = jax.tree.map(lambda e, new: decay * e + (1 - decay) * np.asarray(new),
                                expected, {"params": saved["params"],
                                           "batch_stats": saved["batch_stats"]})
    final = checkpoint_tree(str(tmp_path), 10)["ema"]
    jax.tree.map(lambda got, want: np.testing.assert_allclose(got, want, atol=ELEMENTWISE,
                                                              rtol=ELEMENTWISE),
                 final, expected)
    # Evaluated beside the raw weights, and restored on request.
    assert summary["test_accuracy_ema"] != summary["test_accuracy"]
    row = report.read_metrics(str(tmp_path))[-1]
    assert row["test_accuracy_ema"] == summary["test_accuracy_ema"]
    ema = jaxtrain.restore(str(tmp_path), weights="ema")
    np.testing.assert_array_equal(ema.state.params["Dense_0"]["kernel"],
                                  final["params"]["Dense_0"]["kernel"])
    assert not np.array_equal(ema.state.params["Dense_0"]["kernel"],
                              jaxtrain.restore(str(tmp_path)).state.params["Dense_0"]["kernel"])


@pytest.mark.slow
def test_an_ema_of_decay_zero_is_the_weights_and_resume_stays_exact(cifar_batches_dir,
                                                                     tmp_path):
    """(A checkpoint every 5 steps here: only steps 5 and 10 are read.)"""
    zero = loop.train_and_evaluate(ema_config(cifar_batches_dir, train__ema_decay=0.0,
                                              checkpoint__every_steps=5), str(tmp_path / "zero"))
    tree = checkpoint_tree(str(tmp_path / "zero"), 10)
    jax.tree.map(np.testing.assert_array_equal, tree["ema"],
                 {"params": tree["params"], "batch_stats": tree["batch_stats"]})
    assert zero["test_accuracy_ema"] == zero["test_accuracy"]
    # Five steps, then resumed to ten: the raw weights and the EMA of the run in one go.
    whole = ema_config(cifar_batches_dir, train__ema_decay=0.9, checkpoint__every_steps=5)
    loop.train_and_evaluate(whole, str(tmp_path / "whole"))
    loop.train_and_evaluate(with_overrides(ema_config(cifar_batches_dir, train__ema_decay=0.9,
                                                      checkpoint__every_steps=5),
                                           {"train__num_steps": 5}), str(tmp_path / "parts"))
    resumed = loop.train_and_evaluate(whole, str(tmp_path / "parts"))
    assert resumed["resumed_from_step"] == 5
    jax.tree.map(np.testing.assert_array_equal, checkpoint_tree(str(tmp_path / "parts"), 10),
                 checkpoint_tree(str(tmp_path / "whole"), 10))
    loop.train_and_evaluate(ema_config(cifar_batches_dir, train__num_steps=1),
                            str(tmp_path / "plain"))
    with pytest.raises(ValueError, match=r"weights='ema': the run in .* kept no moving average"):
        jaxtrain.restore(str(tmp_path / "plain"), weights="ema")
    with pytest.raises(ValueError, match=r"^weights='emma': must be 'raw' or 'ema'$"):
        jaxtrain.restore(str(tmp_path / "zero"), weights="emma")
