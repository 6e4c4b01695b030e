"""jaxtrain/callbacks/trackers/: MLflow and W&B read back from their own local stores (a real
SQLite MLflow store; W&B's offline run file), and neither imported when not asked for."""
import glob
import json
import os
import signal
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import quick_compile
import fork_server
from test_callbacks import mlp_config

import jaxtrain
from jaxtrain.callbacks.trackers import tracker
from jaxtrain.run import loop
from jaxtrain.runtime import report

pytestmark = pytest.mark.usefixtures("compile_quickly")  # conftest.py

REPO = Path(__file__).resolve().parents[1]


def short_config(data_dir, **overrides):
    return mlp_config(data_dir, train__num_steps=40, eval__every_steps=20, **overrides)


@pytest.mark.slow
def test_mlflow_holds_the_params_every_row_the_summary_and_the_artifacts(cifar_batches_dir,
                                                                         tmp_path, capfd,
                                                                         cifar_subset):
    import mlflow

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    config = short_config(cifar_batches_dir, logging__mlflow=uri)
    summary = loop.train_and_evaluate(config, str(tmp_path / "run"))
    out, err = capfd.readouterr()  # a new store's set-up says nothing between the rows
    assert "INFO" not in out + err and "database tables" not in out + err
    client = mlflow.MlflowClient(uri)
    experiment = client.get_experiment_by_name("jaxtrain")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    assert run.data.params["train.batch_size"] == "50"
    assert run.data.params["optimizer.learning_rate"] == "0.05"
    rows = report.read_metrics(str(tmp_path / "run"))
    history = client.get_metric_history(run.info.run_id, "train_loss")
    assert [(m.step, m.value) for m in history] == [(r["step"], r["train_loss"]) for r in rows]
    tests = client.get_metric_history(run.info.run_id, "test_accuracy")
    assert [(m.step, m.value) for m in tests] == [(20, rows[1]["test_accuracy"]),
                                                 (40, rows[3]["test_accuracy"])]
    assert run.data.metrics["summary/test_accuracy"] == summary["test_accuracy"]
    assert {a.path for a in client.list_artifacts(run.info.run_id)} == {
        report.SUMMARY_FILE, report.PLOT_FILE, "model"}
    # the model: the final checkpoint as a workdir of its own, which restore takes
    model = client.download_artifacts(run.info.run_id, "model", str(tmp_path / "downloaded"))
    images = cifar_subset["x_test"][:20]
    np.testing.assert_array_equal(jaxtrain.restore(model).predict(images)[1],
                                  jaxtrain.restore(str(tmp_path / "run")).predict(images)[1])
    # Artifacts beside the database, not in the current directory.
    assert experiment.artifact_location.startswith(f"file://{tmp_path / 'mlflow-artifacts'}")
    # A rerun of the finished run logs into the same MLflow run, nothing twice.
    loop.train_and_evaluate(config, str(tmp_path / "run"))
    (again,) = client.search_runs([experiment.experiment_id])
    assert again.info.run_id == run.info.run_id
    assert len(client.get_metric_history(run.info.run_id, "train_loss")) == len(rows)


def wandb_records(path: str) -> list:
    """The records of a W&B run file (its LevelDB-style log: 7-byte file header, 32 KiB
    blocks, records of crc32 + length + type, types 1 full, 2-4 first/middle/last)."""
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B"
    position, records, pending = 7, [], b""
    while position + 7 <= len(data):
        left = 32768 - position % 32768
        if left < 7:
            position += left
            continue
        length, kind = int.from_bytes(data[position + 4:position + 6], "little"), data[
            position + 6]
        chunk = data[position + 7:position + 7 + length]
        position += 7 + length
        if kind == 1:
            records.append(chunk)
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            records.append(pending + chunk)
    parsed = []
    for chunk in records:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(chunk)
        parsed.append(record)
    return parsed


