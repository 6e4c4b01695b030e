"""The record recipe (configs/cifar_speedrun.py) end to end on a narrow cifar_cnn:
the benchmark's run is main.py's run, and it resumes exactly; with
train.drop_finished_groups, the programs after the stem bias's last step drop its
gradient and end with the same weights."""
import io
import re
import shutil
import types

import jax
import numpy as np
import pytest
from conftest import once_per_session
from tolerances import NETWORK_PASS
from overrides import with_overrides

from configs import cifar_speedrun
from jaxtrain.perf import benchmark, hlo
from jaxtrain.run import loop, start
from jaxtrain.run import plan as plan_lib
from jaxtrain.training import checkpoint, placement, prepare

SEED = 3

# every test here trains or compiles the recipe; at XLA's usual level, since two of them
# compare two different programs' weights to the bit (conftest.py's compile_quickly)
pytestmark = pytest.mark.slow


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
def main_run(cifar_batches_dir, tmp_path_factory, worker_id):
    config = narrow_speedrun(cifar_batches_dir, checkpoint__every_steps=10)
    return once_per_session(tmp_path_factory, worker_id, "speedrun_main_run",
                            lambda workdir: loop.train_and_evaluate(config, str(workdir)))


def test_a_benchmark_run_of_the_record_recipe_is_main_py_s_run(cifar_batches_dir, main_run):
    _, summary = main_run
    assert summary["test_accuracy"] > 0.15  # it learns: chance is 0.1
    result = benchmark.benchmark(narrow_speedrun(cifar_batches_dir), runs=1, warmup=0,
                                 first_seed=SEED, stream=io.StringIO())
    run = result["runs"][0]
    assert run["test_accuracy"] == pytest.approx(summary["test_accuracy"], abs=NETWORK_PASS)
    assert run["test_loss"] == pytest.approx(summary["test_loss"], abs=NETWORK_PASS)
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


# ---------------------------------------------------------------- train.drop_finished_groups

def step_convolutions(hlo_text: str) -> list[int]:
    """The convolutions of each loop body that has any (a scanned chunk's step), its own
    and those of the fusions it calls: XLA:CPU fuses some convolutions with their
    neighbours (in bfloat16 all of them); oneDNN's and cuDNN's are library calls."""
    bodies, _ = hlo.computations(hlo_text)

    def convolutions(name):
        count = 0
        for instruction in bodies[name]:
            kind = hlo.kernel_kind(instruction)
            count += kind == "convolution" or (kind.startswith("custom-call") and "conv" in kind)
            if instruction.opcode == "fusion":
                count += convolutions(re.search(r"calls=%?([\w.\-]+)", instruction.text)[1])
        return count
    loops = [re.search(r"body=%?([\w.\-]+)", instruction.text)[1]
             for instructions in bodies.values() for instruction in instructions
             if instruction.opcode == "while"]
    return [count for count in map(convolutions, loops) if count]


def copy_run(source, target, keep_up_to: int):
    """`source`'s checkpoints up to step keep_up_to and its config.json, into `target`: a
    run killed after that checkpoint."""
    shutil.copytree(source / "checkpoints", target / "checkpoints")
    shutil.copy(source / checkpoint.CONFIG_FILE, target / checkpoint.CONFIG_FILE)
    for step in (target / "checkpoints").iterdir():
        if step.name.isdigit() and int(step.name) > keep_up_to:
            shutil.rmtree(step)


@pytest.fixture(scope="module")
def dropped_run(cifar_batches_dir, main_run, tmp_path_factory, worker_id):
    """main_run resumed from its step-10 checkpoint (before the stem bias's last step, 15)
    with train.drop_finished_groups=True, which may change on a resume (the same run)."""
    reference_dir, _ = main_run
    config = narrow_speedrun(cifar_batches_dir, checkpoint__every_steps=10,
                             train__drop_finished_groups=True)

    def run(workdir):
        copy_run(reference_dir, workdir, keep_up_to=10)
        return loop.train_and_evaluate(config, str(workdir))
    return once_per_session(tmp_path_factory, worker_id, "speedrun_dropped_run", run)


