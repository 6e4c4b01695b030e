"""metrics.jsonl's rows: which steps get one, what each holds, and the console's row.

A training row averages every step since the row before it, whatever chunk ends,
evaluations and checkpoints fell between (RowWindow), so the rows are a function of
the training alone: the same for any checkpoint or evaluation cadence, and, since the
window travels with each checkpoint, for a run killed and resumed. An evaluation adds
its test metrics to the row of its step, or is a row of its own where no training row
ends (a row without train_* keys)."""
import dataclasses

import numpy as np

from jaxtrain.runtime import report
from jaxtrain.training import optim, prepare, replicas

ROWS_PER_RUN = 50  # train.log_every_steps=0: about this many metrics rows, whatever the length


def row_grid(log_every_steps: int, steps_per_epoch: int, total_steps: int):
    """Which steps end a training row: every multiple of train.log_every_steps, or (0)
    about ROWS_PER_RUN a run, spread evenly within each epoch; and always every epoch's
    last step and the run's. Returns step -> bool."""
    if log_every_steps > 0:
        every = lambda step: step % log_every_steps == 0
    else:
        per_epoch = max(1, round(ROWS_PER_RUN * steps_per_epoch / total_steps))
        positions = {round(j * steps_per_epoch / per_epoch) for j in range(1, per_epoch + 1)}
        every = lambda step: (step % steps_per_epoch or steps_per_epoch) in positions
    return lambda step: every(step) or step % steps_per_epoch == 0 or step == total_steps


class RowWindow:
    """The per-step training metrics since the last row (`after`: that row's step), each
    a NumPy array over the steps (a replica axis first, for replicas)."""

    def __init__(self, after: int, per_step: dict | None = None):
        self.after = after
        self.per_step = per_step

    def add(self, per_step: dict) -> None:
        """The metrics of the steps that follow the window's."""
        if self.per_step is None:
            self.per_step = {name: np.asarray(values) for name, values in per_step.items()}
        else:
            self.per_step = {name: np.concatenate([self.per_step[name], per_step[name]], -1)
                             for name in self.per_step}

    @property
    def steps(self) -> int:
        return 0 if self.per_step is None else np.shape(self.per_step["loss"])[-1]

    def take(self, end: int) -> dict:
        """The metrics of steps after+1 .. end, removed from the window."""
        count = end - self.after
        taken = {name: values[..., :count] for name, values in self.per_step.items()}
        self.per_step = {name: values[..., count:] for name, values in self.per_step.items()}
        self.after = end
        return taken

    def to_json(self) -> dict:
        """For a checkpoint's meta (a non-finite loss as None)."""
        values = {} if self.per_step is None else {
            name: np.where(np.isfinite(array), np.asarray(array, np.float64), None).tolist()
            for name, array in self.per_step.items()}
        return {"after": self.after, **values}

    @classmethod
    def from_json(cls, saved: dict) -> "RowWindow":
        per_step = {name: np.asarray(values, np.float64) for name, values in saved.items()
                    if name != "after"}  # None becomes nan
        return cls(saved["after"], per_step or None)


def train_row(per_step: dict, step: int) -> dict:
    """A training row at `step`: the mean loss and accuracy of its finite steps (None:
    none finite), with the count of skipped (non-finite) steps where there were any."""
    losses = np.asarray(per_step["loss"], np.float64)
    accuracies = np.asarray(per_step["accuracy"], np.float64)
    finite = np.isfinite(losses)
    row = {"step": step,
           "train_loss": float(losses[finite].mean()) if finite.any() else None,
           "train_accuracy": float(accuracies[finite].mean()) if finite.any() else None}
    if not finite.all():
        row["skipped_steps"] = int((~finite).sum())
    return row