@pytest.mark.slow
def test_wandb_offline_keeps_every_row_in_its_run_folder(cifar_batches_dir, tmp_path,
                                                         monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    config = short_config(cifar_batches_dir, logging__wandb="jaxtrain-test")
    loop.train_and_evaluate(config, str(tmp_path))
    (path,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    history = [{item.key or "/".join(item.nested_key): json.loads(item.value_json)
                for item in record.history.item}
               for record in wandb_records(path) if record.WhichOneof("record_type") == "history"]
    rows = report.read_metrics(str(tmp_path))
    assert [h["_step"] for h in history] == [r["step"] for r in rows]
    assert [h["train_loss"] for h in history] == pytest.approx([r["train_loss"] for r in rows])
    assert history[1]["test_accuracy"] == pytest.approx(rows[1]["test_accuracy"])
    assert json.loads((tmp_path / tracker.TRACKING_FILE).read_text())["wandb"]


@pytest.mark.slow
def test_a_plain_run_imports_neither_tracker(cifar_batches_dir, tmp_path):
    script = f"""
import sys
from test_callbacks import mlp_config
from jaxtrain.run import loop
loop.train_and_evaluate(mlp_config({str(cifar_batches_dir)!r}, train__num_steps=2), {str(tmp_path)!r})
print(sorted(name for name in ("mlflow", "wandb") if name in sys.modules))
"""
    result = fork_server.run([sys.executable, "-c", script], cwd=REPO, capture_output=True,
                             text=True, timeout=300,
                             env={"PYTHONPATH": f"{REPO}:{REPO / 'tests'}",
                                 "PATH": "/usr/bin:/bin", "XLA_FLAGS": quick_compile.xla_flag(0)})
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "[]"


def test_a_missing_tracker_package_is_one_line():
    with pytest.raises(Exception, match=r"config\.logging\.nosuch needs the "
                       r"no_such_tracker_package package: pip install 'jaxtrain\[nosuch\]'"):
        tracker.import_optional("no_such_tracker_package", "nosuch")


class SignalAt(jaxtrain.Callback):
    """SIGTERM to this process once a row reaches `step`, as a scheduler's preemption."""

    def __init__(self, step):
        self.step, self.sent = step, False

    def on_rows(self, rows):
        if rows[-1]["step"] >= self.step and not self.sent:
            self.sent = True
            os.kill(os.getpid(), signal.SIGTERM)


class FailsAt(jaxtrain.Callback):
    def on_rows(self, rows):
        if rows[-1]["step"] >= 20:
            raise ValueError("the disk is full")


@pytest.mark.slow
@pytest.mark.parametrize("ending", ["signal", "failure"])
def test_a_run_ended_by_a_signal_or_a_failure_ends_killed_or_failed(ending, cifar_batches_dir,
                                                                   tmp_path, monkeypatch):
    """Both trackers' runs end with the run: MLflow's KILLED for a signal (a rerun resumes
    it) and FAILED for a failure; W&B's with the process's exit status (128 + N, marked
    preempting; 1)."""
    import mlflow

    assert threading.current_thread() is threading.main_thread()  # the signal's handler
    monkeypatch.setenv("WANDB_SILENT", "true")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    config = short_config(cifar_batches_dir, logging__mlflow=uri, logging__wandb="jaxtrain-test")
    ending_callback, error = ((SignalAt(20), jaxtrain.Interrupted) if ending == "signal"
                              else (FailsAt(), jaxtrain.CallbackError))
    with pytest.raises(error):
        loop.train_and_evaluate(config, str(tmp_path / "run"), callbacks=[ending_callback])
    client = mlflow.MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("jaxtrain").experiment_id])
    assert run.info.status == ("KILLED" if ending == "signal" else "FAILED")
    (path,) = glob.glob(str(tmp_path / "run" / "wandb" / "offline-run-*" / "run-*.wandb"))
    records = wandb_records(path)
    exits = [r.exit.exit_code for r in records if r.WhichOneof("record_type") == "exit"]
    assert exits == [128 + signal.SIGTERM if ending == "signal" else 1]
    preempting = [r for r in records if r.WhichOneof("record_type") == "preempting"]
    assert bool(preempting) == (ending == "signal")
