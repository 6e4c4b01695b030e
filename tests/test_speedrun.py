"""The record recipe (configs/cifar_speedrun.py) end to end on a narrow cifar_cnn:
the benchmark's run is main.py's run, and it resumes exactly."""
import io
import shutil

import pytest

from configs import cifar_speedrun
from jaxtrain import bench, loop
from overrides import with_overrides

SEED = 3


def narrow_speedrun(data_dir, **overrides):
    """The whole speedrun recipe (groups, Muon + renormalisation, stem bias for its first
    15 steps, Dirac init, alternating flip, partial TTA) at batch 200 on the 2,000-image
    subset: 10 steps an epoch, 30 steps, float32."""
    config = cifar_speedrun.get_config()
    config.data.dir, config.data.source = str(data_dir), "files"
    config.model.widths, config.model.stem_width = (8, 16, 16), 12
    config.train.batch_size, config.train.num_steps = 200, 30
    config.train.precision, config.train.loop = "float32", "scan"
    for name in ("norm_biases", "stem_bias", "head"):  # the recipe's rates are for batch 2000
        config.optimizer.groups[name].lr_scale /= 10
    config.optimizer.groups.stem_bias.train_steps = 15
    config.eval.batch_size, config.eval.tta_fraction = 250, 0.5
    config.seed = SEED
    return with_overrides(config, overrides)


@pytest.fixture(scope="module")
def main_run(cifar_batches_dir, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("speedrun")
    config = narrow_speedrun(cifar_batches_dir, checkpoint__every_steps=10)
    return workdir, loop.train_and_evaluate(config, str(workdir))


def test_a_benchmark_run_of_the_record_recipe_is_main_py_s_run(cifar_batches_dir, main_run):
    _, summary = main_run
    assert summary["test_accuracy"] > 0.15  # it learns: chance is 0.1
    result = bench.benchmark(narrow_speedrun(cifar_batches_dir), runs=1, warmup=0,
                             first_seed=SEED, stream=io.StringIO())
    run = result["runs"][0]
    assert run["test_accuracy"] == pytest.approx(summary["test_accuracy"], abs=1e-5)
    assert run["test_loss"] == pytest.approx(summary["test_loss"], abs=1e-5)
    assert run["nonfinite_steps"] == 0


def test_the_record_recipe_resumes_exactly(cifar_batches_dir, main_run, tmp_path):
    reference_dir, reference = main_run
    shutil.copytree(reference_dir / "checkpoints", tmp_path / "checkpoints")
    for step in ("20", "30"):  # as if killed after step 10's checkpoint
        shutil.rmtree(tmp_path / "checkpoints" / step)
    config = narrow_speedrun(cifar_batches_dir, checkpoint__every_steps=10)
    resumed = loop.train_and_evaluate(config, str(tmp_path))
    assert resumed["resumed_from_step"] == 10
    assert resumed["params_sha256"] == reference["params_sha256"]
    assert resumed["test_accuracy"] == reference["test_accuracy"]
