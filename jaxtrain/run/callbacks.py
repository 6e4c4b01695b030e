"""The run's callbacks assembled, as a trainer assembles them (config.callbacks' entries,
the trackers config.logging names, then those passed from Python), and what the loop hands
them (UserCallbacks). jaxtrain.callbacks holds only the callbacks themselves."""
import importlib
import inspect
import os
import sys

import jax

from jaxtrain.callbacks import base
from jaxtrain.callbacks.trackers import mlflow as mlflow_tracker
from jaxtrain.callbacks.trackers import wandb as wandb_tracker
from jaxtrain.errors import ConfigError
from jaxtrain.run import rows as rows_lib
from jaxtrain.runtime import report
from jaxtrain.training import checkpoint

BUILT_IN = "jaxtrain.callbacks"  # where a callback named without a module is found


def import_callback_class(spec: str):
    """'package.module:Class', or a built-in's name ('EarlyStopping')."""
    module_name, _, class_name = spec.rpartition(":") if ":" in spec else (
        BUILT_IN, None, spec)
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"cannot import {module_name!r} ({error}); it must be installed or "
                         "on sys.path (e.g. PYTHONPATH)") from None
    cls = getattr(module, class_name, None)
    if not inspect.isclass(cls):
        raise ValueError(f"module {module_name!r} has no class {class_name!r}")
    return cls


def create(name: str, spec: str, kwargs: dict):
    """config.callbacks.NAME made: the class `spec` names, built with `kwargs`."""
    try:
        cls = import_callback_class(spec)
        return cls(**kwargs)
    except (ValueError, TypeError) as error:
        raise ConfigError(f"config.callbacks.{name}.name={spec!r}: {error}") from None


def from_config(config, given=()) -> list:
    """The run's callbacks: config.callbacks' entries in the order of their names, the
    trackers config.logging names, then those passed from Python."""
    made = []
    for name in config.get("callbacks", {}).keys():
        made.append(create(name, config.callbacks[name].name,
                           callback_kwargs(config.callbacks[name])))
    return made + trackers(config.get("logging", {})) + list(given)


def callback_kwargs(entry) -> dict:
    """A config.callbacks entry's arguments: its keys beside `name`, and (configs saved
    before they were keys of their own) those under `kwargs`."""
    entry = entry.to_dict() if hasattr(entry, "to_dict") else dict(entry)
    return {**entry.pop("kwargs", {}), **{k: v for k, v in entry.items() if k != "name"}}


def describe(callback) -> str:
    return type(callback).__qualname__


def trackers(logging_config) -> list:
    """The trackers config.logging asks for (none: neither tracker's package imported)."""
    made = []
    if logging_config.get("mlflow"):
        made.append(mlflow_tracker.MLflowTracker(
            logging_config.mlflow, logging_config.mlflow_experiment,
            logging_config.get("mlflow_registered_model", "")))
    if logging_config.get("wandb"):
        made.append(wandb_tracker.WandbTracker(logging_config.wandb, logging_config.wandb_mode))
    return made