def train_rows(window: RowWindow, ends: list, run: prepare.Setup, schedules,
               train_seconds: float, chunk) -> list:
    """The training rows ending at `ends`, steps of `chunk` (a Chunk that has run),
    taken from `window`: with the epoch, the learning rate and the time (train_seconds
    after the chunk; within it, in proportion to its steps). A replicated run has a row
    per replica and end, naming the replica, its seed and its swept settings;
    `schedules`: run_schedules."""
    rows = []
    for end in ends:
        per_step = window.take(end)
        seconds = train_seconds - chunk.seconds * (chunk.step - end) / max(
            chunk.step - chunk.previous, 1)
        for one in run.runs or [None]:
            if one is None:
                row, schedule = train_row(per_step, end), schedules[0]
            else:
                row = dict(train_row({name: values[one.replica]
                                      for name, values in per_step.items()}, end),
                           replica=one.replica, seed=one.seed, **one.settings)
                schedule = schedules[one.replica]
            row.update(epoch=round(end / run.steps_per_epoch, 4),
                       **({} if schedule is None else
                          {"learning_rate": float(schedule(end - 1))}),
                       input_wait_fraction=round(chunk.wait / max(chunk.seconds, 1e-9), 4),
                       seconds=round(seconds, 4))
            rows.append(row)
    return rows


def pending_rows(window: RowWindow, run: prepare.Setup) -> list:
    """The window's steps as rows at its last step, not taken from it: what the epoch's
    means include at an evaluation where no row ends (train_loss for on_evaluation)."""
    if not window.steps:
        return []
    step = window.after + window.steps
    if not run.runs:
        return [train_row(window.per_step, step)]
    return [dict(train_row({name: values[one.replica] for name, values in
                            window.per_step.items()}, step), replica=one.replica)
            for one in run.runs]


def test_rows(step: int, metrics: dict, run: prepare.Setup, seconds: float) -> list:
    """An evaluation's rows at `step` where no training row ends: its test metrics alone
    (for each replica, naming it)."""
    rows = []
    for one in run.runs or [None]:
        row = {"step": step, "epoch": round(step / run.steps_per_epoch, 4)}
        if one is not None:
            row.update(replica=one.replica, seed=one.seed, **one.settings)
        row.update(seconds=round(seconds, 4), **test_fields(metrics, one))
        rows.append(row)
    return rows


def test_fields(metrics: dict, one=None) -> dict:
    """{test_NAME: value}: one replica's, for a replicated run's metrics (lists)."""
    return {f"test_{name}": value if one is None else value[one.replica]
            for name, value in metrics.items()}


def with_test_metrics(rows: list, step: int, metrics: dict, run: prepare.Setup,
                      seconds: float) -> list:
    """`rows` with an evaluation of `step` in them: added to the training rows of that
    step, else as rows of its own after them."""
    at_step = [row for row in rows if row["step"] == step]
    if not at_step:
        return rows + test_rows(step, metrics, run, seconds)
    by_replica = {one.replica: one for one in run.runs} if run.runs else {None: None}
    for row in at_step:
        row.update(seconds=round(seconds, 4),
                   **test_fields(metrics, by_replica[row.get("replica")]))
    return rows


def run_schedules(config, run: prepare.Setup) -> list:
    """The learning-rate schedule of each replica (one for a single run), for the rows;
    None for an optimiser that does not take it (a transformation passed from Python)."""
    if not run.logs_learning_rate:
        return [None] * len(run.runs or [None])
    if not run.runs:
        return [run.schedule]
    return [optim.create_schedule(replicas.run_config(config, one).optimizer, run.total_steps)
            for one in run.runs]


def console_row(records: list, steps_per_epoch: int) -> dict:
    """The console's row at an epoch's end: the last row of each replica with the epoch's
    mean training figures; for a replicated run, (mean, std) over the replicas of each
    figure."""
    step = records[-1]["step"]
    latest = {}
    for row in records:
        if row["step"] == step:
            latest.setdefault(row.get("replica"), {}).update(row)
    rows = {replica: dict(row, **report.epoch_means(records, steps_per_epoch, replica))
            for replica, row in latest.items()}
    if list(rows) == [None]:
        return rows[None]
    row = dict(rows[max(rows)])
    for key in ("train_loss", "train_accuracy", "test_loss", "test_accuracy", "test_loss_ema",
                "test_accuracy_ema"):
        if all(one.get(key) is not None for one in rows.values()):
            row[key] = replicas.mean_std(one[key] for one in rows.values())
    return row


@dataclasses.dataclass
class Chunk:
    """One planned chunk, and what running it produced."""
    epoch: int
    first_step: int            # in the epoch
    length: int
    previous: int = 0          # the global step before it ran
    step: int = 0              # after it (less than planned if a signal cut it short)
    seconds: float = 0.0
    wait: float = 0.0          # of the seconds, waiting for streamed input
    per_step: dict = None      # its steps' metrics, on the host
