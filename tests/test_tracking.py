"""jaxtrain/callbacks/trackers/: MLflow and W&B read back from their own local stores (a real
SQLite MLflow store; W&B's offline run file), and neither imported when not asked for."""
import glob
import json
import os
import signal
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import numpy as np
import pytest
import quick_compile
import fork_server
from conftest import require_module
from tolerances import TRAINING_STEPS
from test_callbacks import mlp_config

import jaxtrain
from jaxtrain.callbacks.trackers import tracker
from jaxtrain.run import loop
from jaxtrain.runtime import report
from jaxtrain.training import checkpoint

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
    config = short_config(cifar_batches_dir, logging__mlflow=uri,
                          logging__mlflow_registered_model="tiny-mlp")
    summary = loop.train_and_evaluate(config, str(tmp_path / "run"))
    out, err = capfd.readouterr()  # a new store's set-up says nothing between the rows
    assert "INFO" not in out + err and "database tables" not in out + err
    assert "registered the model as 'tiny-mlp' version 1 (models:/tiny-mlp/1)" in out
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
    classifier = jaxtrain.restore(model)
    assert checkpoint.params_sha256(classifier.state) == summary["params_sha256"]  # the run's
    expected = classifier.predict(images)[1]
    # and an MLflow Model, by the run and by the registry
    assert_mlflow_model_predicts(uri, f"runs:/{run.info.run_id}/model", images, expected)
    assert_mlflow_model_predicts(uri, "models:/tiny-mlp/1", images, expected)
    # Artifacts beside the database, not in the current directory.
    assert experiment.artifact_location.startswith(f"file://{tmp_path / 'mlflow-artifacts'}")
    # A rerun of the finished run logs into the same MLflow run, nothing twice.
    loop.train_and_evaluate(config, str(tmp_path / "run"))
    (again,) = client.search_runs([experiment.experiment_id])
    assert again.info.run_id == run.info.run_id
    assert len(client.get_metric_history(run.info.run_id, "train_loss")) == len(rows)


def assert_mlflow_model_predicts(tracking_uri: str, uri: str, images, expected) -> None:
    """The MLflow Model at `uri` of the store at `tracking_uri` (its pyfunc: onnxruntime, no
    jaxtrain) gives restore's probabilities, and says what it takes."""
    import mlflow
    previous = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(tracking_uri)
    try:
        model = mlflow.pyfunc.load_model(uri)
    finally:
        mlflow.set_tracking_uri(previous)
    inputs = model.metadata.get_input_schema().inputs
    assert [(spec.name, str(spec.type), spec.shape) for spec in inputs] == [
        ("images", "uint8", (-1, *images.shape[1:]))]
    # onnxruntime's kernels against XLA's, of probabilities (at most 1)
    np.testing.assert_allclose(model.predict(images)["probabilities"], expected,
                               atol=TRAINING_STEPS)


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
                                 "PATH": "/usr/bin:/bin", "XLA_FLAGS": quick_compile.xla_flags(0)})
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "[]"


def test_a_missing_tracker_package_is_one_line():
    with pytest.raises(Exception, match=r"config\.logging\.nosuch needs the "
                       r"no_such_tracker_package package: pip install 'jaxtrain\[nosuch\]'"):
        tracker.import_optional("no_such_tracker_package", "nosuch")


