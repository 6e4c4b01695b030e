"""Checkpoints: exact resume (after SIGKILL and SIGTERM), restore for evaluation, faults."""
import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
import quick_compile
from conftest import once_per_session
from tolerances import ELEMENTWISE, NETWORK_PASS
import fork_server
from overrides import with_overrides

import jaxtrain
from configs import cifar_seed_cnn
from jaxtrain import evaluate
from jaxtrain.run import loop
from jaxtrain.runtime import report
from jaxtrain.training import checkpoint

pytestmark = pytest.mark.usefixtures("compile_quickly")  # conftest.py

REPO = Path(__file__).resolve().parents[1]


def small_config(data_dir, **overrides):
    """seed_cnn with BatchNorm and augmentation on the 2,000-image subset: 40 steps an epoch."""
    config = cifar_seed_cnn.get_config()
    config.data.dir = str(data_dir)
    config.data.source = "files"
    config.model.batch_norm = True
    config.augment.flip = True
    config.augment.translate = 2
    config.train.batch_size = 50
    config.train.num_steps = 40
    config.train.log_every_steps = 10
    config.checkpoint.every_steps = 10
    config.eval.batch_size = 250
    return with_overrides(config, overrides)


def steps_saved(workdir):
    return sorted(int(p.name) for p in (Path(workdir) / "checkpoints").iterdir() if p.name.isdigit())


@pytest.fixture(scope="module")
def reference(cifar_batches_dir, tmp_path_factory, worker_id):
    """An uninterrupted 40-step run (the summary train_and_evaluate returned)."""
    return once_per_session(tmp_path_factory, worker_id, "checkpoint_reference",
                            lambda workdir: loop.train_and_evaluate(
                                small_config(cifar_batches_dir), str(workdir)))


@pytest.mark.slow
def test_a_run_saves_checkpoints_and_a_params_hash(reference):
    workdir, summary = reference
    assert steps_saved(workdir) == [20, 30, 40]  # checkpoint.keep = 3
    assert len(summary["params_sha256"]) == 64
    meta = json.loads((workdir / "checkpoints" / "40" / "meta" / "metadata").read_text())
    assert (meta["step"], meta["epoch"], meta["step_in_epoch"]) == (40, 1, 0)
    assert meta["class_names"][0] == "airplane" and len(meta["mean"]) == 3


@pytest.mark.slow
def test_resume_from_an_older_checkpoint_ends_where_the_uninterrupted_run_did(
        reference, cifar_batches_dir, tmp_path):
    ref_dir, ref = reference
    first = loop.train_and_evaluate(small_config(cifar_batches_dir, train__num_steps=20),
                                     str(tmp_path))
    assert first["params_sha256"] != ref["params_sha256"]
    resumed = loop.train_and_evaluate(small_config(cifar_batches_dir), str(tmp_path))
    assert resumed["resumed_from_step"] == 20
    assert resumed["params_sha256"] == ref["params_sha256"]
    assert (resumed["test_accuracy"], resumed["test_loss"], resumed["train_loss"]) == (
        ref["test_accuracy"], ref["test_loss"], ref["train_loss"])
    def train_losses(workdir):
        return [(r["step"], r["train_loss"]) for r in report.read_metrics(str(workdir))]

    assert train_losses(tmp_path) == train_losses(ref_dir)


def damage_and_stop(cifar_batches_dir, workdir, step: int, how: str, **overrides) -> None:
    """Checkpoint `step`'s state files cut in half ('truncate') or deleted; the next start
    (small_config with `overrides`) stops naming it, the error and the older steps, with
    nothing on disk changed."""
    files = [p for p in (workdir / "checkpoints" / str(step) / "state").rglob("*")
             if p.is_file() and p.stat().st_size > 0]
    assert files
    for path in files:
        if how == "truncate":
            path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
        else:
            path.unlink()
    before = sorted(str(p.relative_to(workdir)) for p in workdir.rglob("*"))
    older = [s for s in steps_saved(workdir) if s < step]
    with pytest.raises(jaxtrain.CheckpointError) as stopped:
        loop.train_and_evaluate(small_config(cifar_batches_dir, **overrides), str(workdir))
    assert re.fullmatch(
        rf"checkpoint {workdir}/checkpoints/{step} cannot be read \(\w+: .+\); nothing was "
        rf"deleted; the older checkpoints on disk are steps {', '.join(map(str, older))}: "
        rf"--config.checkpoint.resume_step={older[-1]} resumes from the newest of them \(the "
        r"newer ones are moved aside, not deleted\)", str(stopped.value)), str(stopped.value)
    assert sorted(str(p.relative_to(workdir)) for p in workdir.rglob("*")) == before
    # The failed start let go of the workdir, though its traceback (`stopped`) lives on:
    # another process may take it.
    subprocess.run([sys.executable, "-c", "import fcntl, sys; fcntl.lockf(open(sys.argv[1], "
                    "'a+'), fcntl.LOCK_EX | fcntl.LOCK_NB)", str(workdir / checkpoint.LOCK_FILE)],
                   check=True, timeout=60)


