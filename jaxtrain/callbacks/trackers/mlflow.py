"""MLflowTracker (logging.mlflow): params, rows, the summary, summary.json and curves.png as
artifacts, and the model: the final checkpoint with the run's config.json under `model/`,
a folder jaxtrain.restore takes once downloaded. mlflow is imported only when the key is
set (pip install 'jaxtrain[mlflow]'), and its INFO lines are kept off the console."""
import logging
import os

from jaxtrain.callbacks.trackers import tracker
from jaxtrain.runtime import report
from jaxtrain.training import checkpoint


class MLflowTracker(tracker.Tracker):
    """logging.mlflow = a tracking URI (e.g. 'sqlite:///runs/mlflow.db', a server's URL)."""
    name = "mlflow"

    def __init__(self, uri: str, experiment: str = "jaxtrain"):
        self.mlflow = tracker.import_optional("mlflow", "mlflow")
        for name in ("mlflow", "alembic"):  # a new store's set-up logs at INFO, mid-table
            logging.getLogger(name).setLevel(logging.WARNING)
        self.uri, self.experiment = uri, experiment

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
        """model/config.json and model/checkpoints/STEP: the run's final weights as a
        workdir of their own (jaxtrain.restore, --mode=eval, predict and export take it)."""
        config = os.path.join(workdir, checkpoint.CONFIG_FILE)
        saved = os.path.join(checkpoint.checkpoint_dir(workdir), str(step))
        if not (os.path.isfile(config) and os.path.isdir(saved)):
            return
        self.client.log_artifact(self.run_id, config, "model")
        self.client.log_artifacts(self.run_id, saved, f"model/checkpoints/{step}")
