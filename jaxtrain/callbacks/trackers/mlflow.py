"""MLflowTracker (logging.mlflow): params, rows, the summary, summary.json and curves.png as
artifacts, and the model under `model/`: an MLflow Model (the classifier exported to ONNX,
with its preprocessing, through MLflow's onnx flavour: mlflow.pyfunc.load_model(uri)
.predict(uint8 NHWC images)["probabilities"]), registered as a new version of
logging.mlflow_registered_model when that names one, and in the same folder the final
checkpoint with the run's config.json, which jaxtrain.restore takes once downloaded.
mlflow is imported only when the key is set (pip install 'jaxtrain[mlflow]'), and its INFO
lines are kept off the console."""
import logging
import os
import sys
import tempfile

from jaxtrain.callbacks.trackers import tracker
from jaxtrain.errors import ConfigError
from jaxtrain.runtime import processes, report
from jaxtrain.training import checkpoint


class MLflowTracker(tracker.Tracker):
    """logging.mlflow = a tracking URI (e.g. 'sqlite:///runs/mlflow.db', a server's URL)."""
    name = "mlflow"

    def __init__(self, uri: str, experiment: str = "jaxtrain", registered_model: str = ""):
        self.mlflow = tracker.import_optional("mlflow", "mlflow")
        for name in ("mlflow", "alembic"):  # a new store's set-up logs at INFO, mid-table
            logging.getLogger(name).setLevel(logging.WARNING)
        self.uri, self.experiment, self.registered_model = uri, experiment, registered_model
        if uri.startswith(("http://", "https://")) and processes.is_main_process():
            check_server(uri)

    def start(self, run, run_id):
        mlflow = self.mlflow
        self.client = mlflow.MlflowClient(self.uri)
        found = self.client.get_experiment_by_name(self.experiment)
        if found is None:
            artifacts = None
            if self.uri.startswith("sqlite:///"):  # artifacts beside the database
                database = self.uri[len("sqlite:///"):]
                artifacts = "file://" + os.path.abspath(os.path.join(
                    os.path.dirname(database) or ".", "mlflow-artifacts"))
            experiment_id = self.client.create_experiment(self.experiment, artifacts)
        else:
            experiment_id = found.experiment_id
        if run_id is None:
            self.run_id = self.client.create_run(
                experiment_id, run_name=os.path.basename(os.path.abspath(run.workdir))).info.run_id
            self.keep_id(self.run_id)
            params = [mlflow.entities.Param(key, str(value)[:500])
                      for key, value in tracker.flat_config(run.config).items()]
            for i in range(0, len(params), 100):  # MLflow takes at most 100 a batch
                self.client.log_batch(self.run_id, params=params[i:i + 100])
        else:
            self.run_id = run_id
            self.client.update_run(self.run_id, status="RUNNING")

    def log(self, rows):
        """A chunk's rows in one request (MLflow takes up to 1,000 metrics a batch)."""
        import time

        now = int(time.time() * 1000)
        metrics = [self.mlflow.entities.Metric(key, value, now, step)
                   for step, values in rows for key, value in values.items()]
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def end(self, summary):
        workdir = os.path.dirname(self.path)
        self.client.log_batch(self.run_id, metrics=[
            self.mlflow.entities.Metric(key, value, 0, summary["steps"])
            for key, value in tracker.summary_metrics(summary).items()])
        for name in (report.SUMMARY_FILE, report.PLOT_FILE):
            if os.path.exists(os.path.join(workdir, name)):
                self.client.log_artifact(self.run_id, os.path.join(workdir, name))
        self.log_model(workdir, summary["steps"])
        self.client.set_terminated(self.run_id, "FINISHED")

    def stop(self, signum):
        self.client.set_terminated(self.run_id, "KILLED" if signum else "FAILED")

    def log_model(self, workdir: str, step: int) -> None:
        """model/: the MLflow Model of the run's final weights (registered when asked), and
        model/config.json with model/checkpoints/STEP, the same weights as a workdir of
        their own (jaxtrain.restore, --mode=eval, predict and export take it)."""
        config = os.path.join(workdir, checkpoint.CONFIG_FILE)
        saved = os.path.join(checkpoint.checkpoint_dir(workdir), str(step))
        if not (os.path.isfile(config) and os.path.isdir(saved)):
            return
        with tempfile.TemporaryDirectory() as folder:
            logged = self.save_mlflow_model(workdir, step, os.path.join(folder, "model"))
            if logged:
                self.client.log_artifacts(self.run_id, os.path.join(folder, "model"), "model")
        self.client.log_artifact(self.run_id, config, "model")
        self.client.log_artifacts(self.run_id, saved, f"model/checkpoints/{step}")
        if logged and self.registered_model:
            self.register()

    def save_mlflow_model(self, workdir: str, step: int, path: str) -> bool:
        """The classifier of checkpoint `step` with the run's TTA, exported to ONNX, saved
        at `path` as an MLflow Model with its signature; a model the exporter cannot take
        (or a missing export extra) is one warning line and False."""
        import jax
        import numpy as np
        from mlflow.models import ModelSignature
        from mlflow.types.schema import Schema, TensorSpec

        from jaxtrain.inference import classifier as classifier_lib
        from jaxtrain.inference import exporters
        if jax.process_count() > 1:  # restore is one process's; the others have moved on
            print("warning: logging.mlflow: a multi-process run's model/ holds its checkpoint "
                  "but no MLflow Model (export it from one process: jaxtrain.restore, then "
                  "jaxtrain.inference.exporters.save)", file=sys.stderr, flush=True)
            return False
        classifier = classifier_lib.restore(workdir, step=step, pool_impl="xla")
        try:
            import onnx
            model = onnx.load_from_string(exporters.to_onnx(classifier))
        except (ImportError, exporters.ExportError) as error:
            print(f"warning: logging.mlflow: the run's model/ holds its checkpoint but no "
                  f"MLflow Model: {str(error).splitlines()[0]}", file=sys.stderr, flush=True)
            return False
        signature = ModelSignature(
            inputs=Schema([TensorSpec(np.dtype(np.uint8), (-1, *classifier.image_shape),
                                      "images")]),
            outputs=Schema([TensorSpec(np.dtype(np.float32),
                                       (-1, len(classifier.class_names)), "probabilities")]))
        from importlib import metadata
        needs = [f"{name}=={metadata.version(name)}" for name in ("onnx", "onnxruntime")]
        self.mlflow.onnx.save_model(model, path, signature=signature, pip_requirements=needs,
                                    metadata={"class_names": list(classifier.class_names),
                                              "step": step})  # needs: not inferred (3 s)
        return True

    def register(self) -> None:
        """model/ as a new version of logging.mlflow_registered_model (made if new)."""
        name = self.registered_model
        try:
            self.client.create_registered_model(name)
        except self.mlflow.exceptions.MlflowException as error:
            if error.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
        source = f"{self.client.get_run(self.run_id).info.artifact_uri}/model"
        version = self.client.create_model_version(name, source, self.run_id)
        print(f"logging.mlflow: registered the model as {name!r} version {version.version} "
              f"(models:/{name}/{version.version})", flush=True)


def check_server(uri: str) -> None:
    """A tracking server that does not answer at all (refused, no such host, silent) is a
    ConfigError before the run loads anything: MLflow's client would retry it for minutes
    after the compile, then fail the run. Any HTTP answer, even an error, is a server, and
    so is a TLS handshake this check cannot verify (MLflow's own TLS settings decide).
    A silent one is waited for as long as MLflow waits for a request."""
    import ssl
    import urllib.error
    import urllib.request

    from mlflow.environment_variables import MLFLOW_HTTP_REQUEST_TIMEOUT
    try:
        urllib.request.urlopen(f"{uri.rstrip('/')}/health",
                               timeout=MLFLOW_HTTP_REQUEST_TIMEOUT.get()).close()
    except urllib.error.HTTPError:
        return
    except (urllib.error.URLError, OSError) as error:
        reason = getattr(error, "reason", error)
        if isinstance(reason, ssl.SSLError):
            return
        raise ConfigError(f"config.logging.mlflow={uri!r}: no MLflow tracking server answers "
                          f"there ({reason}); start it, or correct the URI") from None