def test_a_workdir_is_held_by_one_run_at_a_time_in_a_process_too(tmp_path):
    """Two runs of one process in one workdir (the second in a thread): the second is
    refused, as one of another process is (the OS lock does not tell a process's own runs
    apart), and letting go as a refused run does frees nothing; once the first lets go,
    another process may take the workdir."""
    import threading

    def taken_elsewhere() -> bool:
        return subprocess.run(
            [sys.executable, "-c", "import fcntl, sys; fcntl.lockf(open(sys.argv[1], 'a+'), "
             "fcntl.LOCK_EX | fcntl.LOCK_NB)", str(tmp_path / checkpoint.LOCK_FILE)],
            capture_output=True, timeout=60).returncode == 0

    def second_run(refusals):
        try:
            checkpoint.hold_workdir(str(tmp_path))
        except jaxtrain.ConfigError as error:
            refusals.append(str(error))
        finally:
            checkpoint.let_go(str(tmp_path))  # what run_checked does when start fails

    checkpoint.hold_workdir(str(tmp_path))
    refusals = []
    thread = threading.Thread(target=second_run, args=(refusals,))
    thread.start()
    thread.join()
    assert refusals == [f"{tmp_path} is in use by another run of this process: wait for it "
                        "to end, or use another workdir"]
    assert not taken_elsewhere()
    checkpoint.let_go(str(tmp_path))
    assert taken_elsewhere()


@pytest.mark.slow
def test_a_damaged_newest_checkpoint_stops_the_run_until_an_older_one_is_chosen(
        reference, cifar_batches_dir, tmp_path):
    """A listed checkpoint that cannot be read is damage to report, not to skip: the run
    stops naming it, the error and the older steps, and deletes nothing; resuming from an
    older one is the user's choice (checkpoint.resume_step), which moves the newer ones
    aside and ends where the uninterrupted run did. Its files cut in half, then (the
    run's last checkpoint) deleted."""
    _, ref = reference
    loop.train_and_evaluate(small_config(cifar_batches_dir, train__num_steps=30), str(tmp_path))
    damage_and_stop(cifar_batches_dir, tmp_path, 30, "truncate")
    resumed = loop.train_and_evaluate(small_config(cifar_batches_dir,
                                                   checkpoint__resume_step=20), str(tmp_path))
    assert resumed["resumed_from_step"] == 20
    assert resumed["params_sha256"] == ref["params_sha256"]
    assert (tmp_path / checkpoint.SET_ASIDE_DIR / "30" / "state").is_dir()
    damage_and_stop(cifar_batches_dir, tmp_path, 40, "delete",  # the finished run made longer
                    train__num_steps=50)


@pytest.mark.slow
def test_arrays_cut_short_are_one_line_in_a_real_process(reference, tmp_path):
    """A checkpoint whose array files were cut short (a disk filled, a copy stopped) with its
    metadata whole: Orbax raises a bare Exception around TensorStore's error, and the
    reads of the other arrays still end after it, each reporting a closed event loop.
    main.py --mode=eval says it in one line (exit 1) and changes nothing on disk."""
    workdir = tmp_path / "run"
    shutil.copytree(reference[0], workdir)
    arrays = [p for p in (workdir / "checkpoints" / "40" / "state").rglob("*")
              if p.is_file() and p.parent.name == "d"]
    assert len(arrays) > 1
    for path in arrays:
        path.write_bytes(path.read_bytes()[:100])
    before = {str(p): p.stat().st_size for p in workdir.rglob("*")}
    done = fork_server.run([sys.executable, "main.py", "--mode=eval", f"--workdir={workdir}"],
                           cwd=REPO, env=quick_compile.env(1), capture_output=True, text=True,
                           timeout=300)
    assert done.returncode == 1, done.stderr[-3000:]
    assert re.fullmatch(
        rf"error: checkpoint {workdir}/checkpoints/40 cannot be read \(ValueError: .+\); "
        r"nothing was deleted; the older checkpoints on disk are steps 20, 30: "
        r"--checkpoint=30 evaluates the newest of them\n", done.stderr), done.stderr[-3000:]
    assert {str(p): p.stat().st_size for p in workdir.rglob("*")} == before


