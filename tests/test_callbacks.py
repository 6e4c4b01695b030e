"""jaxtrain/callbacks/ and the loop's actions: user callbacks see every row and
evaluation once (also across a SIGKILL and resume), StopTraining and EarlyStopping stop
a run cleanly (also a two-process one, at one step), a failing callback is one line."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import ml_collections
import numpy as np
import pytest
import quick_compile
from conftest import finish, free_port, once_per_session
import fork_server
from overrides import with_overrides

from configs import cifar_seed_cnn
from jaxtrain.callbacks import base, early_stopping
from jaxtrain.config import checks
from jaxtrain.config.defaults import callback
from jaxtrain.errors import ConfigError
from jaxtrain.run import callbacks, loop
from jaxtrain.runtime import report
from jaxtrain.training import checkpoint

pytestmark = pytest.mark.usefixtures("compile_quickly")  # conftest.py

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
# The volatile fields of a row: wall-clock times, not what training computed.
CLOCKS = ("seconds", "input_wait_fraction")


def mlp_config(data_dir, **overrides):
    """A BatchNorm MLP on the 2,000-image subset: 40 steps an epoch, scanned."""
    config = cifar_seed_cnn.get_config()
    config.data.dir = str(data_dir)
    config.data.source = "files"
    config.model.name = "mlp"
    config.model.batch_norm = True
    config.model.hidden_sizes = (64, 32)
    config.optimizer.learning_rate = 0.05
    config.train.batch_size = 50
    config.train.num_steps = 200
    config.train.log_every_steps = 10
    config.train.precision = "float32"
    config.eval.every_steps = 10
    config.eval.batch_size = 250
    config.checkpoint.every_epochs = 0
    return with_overrides(config, overrides)


def early_stop_step(losses: dict, patience: int, min_delta: float):
    """EarlyStopping's rule on {step: test_loss}, recomputed with NumPy."""
    steps = np.array(sorted(losses))
    values = np.array([losses[s] for s in steps])
    best, waited = np.inf, 0
    for step, value in zip(steps, values):
        if value < best - min_delta:
            best, waited = value, 0
        else:
            waited += 1
            if waited >= patience:
                return int(step)
    return None


@pytest.fixture(scope="module")
def mlp_reference(cifar_batches_dir, tmp_path_factory, worker_id):
    """The rows of mlp_config's run, made once a session."""
    workdir, _ = once_per_session(tmp_path_factory, worker_id, "callbacks_reference",
                                  lambda workdir: loop.train_and_evaluate(
                                      mlp_config(cifar_batches_dir), str(workdir)))
    return report.read_metrics(str(workdir))


@pytest.mark.slow
def test_early_stopping_stops_where_its_rule_says(mlp_reference, cifar_batches_dir, tmp_path):
    losses = {row["step"]: row["test_loss"] for row in mlp_reference if "test_loss" in row}
    assert len(losses) == 20
    expected = early_stop_step(losses, patience=2, min_delta=0.01)
    assert expected is not None and expected < 200  # the rule does stop this run
    config = mlp_config(cifar_batches_dir)
    config.callbacks.early = callback("EarlyStopping", monitor="test_loss", patience=2,
                                      min_delta=0.01)
    summary = loop.train_and_evaluate(config, str(tmp_path))
    assert summary["stopped_early"]["step"] == expected
    assert summary["stopped_early"]["reason"].startswith(
        "test_loss has not improved by more than 0.01 for 2 evaluations (best ")
    assert checkpoint.saved_steps(checkpoint.checkpoint_dir(str(tmp_path)))[-1] == expected
    rows = report.read_metrics(str(tmp_path))
    assert rows[-1]["step"] == expected
    strip = [{k: v for k, v in row.items() if k not in CLOCKS} for row in rows]
    assert strip == [{k: v for k, v in row.items() if k not in CLOCKS}
                     for row in mlp_reference if row["step"] <= expected]
    assert summary["test_loss"] == losses[expected]
    # Run again: the rule, rebuilt from the rows, says stop at once; nothing is trained.
    again = loop.train_and_evaluate(config, str(tmp_path))
    assert again["stopped_early"] == summary["stopped_early"]
    assert again["resumed_from_step"] == expected and again["params_sha256"] == summary[
        "params_sha256"]


