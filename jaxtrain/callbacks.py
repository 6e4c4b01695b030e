"""Your own behaviour in a run: the Callback interface, StopTraining, EarlyStopping.

A callback is an object with any of these methods, called on the host between
compiled chunks (never inside them), after the run's own actions for that chunk
(its rows logged, its evaluation done, its checkpoint saved), in this order:

    on_run_start(run)           run: RunInfo (config, workdir, steps, devices, history)
    on_rows(rows)               each chunk's metrics rows (what metrics.jsonl gets)
    on_evaluation(step, metrics)  test metrics, with the train metrics of that row
    on_checkpoint(step, path)   a checkpoint saved and on disk at `path`
    on_run_end(summary)         what summary.json holds

Each row and evaluation reaches a callback exactly once, also across a kill and a
resume: rows a killed run had already delivered are given in `run.history` when it
resumes, not again. Raising StopTraining(reason) from any method stops the run at
the end of that chunk (every process at the same step): a checkpoint is saved, the
summary records `stopped_early`, and the process exits 0. Any other exception stops
the run with one line naming the callback (exit 1; the checkpoints stay).

Callbacks come from `train_and_evaluate(..., callbacks=[...])` or from the config:
`config.callbacks.NAME = jaxtrain.defaults.callback('package.module:Class', **kwargs)`
(a built-in by its name alone: callback('EarlyStopping', monitor='test_loss')), run
in the order of their NAMEs, so a config file carries them and a resume makes them anew.
"""
import dataclasses
import importlib
import inspect
import math

import numpy as np

from jaxtrain.errors import ConfigError, TrainingError


class StopTraining(Exception):
    """Raised by a callback: stop the run after this chunk, with `reason`."""

    def __init__(self, reason: str = "a callback asked to stop"):
        super().__init__(reason)
        self.reason = reason


class CallbackError(TrainingError):
    """A callback raised something other than StopTraining; the message names it."""


@dataclasses.dataclass
class RunInfo:
    """What a run is, for on_run_start."""
    config: object             # the run's ConfigDict
    workdir: str
    start_step: int            # > 0 when resumed
    total_steps: int
    steps_per_epoch: int
    devices: int
    process_index: int
    process_count: int
    checkpoint_dir: str
    history: list = dataclasses.field(default_factory=list)  # rows delivered before a resume


class Callback:
    """Subclass and override what you need; every method is optional."""

    def on_run_start(self, run: RunInfo) -> None:
        pass

    def on_rows(self, rows: list) -> None:
        pass

    def on_evaluation(self, step: int, metrics: dict) -> None:
        pass

    def on_checkpoint(self, step: int, path: str) -> None:
        pass

    def on_run_end(self, summary: dict) -> None:
        pass


HOOKS = ("on_run_start", "on_rows", "on_evaluation", "on_checkpoint", "on_run_end")


def overrides(callback, hook: str) -> bool:
    """Whether `callback` does something in `hook` (a Callback's own method does nothing)."""
    method = getattr(type(callback), hook, None)
    return method is not None and method is not getattr(Callback, hook)


def evaluation_points(rows: list) -> list:
    """(step, metrics) of every evaluation in metrics rows: the rows with test metrics,
    a replicated run's rows of one step gathered into lists (one value per replica)."""
    by_step = {}
    for row in rows:
        if row.get("test_loss") is not None:
            by_step.setdefault(row["step"], []).append(row)
    points = []
    for step, found in sorted(by_step.items()):
        if len(found) == 1 and "replica" not in found[0]:
            points.append((step, dict(found[0])))
        else:
            found.sort(key=lambda row: row["replica"])
            points.append((step, {key: [row.get(key) for row in found] for key in found[0]}))
    return points


class EarlyStopping(Callback):
    """Stops when `monitor` has not improved by more than `min_delta` for `patience`
    evaluations in a row (eval.every_epochs / eval.every_steps give the points).

    monitor: 'test_loss', 'test_accuracy' or a train metric of the evaluated row
    ('train_loss', 'train_accuracy'); mode 'min', 'max' or 'auto' (max for accuracy).
    A replicated run watches the mean over its replicas. A resumed run rebuilds its
    state from the evaluations in its history, so it stops where an uninterrupted
    run would.
    """

    def __init__(self, monitor: str = "test_loss", patience: int = 3, min_delta: float = 0.0,
                 mode: str = "auto"):
        if mode == "auto":
            mode = "max" if "accuracy" in monitor else "min"
        if mode not in ("min", "max"):
            raise ValueError(f"mode={mode!r}: must be 'min', 'max' or 'auto'")
        if not (isinstance(patience, int) and patience >= 1):
            raise ValueError(f"patience={patience!r}: must be an int >= 1")
        if not min_delta >= 0:
            raise ValueError(f"min_delta={min_delta!r}: must be >= 0")
        self.monitor, self.patience, self.min_delta, self.mode = monitor, patience, min_delta, mode
        self.best = self.best_step = None
        self.waited = 0

    def on_run_start(self, run: RunInfo) -> None:
        for step, metrics in evaluation_points(run.history):
            self.on_evaluation(step, metrics)

    def on_evaluation(self, step: int, metrics: dict) -> None:
        if self.monitor not in metrics:
            raise ValueError(f"EarlyStopping: no metric {self.monitor!r} at evaluations "
                             f"(there are {', '.join(sorted(metrics))})")
        value = float(np.mean(metrics[self.monitor]))
        if not math.isfinite(value):
            return
        better = (self.best is None
                  or (value < self.best - self.min_delta if self.mode == "min"
                      else value > self.best + self.min_delta))
        if better:
            self.best, self.best_step, self.waited = value, step, 0
            return
        self.waited += 1
        if self.waited >= self.patience:
            raise StopTraining(f"{self.monitor} has not improved by more than {self.min_delta:g}"
                               f" for {self.patience} evaluation{'s' if self.patience > 1 else ''}"
                               f" (best {self.best:.6g} at step {self.best_step})")


def import_callback_class(spec: str):
    """'package.module:Class', or a built-in's name ('EarlyStopping')."""
    module_name, _, class_name = spec.rpartition(":") if ":" in spec else (
        __name__, None, spec)
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
    trackers config.logging names (tracking.py), then those passed from Python."""
    from jaxtrain import tracking

    made = []
    for name in config.get("callbacks", {}).keys():
        entry = config.callbacks[name]
        kwargs = entry.get("kwargs", {})
        made.append(create(name, entry.name, dict(kwargs.to_dict() if hasattr(
            kwargs, "to_dict") else kwargs)))
    return made + tracking.trackers(config.get("logging", {})) + list(given)


def describe(callback) -> str:
    return type(callback).__qualname__
