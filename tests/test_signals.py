"""SIGINT and SIGTERM while a run trains, as a user's Ctrl-C or a scheduler's preemption
reach it: the user's command (README's CPU recipe, configs/fashion_mnist_cnn.py; here
narrower, without TTA, 120 steps with an evaluation after step 100, so that each process
costs seconds) as a process of its own, the real signal sent during a chunk, at a chunk's
end (before its evaluation) and during an evaluation. Every step already trained is
saved, the rows and the MLflow run say what happened, and the rerun ends where the
uninterrupted run does. (Signals before training: test_cli.py; during a checkpoint's
write: test_cli.py; during an evaluation of another recipe at 64 px: test_checkpoint.py.
The seconds from signal to exit, measured: benchmarks/signal_latency.py.)"""
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import filelock
import pytest
import quick_compile
import fork_server

from jaxtrain.runtime import report
from jaxtrain.training import checkpoint

REPO = Path(__file__).resolve().parents[1]
COMMAND = [sys.executable, "main.py", "--config=configs/fashion_mnist_cnn.py",
           "--config.train.num_steps=120", "--config.eval.every_steps=100",  # 234 an epoch
           "--config.model.widths=(8,16,32)", "--config.eval.tta=none"]  # the recipe, cheaper
CLOCKS = ("seconds", "input_wait_fraction")
TABLE_HEADER = "  epoch     step"  # the console table's first line: training starts
# XLA's LLVM backend at -O1 in these processes: their programs compile almost as fast as
# at -O0 and run as fast as at -O2 (quick_compile.py); every one of them is compiled so.
ENV = quick_compile.env(1)

pytestmark = pytest.mark.slow  # every test here runs main.py, a few times


def start(workdir, *flags):
    env = dict(ENV, PYTHONUNBUFFERED="1")  # the console's lines as they are printed
    return fork_server.Popen([*COMMAND, f"--workdir={workdir}", *flags], cwd=REPO, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def signal_after_start(process, signum, seconds: float):
    """Sends `signum` `seconds` after the table's header (training has begun); returns
    (stdout, stderr, seconds from the signal to the exit)."""
    lines = []
    for line in process.stdout:
        lines.append(line)
        if line.startswith(TABLE_HEADER):
            break
    else:
        raise AssertionError("".join(lines) + process.stderr.read())
    time.sleep(seconds)
    sent = time.time()
    process.send_signal(signum)
    out, err = process.communicate(timeout=300)
    return "".join(lines) + out, err, time.time() - sent


def stopped_line(err: str) -> str:
    assert "Traceback" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("stopped:")]
    assert len(lines) == 1, err[-3000:]
    return lines[0]


def train_rows(workdir):
    """The training rows without their clock readings (and an evaluation's figures, which
    a row of its own holds when a signal cut that evaluation short)."""
    return [{k: v for k, v in row.items() if k not in CLOCKS and not k.startswith("test_")}
            for row in report.read_metrics(str(workdir)) if report.is_train_row(row)]


def evaluated_steps(workdir):
    return {row["step"]: row["test_accuracy"] for row in report.read_metrics(str(workdir))
            if "test_accuracy" in row}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, worker_id):
    """The command run to its end: once for the whole session, whichever worker (pytest-xdist)
    asks first; the others wait for it and read the same folder."""
    shared = tmp_path_factory.getbasetemp()
    if worker_id != "master":  # the workers' folders are in the session's own folder
        shared = shared.parent
    workdir = shared / "signals_uninterrupted"
    with filelock.FileLock(str(shared / "signals_uninterrupted.lock")):
        if not (workdir / report.SUMMARY_FILE).exists():
            done = fork_server.run([*COMMAND, f"--workdir={workdir}"], cwd=REPO, env=ENV,
                                   capture_output=True, text=True, timeout=600)
            assert done.returncode == 0, done.stderr[-3000:]
            assert "train.precision='auto': float32 on cpu (" in done.stdout
    summary = json.loads((workdir / report.SUMMARY_FILE).read_text())
    assert summary["precision"] == "float32" and summary["steps"] == 120
    return workdir, summary