@pytest.mark.slow
def test_a_checkpoint_of_another_model_stops_before_training(cifar_batches_dir, tmp_path):
    """A BatchNorm MLP whose second layer is made wider (the model is not what is checked:
    the recipe's record and the checkpoint's shapes are)."""
    config = small_config(cifar_batches_dir, model__name="mlp", model__hidden_sizes=(8, 8),
                          train__num_steps=10)
    loop.train_and_evaluate(config, str(tmp_path))
    before = (tmp_path / "metrics.jsonl").read_text()
    config.model.hidden_sizes = (8, 16)
    with pytest.raises(jaxtrain.ConfigError, match=r"another recipe \(model.hidden_sizes: "
                                                   r"\(8, 8\) -> \(8, 16\)\)"):
        loop.train_and_evaluate(config, str(tmp_path))  # config.json tells, before loading
    # Told to go on regardless, the checkpoint itself does not fit: it says where.
    config.checkpoint.allow_recipe_change = True
    with pytest.raises(jaxtrain.CheckpointError,
                       match=r"'params/BatchNorm_1/bias' has shape \(8,\) there "
                             r"and \(16,\) here"):
        loop.train_and_evaluate(config, str(tmp_path))
    with pytest.raises(jaxtrain.CheckpointError, match="different model"):
        loop.train_and_evaluate(small_config(cifar_batches_dir, model__batch_norm=False,
                                              checkpoint__allow_recipe_change=True),
                                 str(tmp_path))  # seed_cnn: its convolutions are not there
    assert (tmp_path / "metrics.jsonl").read_text() == before
    assert steps_saved(tmp_path) == [10]


@pytest.mark.slow
def test_a_checkpoint_of_another_optimiser_restores_its_weights_and_resumes_with_it_only(
        cifar_batches_dir, cifar_subset, tmp_path):
    """An adam run whose config.json then records another optimiser ('sgd', whose state
    is a momentum trace; an optimiser passed from Python, which no process can rebuild):
    jaxtrain.restore reads the weights alone, the same logits. Resuming with another
    optimizer.name is one line naming both, before anything is loaded, recipe change
    allowed or not; with the recorded name but another optimiser's state in the
    checkpoint, the restore says the optimiser state is what differs, not the model."""
    config = small_config(cifar_batches_dir, model__name="mlp", model__hidden_sizes=(16,),
                          train__num_steps=10, optimizer__name="adam",
                          optimizer__learning_rate=1e-3)
    loop.train_and_evaluate(config, str(tmp_path))
    images = cifar_subset["x_test"][:50]

    def logits(classifier):
        return np.asarray(classifier.logits(classifier.state, images, "none"))

    own = logits(jaxtrain.restore(str(tmp_path)))
    saved = json.loads((tmp_path / checkpoint.CONFIG_FILE).read_text())

    def record_optimizer(name):
        saved["optimizer"]["name"] = name
        (tmp_path / checkpoint.CONFIG_FILE).write_text(json.dumps(saved))

    for recorded in ("sgd", "python:__main__:<lambda>"):
        record_optimizer(recorded)
        np.testing.assert_array_equal(logits(jaxtrain.restore(str(tmp_path))), own)

    before = (tmp_path / "metrics.jsonl").read_text()
    for allowed in (False, True):
        with pytest.raises(jaxtrain.ConfigError) as refused:
            loop.train_and_evaluate(
                with_overrides(config, {"checkpoint__allow_recipe_change": allowed}),
                str(tmp_path))
        assert str(refused.value) == (
            f"config.optimizer.name: the checkpoints in {tmp_path} were written with "
            "'python:__main__:<lambda>', this run uses 'adam'; the optimiser state they hold "
            "is 'python:__main__:<lambda>''s. Resume with the same optimiser (pass that "
            "optimiser to train_and_evaluate(optimizer=...) again), or use another --workdir "
            f"(--config.model.init_from={tmp_path} starts a new run from its weights)")

    record_optimizer("sgd")  # as if the same name now built another optimiser
    longer = with_overrides(config, {"optimizer__name": "sgd", "train__num_steps": 20,
                                     "checkpoint__allow_recipe_change": False})
    with pytest.raises(checkpoint.OptimizerStateMismatch, match=(
            rf"^checkpoint {tmp_path}/checkpoints/10: its optimiser state does not match this "
            r"run's optimiser \(config.optimizer.name='sgd'\): it has no 'opt_state/[^']+'; "
            r"its weights fit the model. Resume with the optimiser that wrote it \(pass the "
            r"same one again\), or use another workdir$")):
        loop.train_and_evaluate(longer, str(tmp_path))
    assert (tmp_path / "metrics.jsonl").read_text() == before
    assert steps_saved(tmp_path) == [10]