def test_dropping_the_finished_stem_bias_keeps_the_masked_run_s_weights(main_run, dropped_run):
    """Steps 16-30 compute no stem-bias gradient, where main_run computes it and the zero
    rate throws it away: the same weights to the bit on the CPU."""
    _, reference = main_run
    _, dropped = dropped_run
    assert dropped["resumed_from_step"] == 10
    assert dropped["params_sha256"] == reference["params_sha256"]
    assert dropped["test_accuracy"] == reference["test_accuracy"]


def test_a_dropped_run_resumes_exactly_after_the_cut(cifar_batches_dir, dropped_run, tmp_path):
    reference_dir, reference = dropped_run
    copy_run(reference_dir, tmp_path, keep_up_to=20)
    config = narrow_speedrun(cifar_batches_dir, checkpoint__every_steps=10,
                             train__drop_finished_groups=True)
    resumed = loop.train_and_evaluate(config, str(tmp_path))
    assert resumed["resumed_from_step"] == 20
    assert resumed["params_sha256"] == reference["params_sha256"]


def test_the_plan_and_the_programs_are_cut_at_the_stem_bias_s_last_step(cifar_batches_dir,
                                                                          dropped_run):
    """The chunk plan ends a chunk at step 15; the program after it has one convolution
    fewer: the first block's input gradient, which only the stem's bias needed (the
    whitened stem's kernel is frozen, so it never needed one). Compiled for the state's
    shapes (abstract_state: no initial weights computed), after dropped_run, which ran
    programs cut there."""
    config = narrow_speedrun(cifar_batches_dir, train__drop_finished_groups=True)
    run = prepare.setup(config, abstract_state=True)  # the programs need the state's shapes
    cuts = start.finished_group_cuts(config, run)
    assert cuts == {15: frozenset({"Conv_0/bias"})}
    assert start.finished_group_cuts(narrow_speedrun(cifar_batches_dir), run) == {}
    plan = plan_lib.plan_chunks(20, 10, start_step=10, breaks=tuple(cuts))
    assert plan == [(1, 0, 5), (1, 5, 5)]
    run_chunk = start.compile_training(config, run, run.state, run.data_key, plan, None,
                                      placement.put_train_data(run), cuts)
    (before,), (after,) = [step_convolutions(program.as_text())
                           for program in run_chunk.programs]
    assert after == before - 1 and after > 0


def test_the_benchmark_s_one_program_drops_the_gradient_after_the_cut(cifar_batches_dir,
                                                                       main_run):
    """benchmark.whole_run with train.drop_finished_groups: the epochs' scans split at step 15
    (mid-epoch: a partial epoch each side), the steps after it with one convolution fewer,
    and main_run's weights to the bit at the end (evaluation left out: it is dead code
    when only the weights are asked for)."""
    _, reference = main_run
    config = narrow_speedrun(cifar_batches_dir, train__drop_finished_groups=True)
    run = prepare.setup(config, abstract_state=True)
    x_train, y_train = placement.put_train_data(run)
    eval_arrays = placement.put_eval_data(config.eval.batch_size, run)
    whole_run = benchmark.whole_run_fn(config, run, with_weights=True)
    program = jax.jit(lambda *args: whole_run(*args)[1]).lower(
        np.int32(SEED), x_train, y_train, eval_arrays).compile()
    # epoch 0 and steps 11-15 before the cut, steps 16-20 and epoch 2 after it
    after, _, before, _ = steps = sorted(step_convolutions(program.as_text()))
    assert steps == [after, after, before, before] and after == before - 1
    weights = program(np.int32(SEED), x_train, y_train, eval_arrays)
    assert checkpoint.params_sha256(types.SimpleNamespace(**weights)) == reference[
        "params_sha256"]