def test_a_tracking_server_that_does_not_answer_is_one_line_before_anything_loads(tmp_path):
    """logging.mlflow at a port no one listens on: a ConfigError when the tracker is made
    (callbacks.from_config, before the data), not MLflow's minutes of retries after the
    compile. A server that answers, even with an error status or a certificate the check
    cannot verify, is taken."""
    import http.server

    from conftest import free_port
    from jaxtrain.callbacks.trackers import mlflow as mlflow_tracker
    require_module("mlflow", "pip install -e .[mlflow]")
    closed = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(jaxtrain.ConfigError, match=rf"^config.logging.mlflow='{closed}': no "
                       r"MLflow tracking server answers there \(.*refused\); start it, or "
                       r"correct the URI$"):
        mlflow_tracker.MLflowTracker(closed)
    for tls in (False, True):  # a self-signed certificate: MLflow's TLS settings decide
        server = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
        if tls:
            server.socket = self_signed_context(tmp_path).wrap_socket(server.socket,
                                                                      server_side=True)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:  # it answers GET /health with 501: a server, whatever it makes of the request
            mlflow_tracker.MLflowTracker(
                f"{'https' if tls else 'http'}://127.0.0.1:{server.server_address[1]}")
        finally:
            server.shutdown()
            server.server_close()


def self_signed_context(folder):
    """A TLS server context with a certificate for 127.0.0.1 signed by itself."""
    import datetime
    import ipaddress
    import ssl

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(x509.oid.NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    certificate = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
                   .public_key(key.public_key()).serial_number(1).not_valid_before(now)
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.SubjectAlternativeName(
                       [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
                   .sign(key, hashes.SHA256()))
    (folder / "cert.pem").write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    (folder / "key.pem").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(folder / "cert.pem", folder / "key.pem")
    return context


def test_a_tracker_whose_start_failed_has_no_run_to_end(tmp_path):
    """A start that failed (a server gone between the check and the first request) leaves
    nothing for on_exception to end: the run's own error is the one said."""
    class FailsToStart(tracker.Tracker):
        name = "fails"

        def start(self, run, run_id):
            raise ConnectionError("the server went away")

        def stop(self, signum):
            raise AssertionError("stop called for a run never started")

    callback = FailsToStart()
    with pytest.raises(ConnectionError):
        callback.on_run_start(types.SimpleNamespace(process_index=0, workdir=str(tmp_path)))
    callback.on_exception(RuntimeError("the run failed"))


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


@pytest.mark.slow
def test_a_run_logs_and_registers_its_model_on_a_real_mlflow_server(cifar_batches_dir, tmp_path,
                                                                   cifar_subset):
    """`mlflow server` (the full mlflow package) on 127.0.0.1, started here and stopped by
    its PID: the run's rows, its MLflow Model and the registered version go through its
    REST API, and its artifacts land where the server keeps them."""
    import urllib.request

    import mlflow
    from conftest import free_port
    url = f"http://127.0.0.1:{free_port()}"
    served = tmp_path / "served-artifacts"
    log = open(tmp_path / "server.log", "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port",
         url.rsplit(":", 1)[1], "--backend-store-uri", f"sqlite:///{tmp_path / 'server.db'}",
         "--artifacts-destination", str(served), "--workers", "1"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})  # no job workers
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, (tmp_path / "server.log").read_text()[-2000:]
            try:
                if urllib.request.urlopen(f"{url}/health", timeout=2).status == 200:
                    break
            except OSError:
                assert time.monotonic() < deadline, "the MLflow server did not start"
                time.sleep(0.2)
        config = short_config(cifar_batches_dir, logging__mlflow=url,
                              logging__mlflow_registered_model="served-mlp")
        summary = loop.train_and_evaluate(config, str(tmp_path / "run"))
        client = mlflow.MlflowClient(url)
        (run,) = client.search_runs([client.get_experiment_by_name("jaxtrain").experiment_id])
        assert run.info.status == "FINISHED"
        assert run.data.metrics["summary/test_accuracy"] == summary["test_accuracy"]
        images = cifar_subset["x_test"][:20]
        expected = jaxtrain.restore(str(tmp_path / "run")).predict(images)[1]
        assert_mlflow_model_predicts(url, "models:/served-mlp/1", images, expected)
        assert list(served.rglob("MLmodel")) and list(served.rglob("model.onnx"))
    finally:
        os.killpg(server.pid, signal.SIGTERM)  # the server and its uvicorn worker
        server.wait(timeout=60)
        log.close()