PLAIN_MLP = {"model__name": "mlp", "model__hidden_sizes": (16,), "model__batch_norm": False}


@pytest.mark.slow
def test_non_finite_loss_keeps_the_last_good_checkpoint(cifar_batches_dir, tmp_path):
    """An MLP without BatchNorm (nothing holds its activations back) at lr 1e12."""
    loop.train_and_evaluate(small_config(cifar_batches_dir, train__num_steps=10, **PLAIN_MLP),
                            str(tmp_path))
    config = small_config(cifar_batches_dir, optimizer__learning_rate=1e12,
                          checkpoint__allow_recipe_change=True, **PLAIN_MLP)
    with pytest.raises(jaxtrain.TrainingError, match=r"non-finite training loss at step \d+"):
        loop.train_and_evaluate(config, str(tmp_path))
    assert steps_saved(tmp_path) == [10]
    classifier = jaxtrain.restore(str(tmp_path))
    assert classifier.step == 10
    assert all(np.isfinite(leaf).all() for leaf in jax.tree_util.tree_leaves(classifier.state.params))


@pytest.mark.slow
def test_skip_policy_skips_non_finite_steps(cifar_batches_dir, tmp_path):
    config = small_config(cifar_batches_dir, optimizer__learning_rate=1e12,
                          train__nonfinite="skip", train__num_steps=20, **PLAIN_MLP)
    summary = loop.train_and_evaluate(config, str(tmp_path))
    assert summary["steps"] == 20
    skipped = sum(r.get("skipped_steps", 0) for r in report.read_metrics(str(tmp_path)))
    assert skipped > 0


def test_a_workdir_that_cannot_hold_checkpoints_is_a_clear_error(cifar_batches_dir, tmp_path):
    (tmp_path / "checkpoints").write_text("not a directory")
    with pytest.raises(jaxtrain.CheckpointError, match="not a directory"):
        loop.train_and_evaluate(small_config(cifar_batches_dir), str(tmp_path))
    with pytest.raises(jaxtrain.CheckpointError, match=f"^cannot write in the workdir "
                       f"{tmp_path}/checkpoints: a file is there, not a folder$"):
        loop.train_and_evaluate(small_config(cifar_batches_dir), str(tmp_path / "checkpoints"))


@pytest.mark.slow
def test_disk_full_during_save_is_a_clear_error_and_keeps_earlier_checkpoints(
        cifar_batches_dir, tmp_path, monkeypatch):
    real_save = ocp.CheckpointManager.save

    def save_until_full(self, step, *args, **kwargs):
        if step > 20:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_save(self, step, *args, **kwargs)

    monkeypatch.setattr(ocp.CheckpointManager, "save", save_until_full)
    with pytest.raises(jaxtrain.CheckpointError, match="step 30.*No space left on device"):
        loop.train_and_evaluate(small_config(cifar_batches_dir), str(tmp_path))
    monkeypatch.undo()
    assert steps_saved(tmp_path) == [10, 20]
    assert jaxtrain.restore(str(tmp_path)).step == 20


