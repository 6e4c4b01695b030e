"""Experiment trackers as callbacks: MLflow (logging.mlflow) and Weights & Biases
(logging.wandb). Each is an optional dependency, imported only when its key is set
(pip install 'jaxtrain[mlflow]' or 'jaxtrain[wandb]'), and logs from process 0 alone.

Both log the flattened config as parameters, every metrics row at its step, and the
summary at the end; MLflow also keeps summary.json and curves.png as artifacts. A
resumed run goes on logging into the same tracker run (its id is kept in
WORKDIR/tracking.json), and rows delivered before a kill are not logged twice
(callbacks.py's exactly-once rule).
"""
import json
import math
import os

from jaxtrain import report
from jaxtrain.callbacks import Callback
from jaxtrain.errors import ConfigError

TRACKING_FILE = "tracking.json"  # WORKDIR/tracking.json: {tracker: its run id}
RUN_KEYS = ("step", "replica", "seed")


def flat_config(config) -> dict:
    """{'train.batch_size': 128, ...}: the config as one level of dotted keys."""
    def flat(tree, prefix=""):
        out = {}
        for key, value in tree.items():
            if isinstance(value, dict) and value:
                out.update(flat(value, f"{prefix}{key}."))
            else:
                out[f"{prefix}{key}"] = value
        return out
    return flat(config.to_dict() if hasattr(config, "to_dict") else config)


def row_metrics(row: dict) -> dict:
    """A metrics row's numbers by name (a replica's as NAME/replica_K)."""
    suffix = f"/replica_{row['replica']}" if "replica" in row else ""
    return {key + suffix: float(value) for key, value in row.items()
            if key not in RUN_KEYS and "." not in key and isinstance(value, (int, float))
            and not isinstance(value, bool) and math.isfinite(value)}


def summary_metrics(summary: dict) -> dict:
    return {f"summary/{key}": float(value) for key, value in summary.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value)}


def import_optional(name: str, extra: str):
    try:
        return __import__(name)
    except ImportError as error:
        raise ConfigError(f"config.logging.{extra} needs the {name} package: pip install "
                          f"'jaxtrain[{extra}]' ({error})") from None


class Tracker(Callback):
    """What both trackers share: process 0 alone, the run id kept in the workdir."""
    name = ""

    def on_run_start(self, run):
        self.active = run.process_index == 0
        self.path = os.path.join(run.workdir, TRACKING_FILE)
        if self.active:
            self.start(run, self.saved_ids().get(self.name))

    def saved_ids(self) -> dict:
        try:
            with open(self.path) as f:
                return json.load(f)
        except (OSError, ValueError):
            return {}

    def keep_id(self, run_id: str) -> None:
        report.write_json_atomically(self.path, dict(self.saved_ids(), **{self.name: run_id}))

    def on_rows(self, rows):
        if self.active:
            self.log([(row["step"], row_metrics(row)) for row in rows])

    def on_run_end(self, summary):
        if self.active:
            self.end(summary)


class MLflowTracker(Tracker):
    """logging.mlflow = a tracking URI (e.g. 'sqlite:///runs/mlflow.db', a server's URL)."""
    name = "mlflow"

    def __init__(self, uri: str, experiment: str = "jaxtrain"):
        self.mlflow = import_optional("mlflow", "mlflow")
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
                      for key, value in flat_config(run.config).items()]
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
            for key, value in summary_metrics(summary).items()])
        for name in (report.SUMMARY_FILE, report.PLOT_FILE):
            if os.path.exists(os.path.join(workdir, name)):
                self.client.log_artifact(self.run_id, os.path.join(workdir, name))
        self.client.set_terminated(self.run_id, "FINISHED")


class WandbTracker(Tracker):
    """logging.wandb = a project name; logging.wandb_mode 'offline' (no network: the run
    stays in WORKDIR/wandb for `wandb sync`) or 'online'."""
    name = "wandb"

    def __init__(self, project: str, mode: str = "offline"):
        self.wandb = import_optional("wandb", "wandb")
        self.project, self.mode = project, mode

    def start(self, run, run_id):
        self.run = self.wandb.init(
            project=self.project, mode=self.mode, dir=os.path.abspath(run.workdir),
            name=os.path.basename(os.path.abspath(run.workdir)), id=run_id,
            resume="allow" if run_id else None, config=flat_config(run.config))
        if run_id is None:
            self.keep_id(self.run.id)

    def log(self, rows):
        for step, metrics in rows:
            self.run.log(metrics, step=step)

    def end(self, summary):
        self.run.summary.update(summary_metrics(summary))
        self.run.finish()


def trackers(logging_config) -> list:
    """The trackers config.logging asks for (none: nothing imported)."""
    made = []
    if logging_config.get("mlflow"):
        made.append(MLflowTracker(logging_config.mlflow, logging_config.mlflow_experiment))
    if logging_config.get("wandb"):
        made.append(WandbTracker(logging_config.wandb, logging_config.wandb_mode))
    return made
