"""Your own behaviour in a run: the Callback interface, StopTraining, EarlyStopping.

A callback is an object with any of these methods, called on the host between
compiled chunks (never inside them), after the run's own work for that chunk (its
rows logged, its evaluation done, its checkpoint saved), in this order:

    on_run_start(run)           run: RunInfo (config, workdir, steps, devices, history)
    on_rows(rows)               each chunk's metrics rows (what metrics.jsonl gets)
    on_evaluation(step, metrics)  test metrics, with train_loss and train_accuracy the
                                mean over the epoch's steps up to `step` (what the
                                console's epoch row shows)
    on_checkpoint(step, path)   a checkpoint saved and on disk at `path`
    on_run_end(summary)         what summary.json holds
    on_exception(error)         instead of on_run_end, when the run ends by an exception:
                                jaxtrain.Interrupted for a signal (its checkpoint saved),
                                any other for a failure (the trackers end their runs
                                KILLED or FAILED here)

Each row and evaluation reaches a callback exactly once, also across a kill and a
resume: rows a killed run had already delivered are given in `run.history` when it
resumes, not again. Raising StopTraining(reason) from any method stops the run at
the end of that chunk (every process at the same step): a checkpoint is saved, the
summary records `stopped_early`, and the process exits 0. Any other exception stops
the run with one line naming the callback (exit 1; the checkpoints stay).

Callbacks come from `train_and_evaluate(..., callbacks=[...])` or from the config:
`config.callbacks.NAME = jaxtrain.config.defaults.callback('package.module:Class', **kwargs)`
(a built-in by its name alone: callback('EarlyStopping', monitor='test_loss')), run
in the order of their NAMEs, so a config file carries them and a resume makes them anew."""
import dataclasses

from jaxtrain.errors import TrainingError


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

    def on_exception(self, error: BaseException) -> None:
        pass


HOOKS = ("on_run_start", "on_rows", "on_evaluation", "on_checkpoint", "on_run_end",
         "on_exception")


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