@pytest.mark.slow
def test_eval_mode_reports_what_the_run_recorded(reference, cifar_batches_dir, cifar_subset):
    workdir, _ = reference
    recorded = {r["step"]: r for r in report.read_metrics(str(workdir)) if "test_loss" in r}
    config = small_config(cifar_batches_dir)
    newest = evaluate.evaluate_checkpoint(config, str(workdir))
    assert newest["step"] == 40
    assert newest["test_accuracy"] == pytest.approx(recorded[40]["test_accuracy"],
                                                    abs=ELEMENTWISE)  # the same count of 500
    assert newest["test_loss"] == pytest.approx(recorded[40]["test_loss"], rel=ELEMENTWISE)
    older = evaluate.evaluate_checkpoint(config, str(workdir),
                                                    str(workdir / "checkpoints" / "20"))
    assert older["step"] == 20  # not evaluated during the run: compare with the restore API
    labels, _ = jaxtrain.restore(str(workdir), step=20).predict(cifar_subset["x_test"])
    assert older["test_accuracy"] == pytest.approx(np.mean(labels == cifar_subset["y_test"]),
                                                   abs=ELEMENTWISE)
    assert older["test_accuracy"] != newest["test_accuracy"]


@pytest.mark.slow
def test_restore_api_classifies_uint8_images(reference, cifar_subset):
    workdir, summary = reference
    classifier = jaxtrain.restore(str(workdir))
    assert classifier.step == 40 and classifier.class_names[1] == "automobile"
    labels, probabilities = classifier.predict(cifar_subset["x_test"])
    assert labels.shape == (500,) and probabilities.shape == (500, 10)
    np.testing.assert_allclose(probabilities.sum(axis=1), 1.0, rtol=NETWORK_PASS)
    accuracy = float(np.mean(labels == cifar_subset["y_test"]))
    assert accuracy == pytest.approx(summary["test_accuracy"], abs=ELEMENTWISE)
    with pytest.raises(ValueError, match="uint8"):
        classifier.predict(cifar_subset["x_test"].astype(np.float32))


@pytest.mark.slow
def test_plain_orbax_restores_the_parameters(reference):
    workdir, _ = reference
    snippet = (
        "import sys, numpy as np, orbax.checkpoint as ocp\n"
        "tree = ocp.StandardCheckpointer().restore(sys.argv[1] + '/checkpoints/40/state')\n"
        "params = tree['params']\n"
        "np.savez(sys.argv[1] + '/plain.npz', kernel=np.asarray(params['Conv_0']['kernel']))\n"
        "assert 'jaxtrain' not in sys.modules\n")
    subprocess.run([sys.executable, "-c", snippet, str(workdir)], check=True, timeout=300)
    kernel = np.load(workdir / "plain.npz")["kernel"]
    expected = jaxtrain.restore(str(workdir)).state.params["Conv_0"]["kernel"]
    np.testing.assert_array_equal(kernel, np.asarray(expected))


# ---------------------------------------------------------------- real processes, real signals

LONG_RUN = ["--config=configs/cifar_seed_cnn.py", "--config.data.source=files",
            "--config.model.batch_norm=True", "--config.augment.flip=True",
            "--config.train.batch_size=4", "--config.train.num_steps=1500",
            "--config.train.log_every_steps=50", "--config.checkpoint.every_steps=250",
            "--config.eval.every_epochs=0"]  # 500 steps an epoch