class UserCallbacks:
    """Hands the run's rows, evaluations, checkpoints and end to the user's callbacks:
    each row and evaluation exactly once, also across a kill and resume (rows the file
    held past the resumed step were delivered before the kill: they come as history,
    not again). A StopTraining is kept as `stop_reason` (the first one); any other
    exception stops the run as a CallbackError naming the callback. `window`: the run's
    rows.RowWindow (the epoch's steps not in a row yet, for on_evaluation's means)."""

    def __init__(self, run, window, callbacks: list):
        self.run, self.window, self.callbacks = run, window, callbacks
        self.delivered = set()  # (step, replica, 'train' or 'test') of the rows delivered
        self.stop_reason = None
        self.started = False

    def call(self, hook: str, *args, step: int):
        for callback in self.callbacks:
            if not base.overrides(callback, hook):
                continue
            try:
                getattr(callback, hook)(*args)
            except base.StopTraining as stop:
                if self.stop_reason is None:
                    self.stop_reason = stop.reason
            except Exception as error:
                raise base.CallbackError(
                    f"callback {describe(callback)}.{hook} failed at step {step}: "
                    f"{type(error).__name__}: {first_line(error)}; {self.kept()}") from error

    def kept(self) -> str:
        """Where the checkpoints are (the save of this step waited for, if one is under way)."""
        manager = self.run.manager
        try:
            checkpoint.wait(manager)
        except checkpoint.CheckpointError:
            pass
        saved = sorted(manager.all_steps())
        return (f"the checkpoints are kept in {manager.directory} (newest: step {saved[-1]})"
                if saved else "no checkpoint was saved yet")

    def start(self) -> None:
        run = self.run
        history = list(run.reporter.previous_records)
        self.delivered = {key for row in history for key in row_keys(row)}
        info = base.RunInfo(
            config=run.config, workdir=run.workdir, start_step=run.start_step,
            total_steps=run.setup.total_steps, steps_per_epoch=run.setup.steps_per_epoch,
            devices=jax.device_count(), process_index=jax.process_index(),
            process_count=jax.process_count(), checkpoint_dir=run.manager.directory,
            history=history)
        self.started = True
        self.call("on_run_start", info, step=run.start_step)

    def deliver(self, rows: list, step: int, saved_step: int | None = None) -> None:
        """The new rows up to `step` (on_rows), the evaluations among them (on_evaluation)
        and the checkpoint saved at `saved_step` (on_checkpoint, once it is on disk)."""
        if not self.callbacks:
            return
        rows = [row for row in rows if not row_keys(row) <= self.delivered]
        self.delivered.update(key for row in rows for key in row_keys(row))
        if rows:
            self.call("on_rows", [dict(row) for row in rows], step=step)
        for at, metrics in base.evaluation_points(rows):
            self.call("on_evaluation", at, self.with_epoch_means(at, metrics), step=at)
        if saved_step is not None and any(base.overrides(c, "on_checkpoint")
                                          for c in self.callbacks):
            checkpoint.wait(self.run.manager)  # on disk before anyone is told
            path = os.path.join(self.run.manager.directory, str(saved_step))
            self.call("on_checkpoint", saved_step, path, step=saved_step)

    def with_epoch_means(self, step: int, metrics: dict) -> dict:
        """An evaluation's metrics with train_loss and train_accuracy the mean over its
        epoch's steps up to `step`: the figures the console's epoch row shows (a metrics
        row's own are the mean since the row before)."""
        setup = self.run.setup
        records = [row for row in self.run.reporter.records if row["step"] <= step]
        records += [row for row in rows_lib.pending_rows(self.window, setup)
                    if row["step"] == step]
        spe = setup.steps_per_epoch
        if "replica" in metrics:  # a replicated run: a list per metric, one per replica
            means = [report.epoch_means(records, spe, r) for r in metrics["replica"]]
            return dict(metrics, **{key: [m.get(key) for m in means]
                                    for key in ("train_loss", "train_accuracy")})
        return dict(metrics, **report.epoch_means(records, spe))

    def run_end(self, summary: dict) -> None:
        self.call("on_run_end", summary, step=summary["steps"])

    def failed(self, error: BaseException) -> None:
        """on_exception(error): the run ends by `error` (a signal's Interrupted, a failure).
        A callback failing here is said in one line; `error` goes on as it was."""
        if not self.started:
            return
        for callback in self.callbacks:
            if base.overrides(callback, "on_exception"):
                try:
                    callback.on_exception(error)
                except Exception as failure:
                    print(f"warning: callback {describe(callback)}.on_exception failed: "
                          f"{type(failure).__name__}: {first_line(failure)}", file=sys.stderr,
                          flush=True)


def row_keys(row: dict) -> set:
    """What a row reports: its training figures, its test figures, or both."""
    kinds = ({"train"} if "train_loss" in row else set()) | (
        {"test"} if "test_loss" in row else set())
    return {(row["step"], row.get("replica"), kind) for kind in kinds}


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else ""
