"""End-to-end training on a real CIFAR-10 subset (2,000 train / 500 test images)."""
import json
import os

import jax
import numpy as np
import pytest

from configs import cifar, cifar_seed_cnn
import jaxtrain
from jaxtrain import TrainingError, data, report, train


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
    for key, value in overrides.items():
        section, name = key.split("__")
        config[section][name] = value
    return config


@pytest.fixture(scope="module")
def bf16_run(cifar_batches_dir, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("bf16")
    config = small_config(cifar_batches_dir, train__log_every_steps=10)
    return workdir, config, train.train_and_evaluate(config, str(workdir))


def test_short_run_learns_well_above_chance_in_bfloat16(bf16_run):
    _, _, summary = bf16_run
    assert summary["test_accuracy"] > 0.30  # chance is 0.10
    assert summary["steps"] == 80 and summary["epochs"] == 4


def test_short_run_learns_in_float32(cifar_batches_dir, tmp_path):
    config = small_config(cifar_batches_dir, train__precision="float32")
    summary = train.train_and_evaluate(config, str(tmp_path))
    assert summary["test_accuracy"] > 0.30


def test_summary_json_has_what_users_compare(bf16_run):
    workdir, config, summary = bf16_run
    with open(workdir / "summary.json") as f:
        written = json.load(f)
    for key in ("test_accuracy", "test_loss", "train_seconds", "compile_seconds",
                "total_seconds", "images_per_second", "epochs", "steps", "device_kind",
                "device_count", "jax_version", "config"):
        assert key in written, key
    assert written["test_accuracy"] == pytest.approx(summary["test_accuracy"])
    assert written["config"]["train"]["log_every_steps"] == 10
    assert written["device_count"] == jax.device_count()
    assert written["jax_version"] == jax.__version__
    assert 0 < written["train_seconds"] < written["total_seconds"]
    assert written["compile_seconds"] > 0 and written["images_per_second"] > 0


def test_metrics_jsonl_has_one_record_per_chunk(bf16_run):
    workdir, _, summary = bf16_run
    records = report.read_metrics(str(workdir))
    assert [r["step"] for r in records] == list(range(10, 81, 10))
    for r in records:
        assert {"step", "epoch", "train_loss", "train_accuracy", "learning_rate",
                "seconds"} <= set(r)
    evaluated = [r for r in records if "test_accuracy" in r]
    assert [r["epoch"] for r in evaluated] == [1.0, 2.0, 3.0, 4.0]  # eval.every_epochs = 1
    assert evaluated[-1]["test_accuracy"] == pytest.approx(summary["test_accuracy"])
    assert records[-1]["train_loss"] < records[0]["train_loss"]
    seconds = [r["seconds"] for r in records]
    assert seconds == sorted(seconds)


def test_tensorboard_and_plot_are_written(bf16_run):
    from tensorboard.backend.event_processing import event_accumulator

    workdir, _, _ = bf16_run
    events = event_accumulator.EventAccumulator(str(workdir / report.TENSORBOARD_DIR))
    events.Reload()
    assert [e.step for e in events.Scalars("train_loss")] == list(range(10, 81, 10))
    assert len(events.Scalars("test_accuracy")) == 4
    with open(workdir / report.PLOT_FILE, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_same_seed_gives_the_same_run_and_another_seed_does_not(cifar_batches_dir, tmp_path):
    def run(seed, name):
        config = small_config(cifar_batches_dir, train__num_steps=15)
        config.seed = seed
        return train.train_and_evaluate(config, str(tmp_path / name))

    a, b, c = run(0, "a"), run(0, "b"), run(1, "c")
    assert (a["train_loss"], a["test_loss"]) == (b["train_loss"], b["test_loss"])
    assert a["test_loss"] != c["test_loss"]


def test_scan_and_python_loops_compute_the_same_steps(cifar_batches_dir, tmp_path):
    results = {}
    for loop in ("scan", "python"):
        config = small_config(cifar_batches_dir, base=cifar_seed_cnn, train__batch_size=50,
                              train__num_steps=30, train__log_every_steps=10,
                              train__loop=loop, augment__flip=True, augment__translate=2)
        train.train_and_evaluate(config, str(tmp_path / loop))
        results[loop] = report.read_metrics(str(tmp_path / loop))
    for scan, python in zip(results["scan"], results["python"]):
        assert scan["step"] == python["step"]
        assert scan["train_loss"] == pytest.approx(python["train_loss"], rel=1e-4)
    assert results["scan"][-1]["test_loss"] == pytest.approx(results["python"][-1]["test_loss"],
                                                             rel=1e-4)


def test_seed_recipe_learns_with_tiny_batches(cifar_batches_dir, tmp_path):
    config = small_config(cifar_batches_dir, base=cifar_seed_cnn, train__batch_size=4,
                          train__num_epochs=2, train__log_every_steps=250,
                          optimizer__learning_rate=0.005)  # 1,000 steps, not 25,000
    summary = train.train_and_evaluate(config, str(tmp_path))
    assert summary["steps"] == 1000
    assert summary["test_accuracy"] > 0.20


def test_non_finite_loss_stops_with_the_step(cifar_batches_dir, tmp_path):
    config = small_config(cifar_batches_dir, base=cifar_seed_cnn, train__num_steps=20,
                          optimizer__learning_rate=1e8)
    with pytest.raises(TrainingError, match=r"non-finite training loss at step \d+"):
        train.train_and_evaluate(config, str(tmp_path))
    assert os.path.exists(tmp_path / report.METRICS_FILE)


def test_padded_eval_batches_give_the_same_metrics(cifar_batches_dir):
    dataset = data.load("cifar10", "files", str(cifar_batches_dir))
    config = small_config(cifar_batches_dir)
    model = train.models.create_model(config.model, 10, np.float32)
    tx = train.optim.create_optimizer(config.optimizer,
                                      train.optim.create_schedule(config.optimizer, 1))
    state = train.create_train_state(jax.random.key(0), model, tx, (32, 32, 3))
    results = []
    for batch_size in (500, 300, 7):
        arrays = train.batch_for_eval(dataset.x_test, dataset.y_test, batch_size)
        assert int(arrays[2].sum()) == 500
        results.append(train.evaluate(state, *arrays, mean=(0.5,), std=(0.25,), tta="flip",
                                      pad_mode="reflect"))
    for other in results[1:]:
        assert float(other["accuracy"]) == pytest.approx(float(results[0]["accuracy"]))
        assert float(other["loss"]) == pytest.approx(float(results[0]["loss"]), rel=1e-5)


def test_plan_chunks_never_cross_an_epoch():
    assert train.plan_chunks(7, 3, 2) == [(0, 0, 2), (0, 2, 1), (1, 0, 2), (1, 2, 1), (2, 0, 1)]
    assert train.plan_chunks(6, 3, 0) == [(0, 0, 3), (1, 0, 3)]


@pytest.mark.parametrize("key,value,message", [
    ("train__precision", "float16", "config.train.precision='float16'"),
    ("eval__tta", "rotate", "config.eval.tta='rotate'"),
    ("train__batch_size", 0, "config.train.batch_size=0"),
    ("train__batch_size", 4000, "larger than the training split"),
    ("data__mean", (0.5, 0.5), "config.data.mean=(0.5, 0.5)"),
    ("model__stem_init", "pca", "config.model.stem_init='pca'"),
    ("model__stem_width", 7, "config.model.stem_width=7: a whitened stem needs an even width"),
])
def test_bad_config_values_name_the_key(cifar_batches_dir, tmp_path, key, value, message):
    config = small_config(cifar_batches_dir, **{"model__stem_init": "whiten", key: value})
    with pytest.raises(train.ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        train.train_and_evaluate(config, str(tmp_path))


def test_a_whitened_stem_stays_fixed_while_the_rest_trains(cifar_batches_dir, tmp_path):
    config = small_config(cifar_batches_dir, model__stem_init="whiten", model__stem_width=8,
                          train__num_epochs=1, eval__tta="none")
    run = train.setup(config)
    initial = jax.device_get(run.state.params)
    np.testing.assert_array_equal(initial["Conv_0"]["kernel"], run.stem_kernel)
    summary = train.train_and_evaluate(config, str(tmp_path))
    assert summary["test_accuracy"] > 0.15
    trained = jaxtrain.restore(str(tmp_path)).state.params  # the optimiser state restores too
    np.testing.assert_array_equal(trained["Conv_0"]["kernel"], run.stem_kernel)
    assert not np.allclose(trained["Conv_0"]["bias"], initial["Conv_0"]["bias"])
    assert not np.allclose(trained["Dense_0"]["kernel"], initial["Dense_0"]["kernel"])