def start_main(workdir, data_dir, run=LONG_RUN):
    """main.py with `run`'s flags in a child process, at -O1."""
    return fork_server.Popen([sys.executable, "main.py", f"--workdir={workdir}", *run,
                             f"--config.data.dir={data_dir}"], cwd=REPO, env=quick_compile.env(1),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_step(workdir, step, process, timeout=300):
    deadline = time.time() + timeout
    metrics = Path(workdir) / "metrics.jsonl"
    while time.time() < deadline:
        assert process.poll() is None, process.communicate()
        if metrics.exists() and any(r["step"] >= step for r in report.read_metrics(str(workdir))):
            return
        time.sleep(0.05)
    raise AssertionError(f"step {step} not reached")


@pytest.fixture(scope="module")
def long_reference(cifar_batches_dir, tmp_path_factory, worker_id):
    def run(workdir):
        process = start_main(workdir, cifar_batches_dir)
        out, err = process.communicate(timeout=600)
        assert process.returncode == 0, err
        return json.loads((workdir / "summary.json").read_text())
    return once_per_session(tmp_path_factory, worker_id, "long_reference", run)[1]


@pytest.mark.slow
def test_sigkill_then_rerun_is_bit_identical(long_reference, cifar_batches_dir, tmp_path):
    process = start_main(tmp_path, cifar_batches_dir)
    wait_for_step(tmp_path, 650, process)  # the test's arbitrary point: past two checkpoints
    second = start_main(tmp_path, cifar_batches_dir)  # the same workdir, while it trains
    out, err = second.communicate(timeout=300)
    assert second.returncode == 2, err
    assert re.fullmatch(rf"error: {tmp_path} is in use by another run \(process {process.pid} "
                        r"on [^,]+, since [0-9: -]+\): wait for it to end, or use another "
                        r"--workdir\n", err), err
    process.kill()  # the rerun below holds the workdir: the killed run left it free
    process.wait()
    assert not (tmp_path / "summary.json").exists()
    rerun = start_main(tmp_path, cifar_batches_dir)
    out, err = rerun.communicate(timeout=600)
    assert rerun.returncode == 0, err
    assert "resumed from checkpoint step" in out
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["resumed_from_step"] >= 500
    assert summary["params_sha256"] == long_reference["params_sha256"]
    for key in ("test_accuracy", "test_loss", "train_loss", "steps"):
        assert summary[key] == long_reference[key], key
    assert [r["step"] for r in report.read_metrics(str(tmp_path))] == list(range(50, 1501, 50))


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_and_sigint_save_and_exit_with_a_message(long_reference, cifar_batches_dir,
                                                         tmp_path, signum):
    process = start_main(tmp_path, cifar_batches_dir)
    wait_for_step(tmp_path, 350, process)
    process.send_signal(signum)
    out, err = process.communicate(timeout=300)
    assert process.returncode == 128 + signum
    assert f"interrupted by {signal.Signals(signum).name} at step" in err
    stopped_at = int(err.split("at step ")[1].split(";")[0])
    assert stopped_at in steps_saved(tmp_path)
    if signum == signal.SIGINT:  # the same handler: resuming it is SIGTERM's (and SIGKILL's) test
        return
    rerun = start_main(tmp_path, cifar_batches_dir)
    out, err = rerun.communicate(timeout=600)
    assert rerun.returncode == 0, err
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["resumed_from_step"] == stopped_at
    assert summary["params_sha256"] == long_reference["params_sha256"]


# ---------------------------------------------------------------- the best checkpoint

@pytest.mark.slow
def test_the_best_checkpoint_is_kept_and_restored_while_resume_takes_the_newest(
        cifar_batches_dir, cifar_subset, tmp_path):
    """A constant, high learning rate: the test accuracy peaks before the last step. The
    run keeps the newest checkpoint and the best by test_accuracy (Orbax's BestN)."""
    config = small_config(cifar_batches_dir, optimizer__learning_rate=0.3, train__num_steps=80,
                          checkpoint__every_steps=0, checkpoint__every_epochs=0,
                          checkpoint__keep=1, checkpoint__best_metric="test_accuracy",
                          eval__every_steps=10)
    summary = loop.train_and_evaluate(config, str(tmp_path))
    points = {r["step"]: r["test_accuracy"] for r in report.read_metrics(str(tmp_path))
              if "test_accuracy" in r}
    best = max(points, key=lambda step: (points[step], -step))  # the first of equal ones
    assert best < 80, points  # the test means something only if the peak is earlier
    assert summary["best_checkpoint"]["step"] == best
    assert summary["best_checkpoint"]["test_accuracy"] == points[best]
    assert steps_saved(tmp_path) == sorted({best, 80})  # the best and the newest
    restored = jaxtrain.restore(str(tmp_path), which="best")
    assert restored.step == best
    labels, _ = restored.predict(cifar_subset["x_test"])
    assert np.mean(labels == cifar_subset["y_test"]) == pytest.approx(points[best],
                                                                      abs=ELEMENTWISE)
    assert jaxtrain.restore(str(tmp_path)).step == 80
    # --checkpoint=best
    evaluated = evaluate.evaluate_checkpoint(config, str(tmp_path), "best")
    assert evaluated["step"] == best
    assert evaluated["test_accuracy"] == pytest.approx(points[best], abs=ELEMENTWISE)
    # docs/checkpoints.md's command as typed: no --config, the run's config.json is read
    # (compiled as this module compiles the run: JAX's jax_disable_most_optimizations)
    done = fork_server.run([sys.executable, "main.py", "--mode=eval", f"--workdir={tmp_path}",
                           "--checkpoint=best"], cwd=REPO, capture_output=True, text=True,
                           timeout=300, env=dict(os.environ, JAX_DISABLE_MOST_OPTIMIZATIONS="1"))
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"checkpoint step {best}: test_accuracy={points[best]:.2%}" in done.stdout
    # Resuming with more steps starts from the newest, not the best.
    longer = with_overrides(config, {"train__num_steps": 90})
    assert loop.train_and_evaluate(longer, str(tmp_path))["resumed_from_step"] == 80


@pytest.mark.slow
def test_which_best_needs_a_best_metric(reference):
    workdir, _ = reference
    with pytest.raises(ValueError, match=r"^which='best': the run in .* kept no best checkpoint"):
        jaxtrain.restore(str(workdir), which="best")


# ---------------------------------------------------------------- paths, finished runs

@pytest.mark.slow
def test_relative_paths_are_kept_absolute_and_a_finished_run_says_so(
        cifar_subset, tmp_path, monkeypatch, capsys):
    """data.dir typed relative ('data/cifar.npz' from A) is stored absolute, so a rerun
    from elsewhere (B, another relative path to the same file) finds the run complete in
    one line, without a table or an evaluation; --mode=eval from B needs no data.dir;
    data that moved is said so and resumed."""
    (tmp_path / "A" / "data").mkdir(parents=True)
    (tmp_path / "B").mkdir()
    np.savez(tmp_path / "A" / "data" / "cifar.npz", x_train=cifar_subset["x_train"][:64],
             y_train=cifar_subset["y_train"][:64], x_test=cifar_subset["x_test"][:32],
             y_test=cifar_subset["y_test"][:32])
    workdir = str(tmp_path / "run")

    def run(cwd, data_dir, steps=4):
        monkeypatch.chdir(cwd)
        config = small_config(data_dir, data__name="arrays", data__source="auto",
                              train__num_steps=steps, train__batch_size=16)
        summary = loop.train_and_evaluate(config, workdir)
        return summary, capsys.readouterr().out

    first, _ = run(tmp_path / "A", "data/cifar.npz")
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["data"]["dir"] == str(tmp_path / "A" / "data" / "cifar.npz")

    again, out = run(tmp_path / "B", "../A/data/cifar.npz")
    assert out.strip() == (
        f"the run in {workdir} is complete: step 4 of 4, test accuracy "
        f"{first['test_accuracy']:.2%}; its summary is {workdir}/summary.json (--mode=eval "
        "evaluates it again; another --workdir starts a new run)")
    assert again == json.loads((tmp_path / "run" / "summary.json").read_text())

    monkeypatch.chdir(tmp_path / "B")  # --mode=eval: the run's own config, nothing given
    metrics = evaluate.evaluate_checkpoint(evaluate.run_config(workdir),
                                                      workdir)
    assert metrics["test_accuracy"] == pytest.approx(first["test_accuracy"])

    (tmp_path / "A" / "data").rename(tmp_path / "A" / "moved")
    resumed, out = run(tmp_path / "B", "../A/moved/cifar.npz", steps=6)
    assert (f"data.dir moved: the checkpoints' run read {tmp_path / 'A' / 'data' / 'cifar.npz'}"
            f" (no longer there); resuming with {tmp_path / 'A' / 'moved' / 'cifar.npz'}") in out
    assert resumed["steps"] == 6 and resumed["resumed_from_step"] == 4


@pytest.mark.slow
def test_a_finished_run_trains_on_for_more_epochs_as_the_command_asks(cifar_batches_dir,
                                                                      tmp_path):
    """The user's command again with more epochs: a finished run (a linear-decay schedule,
    which the length changes; here trained in this process, as the command would) trains
    on from its last step, saying what that means; a shorter length, or any other change,
    is still refused."""
    from configs import fashion_mnist_mlp
    first = fashion_mnist_mlp.get_config()
    first.data.name, first.data.dir, first.data.source = "cifar10", str(cifar_batches_dir), "files"
    first.model.hidden_sizes, first.train.num_epochs = (16,), 1
    first.train.batch_size, first.eval.batch_size = 200, 250
    assert loop.train_and_evaluate(first, str(tmp_path / "run"))["steps"] == 10
    command = [sys.executable, "main.py", "--config=configs/fashion_mnist_mlp.py",
               f"--workdir={tmp_path / 'run'}", "--config.data.name=cifar10",
               f"--config.data.dir={cifar_batches_dir}", "--config.data.source=files",
               "--config.model.hidden_sizes=(16,)", "--config.train.batch_size=200",
               "--config.eval.batch_size=250"]
    longer = fork_server.run([*command, "--config.train.num_epochs=2"], cwd=REPO,
                             env=quick_compile.env(0), capture_output=True, text=True, timeout=300)
    assert longer.returncode == 0, longer.stderr[-2000:]
    assert f"extending the finished run in {tmp_path / 'run'} (step 10) to 2 epochs: the " \
        "learning-rate schedule is the new length's from here on" in longer.stdout
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 20 and summary["resumed_from_step"] == 10
    shorter = fork_server.run([*command, "--config.train.num_epochs=1"], cwd=REPO,
                              env=quick_compile.env(0), capture_output=True, text=True, timeout=300)
    assert shorter.returncode == 2
    assert "holds checkpoints of another recipe (train.num_epochs: 2 -> 1)" in shorter.stderr


@pytest.mark.slow
def test_early_stopping_restores_the_best_weights_as_keras_does(cifar_batches_dir, tmp_path):
    """EarlyStopping(restore_best_weights=True) with checkpoint.best_metric=test_loss: the
    run ends with its best checkpoint's weights, and the summary has that evaluation's
    figures; without the best checkpoint it stops at the start with one line."""
    from jaxtrain.callbacks import EarlyStopping
    config = small_config(cifar_batches_dir, optimizer__learning_rate=0.3, train__num_steps=80,
                          checkpoint__every_steps=0, checkpoint__every_epochs=0,
                          checkpoint__keep=1, checkpoint__best_metric="test_loss",
                          eval__every_steps=10)
    stop = EarlyStopping(monitor="test_loss", patience=3, restore_best_weights=True)
    summary = loop.train_and_evaluate(config, str(tmp_path / "run"), callbacks=[stop])
    points = {r["step"]: r for r in report.read_metrics(str(tmp_path / "run"))
              if "test_loss" in r}
    best = min(points, key=lambda step: (points[step]["test_loss"], step))
    assert summary["restored_best_weights"] == {"step": best} and best < max(points), points
    assert summary["test_loss"] == points[best]["test_loss"]
    assert summary["test_accuracy"] == points[best]["test_accuracy"]
    from jaxtrain.training import checkpoint
    assert summary["params_sha256"] == checkpoint.params_sha256(
        jaxtrain.restore(str(tmp_path / "run"), which="best").state)
    with pytest.raises(jaxtrain.TrainingError,
                       match=r"restore_best_weights=True restores the best checkpoint by "
                       r"test_loss: set --config\.checkpoint\.best_metric="
                       r"test_loss \(it is ''\)"):
        loop.train_and_evaluate(with_overrides(config, {"checkpoint__best_metric": ""}),
                                str(tmp_path / "other"), callbacks=[
                                    EarlyStopping(restore_best_weights=True)])


@pytest.mark.slow
def test_a_resume_step_that_is_not_on_disk_names_those_that_are(reference, cifar_batches_dir,
                                                                tmp_path):
    workdir, _ = reference
    import shutil
    shutil.copytree(workdir / "checkpoints", tmp_path / "checkpoints")
    shutil.copy(workdir / "config.json", tmp_path / "config.json")
    with pytest.raises(jaxtrain.CheckpointError, match=(
            r"^config\.checkpoint\.resume_step=25: no such checkpoint in .*/checkpoints \(the "
            r"steps on disk: 20, 30, 40\)$")):
        loop.train_and_evaluate(small_config(cifar_batches_dir, checkpoint__resume_step=25,
                                             train__num_steps=50), str(tmp_path))
    assert steps_saved(tmp_path) == [20, 30, 40]