@pytest.mark.slow
def test_the_rows_are_the_same_for_any_checkpoint_and_evaluation_cadence(
        mlp_reference, cifar_batches_dir, tmp_path):
    """The reference run (a row every 10 steps, an evaluation every 10) and the same run
    with a checkpoint every 7 steps and an evaluation every 9, which cut its chunks
    elsewhere: every training row is the same; the evaluations off the row grid are rows
    of their own."""
    config = mlp_config(cifar_batches_dir, checkpoint__every_steps=7, eval__every_steps=9)
    loop.train_and_evaluate(config, str(tmp_path))
    rows = report.read_metrics(str(tmp_path))

    def training(rows):
        return [{k: v for k, v in row.items() if k not in CLOCKS and not k.startswith("test_")}
                for row in rows if report.is_train_row(row)]

    assert training(rows) == training(mlp_reference)
    assert len(training(rows)) == 20
    own = [row for row in rows if not report.is_train_row(row)]
    assert [row["step"] for row in own] == [s for s in range(9, 200, 9) if s % 10]
    assert set(own[0]) == {"step", "epoch", "seconds", "test_loss", "test_accuracy"}
    merged = [row["step"] for row in rows if report.is_train_row(row) and "test_loss" in row]
    assert merged == [40, 80, 90, 120, 160, 180, 200]  # at epoch ends too (eval.every_epochs)


def test_early_stopping_on_accuracy_and_train_metrics():
    stop = early_stopping.EarlyStopping(monitor="test_accuracy", patience=1)
    assert stop.mode == "max"
    stop.on_evaluation(10, {"test_accuracy": 0.5})
    stop.on_evaluation(20, {"test_accuracy": 0.6})
    with pytest.raises(base.StopTraining, match=r"best 0\.6 at step 20"):
        stop.on_evaluation(30, {"test_accuracy": 0.6})
    replicated = early_stopping.EarlyStopping(monitor="train_loss", patience=1)
    replicated.on_evaluation(10, {"train_loss": [1.0, 3.0]})  # the mean over replicas: 2.0
    with pytest.raises(base.StopTraining):
        replicated.on_evaluation(20, {"train_loss": [2.5, 1.5]})
    with pytest.raises(ValueError, match="no metric 'test_los'"):
        early_stopping.EarlyStopping(monitor="test_los").on_evaluation(1, {"test_loss": 1.0})


@pytest.mark.slow
def test_callbacks_from_python_and_the_config_run_in_order(cifar_batches_dir, tmp_path):
    import recording_callback

    path = tmp_path / "calls.jsonl"
    config = mlp_config(cifar_batches_dir, train__num_steps=40, eval__every_steps=20,
                        checkpoint__every_steps=20)
    config.callbacks.record = callback("recording_callback:Recorder", path=str(path))

    class Order(base.Callback):
        def on_rows(self, rows):
            recording_callback.append(path, {"event": "python", "step": rows[-1]["step"]})

    summary = loop.train_and_evaluate(config, str(tmp_path / "run"), callbacks=[Order()])
    calls = [json.loads(line) for line in path.read_text().splitlines()]
    assert [c["event"] for c in calls] == [
        "start", "row", "row", "python", "evaluation", "checkpoint",
        "row", "row", "python", "evaluation", "checkpoint", "end"]
    assert calls[0]["start_step"] == 0 and calls[0]["history"] == 0
    assert all(c["on_disk"] for c in calls if c["event"] == "checkpoint")
    rows = report.read_metrics(str(tmp_path / "run"))
    assert [c["step"] for c in calls if c["event"] == "row"] == [r["step"] for r in rows]
    evaluation = next(c for c in calls if c["event"] == "evaluation")
    assert evaluation["step"] == 20 and evaluation["test_loss"] == rows[1]["test_loss"]
    # train metrics: the mean over the epoch so far, as the console's epoch row has them
    assert evaluation["train_loss"] == pytest.approx(report.epoch_means(rows[:2], 40)
                                                     ["train_loss"])
    assert evaluation["train_loss"] != pytest.approx(rows[1]["train_loss"])
    last = [c for c in calls if c["event"] == "evaluation"][-1]
    assert last["train_loss"] == pytest.approx(report.epoch_means(rows, 40)["train_loss"])
    assert calls[-1]["test_accuracy"] == summary["test_accuracy"]