def rerun_ends_as(workdir, uninterrupted, resumed_from: int) -> str:
    reference_dir, reference = uninterrupted
    done = fork_server.run([*COMMAND, f"--workdir={workdir}"], cwd=REPO, env=ENV,
                           capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((workdir / report.SUMMARY_FILE).read_text())
    assert summary["resumed_from_step"] == resumed_from
    assert summary["params_sha256"] == reference["params_sha256"]
    for key in ("test_accuracy", "train_loss", "steps", "epochs", "images"):
        assert summary[key] == reference[key], key
    assert train_rows(workdir) == train_rows(reference_dir)  # the window went with the save
    assert evaluated_steps(workdir) == evaluated_steps(reference_dir)
    return done.stdout


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_during_a_chunk_saves_every_step_trained(uninterrupted, tmp_path, signum):
    """Ctrl-C half a second into the first chunk (steps 1-100, seconds long): the chunk
    stops after the compiled call in hand (train.chunk_seconds, here 0.5: the first call
    is one step, the next ones about half a second each), its steps are saved, a row
    covers them. SIGINT's rerun ends where the uninterrupted run does; SIGTERM's MLflow
    run ends KILLED."""
    workdir = tmp_path / "run"
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    flags = [f"--config.logging.mlflow={uri}"] if signum == signal.SIGTERM else []
    out, err, seconds = signal_after_start(
        start(workdir, "--config.train.chunk_seconds=0.5", *flags), signum, 0.5)
    assert seconds < 30, seconds  # about 2 s when idle: benchmarks/signal_latency.py
    line = stopped_line(err)
    assert line.startswith(f"stopped: interrupted by {signal.Signals(signum).name} at step ")
    step = int(line.split("at step ")[1].split(";")[0])
    assert 0 < step < 100, line  # inside the first chunk
    assert line.endswith(f"checkpoint saved in {workdir / 'checkpoints'}/{step}. Run the same "
                         "command again to resume")
    assert checkpoint.saved_steps(str(workdir / "checkpoints")) == [step]
    assert train_rows(workdir)[-1]["step"] == step and not evaluated_steps(workdir)
    assert not (workdir / report.SUMMARY_FILE).exists()
    if signum == signal.SIGINT:
        rerun_ends_as(workdir, uninterrupted, step)
        return
    import mlflow
    client = mlflow.MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("jaxtrain").experiment_id])
    assert run.info.status == "KILLED"
    assert max(m.step for m in client.get_metric_history(run.info.run_id, "train_loss")) == step


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_at_a_chunks_end_saves_it_before_any_evaluation(uninterrupted, tmp_path,
                                                                  signum):
    """train.chunk_seconds=600: after its first step (a call of a few hundredths of a
    second), the first chunk (steps 1-100) is one compiled call of seconds, which a signal
    a second in does not cut; the run stops where it ends, at step 100, saving it and
    skipping its evaluation. SIGTERM's rerun evaluates step 100 first and ends where the
    uninterrupted run does."""
    workdir = tmp_path / "run"
    out, err, seconds = signal_after_start(start(workdir, "--config.train.chunk_seconds=600"),
                                           signum, 1.0)
    assert stopped_line(err) == (
        f"stopped: interrupted by {signal.Signals(signum).name} at step 100; checkpoint saved "
        f"in {workdir / 'checkpoints'}/100. Run the same command again to resume")
    assert checkpoint.saved_steps(str(workdir / "checkpoints")) == [100]
    assert train_rows(workdir)[-1]["step"] == 100 and not evaluated_steps(workdir)
    if signum == signal.SIGTERM:
        rerun_ends_as(workdir, uninterrupted, 100)


def test_a_signal_during_an_evaluation_saves_the_steps_it_evaluates(tmp_path):
    """Step 5's checkpoint, then the evaluation of step 10 (six test-time views of 10,000
    images: about 4 s when idle, where steps 6-10 of 32 images take a few hundredths of
    one): SIGINT a second after step 5's row stops it after the test batch in hand
    (test_train.py: the evaluation stops between two batches), step 10 is saved, and the
    rerun evaluates it before it trains on."""
    workdir = tmp_path / "run"
    flags = ["--config.train.num_steps=15", "--config.train.batch_size=32",
             "--config.train.log_every_steps=5", "--config.checkpoint.every_steps=5",
             "--config.eval.every_steps=10", "--config.eval.tta=flip_translate",
             "--config.eval.batch_size=500"]
    process = start(workdir, *flags)
    deadline = time.time() + 300
    while not (workdir / report.METRICS_FILE).exists() or not report.read_metrics(str(workdir)):
        assert process.poll() is None and time.time() < deadline, process.communicate()
        time.sleep(0.02)
    time.sleep(1.0)  # steps 6-10 take a fraction of that; then the evaluation
    sent = time.time()
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=300)
    assert time.time() - sent < 30
    assert process.returncode == 128 + signal.SIGINT
    assert stopped_line(err) == (
        "stopped: interrupted by SIGINT while evaluating step 10 (evaluated when the run "
        f"resumes); checkpoint saved in {workdir / 'checkpoints'}/10. Run the same command "
        "again to resume")
    assert checkpoint.saved_steps(str(workdir / "checkpoints")) == [5, 10]
    assert [row["step"] for row in train_rows(workdir)] == [5, 10]
    assert not evaluated_steps(workdir) and not (workdir / report.SUMMARY_FILE).exists()
    done = fork_server.run([*COMMAND, f"--workdir={workdir}", *flags], cwd=REPO, env=ENV,
                           capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert list(evaluated_steps(workdir)) == [10, 15]
    summary = json.loads((workdir / report.SUMMARY_FILE).read_text())
    assert summary["resumed_from_step"] == 10 and summary["steps"] == 15


def test_a_save_killed_mid_write_is_simply_absent(cifar_batches_dir, tmp_path):
    """SIGKILL the moment Orbax's temporary folder of the first checkpoint appears: that
    save never became a checkpoint (Orbax renames the folder only once it is whole), so
    the rerun starts from the last whole one (none here) and finishes. (The MLP recipe,
    narrower, on the 2,000-image CIFAR-10 subset: only its checkpoints matter here.)"""
    workdir = tmp_path / "run"
    command = [sys.executable, "main.py", "--config=configs/fashion_mnist_mlp.py",
               f"--workdir={workdir}", "--config.data.name=cifar10",
               f"--config.data.dir={cifar_batches_dir}", "--config.data.source=files",
               "--config.model.hidden_sizes=(32,)", "--config.eval.batch_size=250",
               "--config.train.num_steps=60", "--config.checkpoint.every_steps=50"]
    process = subprocess.Popen(command, cwd=REPO, env=ENV, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True)
    folder = workdir / "checkpoints"
    deadline = time.time() + 300
    while not (folder.is_dir() and any("tmp" in p.name for p in folder.iterdir())):
        assert process.poll() is None and time.time() < deadline, process.communicate()
        time.sleep(0.001)
    process.kill()
    process.wait()
    whole = checkpoint.saved_steps(str(folder))  # [] unless the save finished meanwhile
    assert whole in ([], [50])
    done = subprocess.run(command, cwd=REPO, env=ENV, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((workdir / report.SUMMARY_FILE).read_text())
    assert summary["steps"] == 60
    assert summary["resumed_from_step"] == (whole[-1] if whole else None)
