"""Experiment trackers as callbacks: MLflow (logging.mlflow) and Weights & Biases
(logging.wandb). Each is an optional dependency, imported only when its key is set
(pip install 'jaxtrain[mlflow]' or 'jaxtrain[wandb]'), and logs from process 0 alone.

Both log the flattened config as parameters, every metrics row at its step, and the
summary at the end; MLflow also keeps summary.json and curves.png as artifacts. A run
stopped by a signal ends as killed, one that fails as failed. A resumed run goes on
logging into the same tracker run (its id is kept in WORKDIR/tracking.json), and rows
delivered before a kill are not logged twice (callbacks.py's exactly-once rule)."""
import json
import math
import os

from jaxtrain.callbacks.base import Callback
from jaxtrain.errors import ConfigError
from jaxtrain.runtime import report

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
        self.active = False  # until its run is started: a failed start has none to end
        self.path = os.path.join(run.workdir, TRACKING_FILE)
        if run.process_index == 0:
            self.start(run, self.saved_ids().get(self.name))
            self.active = True

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

    def on_exception(self, error):
        """The run ended by a signal (jaxtrain.Interrupted: its run is KILLED, and a rerun
        resumes it) or a failure (FAILED)."""
        if self.active:
            self.stop(getattr(error, "signum", None))