@pytest.mark.slow
def test_a_callback_argument_is_a_key_of_its_entry(cifar_batches_dir, tmp_path):
    """--config.callbacks.early.patience=1 sets EarlyStopping's patience (as Keras users
    set one argument); an entry saved the older way (its arguments under `kwargs`) makes
    the same callback."""
    config = write_config(tmp_path / "early.py", early=("EarlyStopping", {
        "monitor": "test_loss", "patience": 50, "min_delta": 10.0}))
    done = fork_server.run(
        [sys.executable, "main.py", f"--config={config}", f"--workdir={tmp_path / 'run'}",
         f"--config.data.dir={cifar_batches_dir}", "--config.data.source=files",
         "--config.model.name=mlp", "--config.model.hidden_sizes=(16,)",
         "--config.train.batch_size=50", "--config.train.num_steps=60",
         "--config.eval.every_steps=10", "--config.eval.every_epochs=0",
         "--config.callbacks.early.patience=1"],
        cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["stopped_early"]["step"] == 20  # no 10.0 drop after step 10's evaluation
    old = ml_collections.ConfigDict({"name": "EarlyStopping",
                                     "kwargs": {"monitor": "test_loss", "patience": 4}})
    assert callbacks.callback_kwargs(old) == {"monitor": "test_loss", "patience": 4}
    assert callbacks.callback_kwargs(callback("EarlyStopping", patience=4)) == {"patience": 4}


def test_config_errors_name_the_callback(cifar_batches_dir):
    config = mlp_config(cifar_batches_dir)
    config.callbacks.early = callback("EarlyStoping", monitor="test_loss")
    with pytest.raises(ConfigError, match=r"^config\.callbacks\.early\.name='EarlyStoping': "
                       r"module 'jaxtrain\.callbacks' has no class 'EarlyStoping'"):
        callbacks.from_config(config)
    config.callbacks.early = callback("EarlyStopping", patients=3)
    with pytest.raises(ConfigError, match=r"unexpected keyword argument 'patients'"):
        callbacks.from_config(config)
    config.callbacks.early = callback("no_such_package.module:Thing")
    with pytest.raises(ConfigError, match=r"cannot import 'no_such_package\.module'"):
        callbacks.from_config(config)
    with config.callbacks.ignore_type():
        config.callbacks.early = "EarlyStopping"
    with pytest.raises(ConfigError, match=r"^config\.callbacks\.early='EarlyStopping': must be "
                       r"jaxtrain\.config\.defaults\.callback\("):
        checks.check_config(config)


def write_config(path: Path, **entries) -> Path:
    """A config file: the seed recipe on the test subset, with callbacks `entries`
    (name -> (class, kwargs))."""
    lines = ["from configs import cifar_seed_cnn",
             "from jaxtrain.config.defaults import callback", "", "def get_config():",
             "    config = cifar_seed_cnn.get_config()"]
    for name, (cls, kwargs) in entries.items():
        lines.append(f"    config.callbacks.{name} = callback({cls!r}, **{kwargs!r})")
    lines.append("    return config")
    path.write_text("\n".join(lines) + "\n")
    return path


def child_env(**extra):
    """The environment of a child main.py: XLA's LLVM backend at -O0 (its few steps;
    quick_compile.py), tests/ importable (recording_callback)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    env["XLA_FLAGS"] = quick_compile.xla_flags(0)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def run_main(config_file, workdir, data_dir, *flags, timeout=600):
    return fork_server.run([sys.executable, "main.py", f"--config={config_file}",
                           f"--workdir={workdir}", f"--config.data.dir={data_dir}",
                           "--config.data.source=files", *flags], cwd=REPO, env=child_env(),
                           capture_output=True, text=True, timeout=timeout)


SMALL = ("--config.model.name=mlp", "--config.model.hidden_sizes=(16,)",
         "--config.train.batch_size=50", "--config.train.num_steps=40",
         "--config.train.log_every_steps=10", "--config.checkpoint.every_steps=10",
         "--config.eval.every_steps=10", "--config.eval.batch_size=250")


@pytest.mark.slow
def test_stop_training_ends_the_run_cleanly(cifar_batches_dir, tmp_path):
    calls = tmp_path / "calls.jsonl"
    config = write_config(tmp_path / "stop.py", stop=("recording_callback:StopAt", {"step": 20}),
                          zrecord=("recording_callback:Recorder", {"path": str(calls)}))
    result = run_main(config, tmp_path / "run", cifar_batches_dir, *SMALL,
                      "--config.checkpoint.every_steps=30")  # step 20 saved for the stop
    assert result.returncode == 0, result.stderr[-2000:]
    assert "stopped early at step 20: step 20 reached" in result.stdout
    summary = json.loads((tmp_path / "run" / report.SUMMARY_FILE).read_text())
    assert summary["stopped_early"] == {"step": 20, "reason": "step 20 reached"}
    assert checkpoint.saved_steps(str(tmp_path / "run" / "checkpoints")) == [20]
    # the checkpoint saved for the stop is told to on_checkpoint, once it is on disk
    told = [json.loads(line) for line in calls.read_text().splitlines()]
    assert [(c["step"], c["on_disk"]) for c in told if c["event"] == "checkpoint"] == [(20, True)]
    # What was trained, not what was planned: 20 steps of 50 images, 40 to an epoch.
    assert (summary["steps"], summary["planned_steps"], summary["epochs"]) == (20, 40, 0.5)
    assert summary["images"] == 20 * 50
    assert summary["images_per_second"] == pytest.approx(
        summary["images"] / summary["train_only_seconds"])
    assert f"images/s={summary['images_per_second']:.0f}" in result.stdout


@pytest.mark.slow
def test_a_failing_callback_is_one_line_and_keeps_the_checkpoint(cifar_batches_dir, tmp_path):
    config = write_config(tmp_path / "fails.py",
                          fails=("recording_callback:FailsAtEvaluation", {}))
    result = run_main(config, tmp_path / "run", cifar_batches_dir, *SMALL)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    directory = tmp_path / "run" / "checkpoints"
    assert result.stderr.strip().splitlines()[-1] == (
        "error: callback FailsAtEvaluation.on_evaluation failed at step 10: ValueError: no "
        f"per-class accuracy at step 10; the checkpoints are kept in {directory} (newest: "
        "step 10)")
    assert checkpoint.saved_steps(str(directory)) == [10]


@pytest.mark.slow
def test_an_unknown_callback_is_a_usage_error_and_writes_nothing(cifar_batches_dir, tmp_path):
    config = write_config(tmp_path / "bad.py", rec=("recording_callback:Recordr", {}))
    result = run_main(config, tmp_path / "run", cifar_batches_dir, *SMALL)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "error: config.callbacks.rec.name='recording_callback:Recordr': module "
        "'recording_callback' has no class 'Recordr'")
    assert not (tmp_path / "run").exists()


KILLED_RUN = ("--config.model.name=mlp", "--config.model.hidden_sizes=(16,)",
              "--config.model.batch_norm=True", "--config.augment.flip=True",
              "--config.train.batch_size=50", "--config.train.num_steps=120",
              "--config.train.log_every_steps=10", "--config.checkpoint.every_steps=20",
              "--config.eval.every_epochs=0", "--config.eval.every_steps=30",
              "--config.eval.batch_size=250")


@pytest.mark.slow
def test_every_row_and_evaluation_once_across_a_sigkill(cifar_batches_dir, tmp_path):
    """SIGKILL once step 90's row and evaluation were delivered (a callback holds the run
    there: step 90 is no checkpoint, so the rerun starts before rows and an evaluation its
    callbacks already had); the rerun delivers every later one, none twice."""
    calls = tmp_path / "calls.jsonl"
    marker = tmp_path / "stalled"
    config = write_config(tmp_path / "record.py",
                          record=("recording_callback:Recorder", {"path": str(calls)}),
                          stall=("recording_callback:StallAt", {"step": 90,
                                                                "marker": str(marker)}))
    workdir = tmp_path / "run"
    command = [sys.executable, "main.py", f"--config={config}", f"--workdir={workdir}",
               f"--config.data.dir={cifar_batches_dir}", "--config.data.source=files",
               *KILLED_RUN]
    first = fork_server.Popen(command, cwd=REPO, env=child_env(), stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while not marker.exists():
        assert first.poll() is None and time.time() < deadline, first.communicate()
        time.sleep(0.05)
    first.send_signal(signal.SIGKILL)
    first.wait()
    # Step 80's checkpoint may still have been in flight when the run died: the rerun
    # starts from the newest one that was complete.
    newest = checkpoint.saved_steps(checkpoint.checkpoint_dir(str(workdir)))[-1]
    assert newest in (60, 80)  # past two checkpoints, before the rows delivered last
    rerun = fork_server.run(command, cwd=REPO, env=child_env(), capture_output=True, text=True,
                            timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    seen = [json.loads(line) for line in calls.read_text().splitlines()]
    starts = [c for c in seen if c["event"] == "start"]
    assert len(starts) == 2 and starts[1]["start_step"] == newest
    assert starts[1]["history"] >= newest // 10  # rows delivered before the kill
    rows = report.read_metrics(str(workdir))
    assert [r["step"] for r in rows] == list(range(10, 121, 10))
    delivered = [c for c in seen if c["event"] == "row"]
    assert [c["step"] for c in delivered] == [r["step"] for r in rows]  # each once, in order
    assert len({c["pid"] for c in delivered}) == 2  # the killed run's and the rerun's
    assert max(c["step"] for c in delivered if c["pid"] == delivered[0]["pid"]) == 90

    def strip(row):
        return {k: v for k, v in row.items() if k not in (*CLOCKS, "event", "pid")}

    assert [strip(c) for c in delivered] == [strip(r) for r in rows]
    evaluations = [c for c in seen if c["event"] == "evaluation"]
    assert [c["step"] for c in evaluations] == list(range(30, 121, 30))
    assert [c["event"] for c in seen].count("end") == 1


@pytest.mark.slow
def test_a_stop_on_one_process_stops_both_at_the_same_step(cifar_batches_dir, tmp_path):
    """Two processes of two CPU devices each (a BatchNorm MLP: the model is not what is
    checked); a callback of process 1 alone asks to stop at step 20."""
    config = write_config(tmp_path / "stop.py",
                          stop=("recording_callback:StopAt", {"step": 20, "process": 1}))
    address = f"localhost:{free_port()}"
    args = ["main.py", f"--config={config}", "--config.model.name=mlp",
            "--config.model.hidden_sizes=(32,)", "--config.model.batch_norm=True",
            "--config.train.batch_size=64", "--config.optimizer.learning_rate=0.05",
            "--config.augment.flip=True", "--config.augment.translate=2",
            "--config.train.log_every_steps=5", "--config.train.num_steps=60",
            "--config.train.chunk_steps=5", "--config.checkpoint.every_epochs=0",
            f"--workdir={tmp_path / 'run'}", f"--config.data.dir={cifar_batches_dir}",
            f"--coordinator_address={address}", "--num_processes=2"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "SLURM_", "OMPI_"))}
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count=2 {quick_compile.xla_flags(0)}"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))
    processes = [fork_server.Popen([sys.executable, *args, f"--process_id={i}"], cwd=REPO,
                                   env=env, text=True, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE) for i in range(2)]
    results = [finish(p) for p in processes]
    assert [r.returncode for r in results] == [0, 0], results[0].stderr[-2000:]
    assert "stopped early at step 20: a callback of process 1 asked to stop" in results[0].stdout
    summary = json.loads((tmp_path / "run" / report.SUMMARY_FILE).read_text())
    assert summary["stopped_early"]["step"] == 20
    assert checkpoint.saved_steps(str(tmp_path / "run" / "checkpoints")) == [20]
