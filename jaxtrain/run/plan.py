"""The run's schedule, planned before the first step and the same on a resume: chunks cut at
epochs, checkpoints, evaluations and profile windows; which steps get a metrics row and
an evaluation; the save interval; the rows of a finished chunk."""
import dataclasses

import numpy as np

from jaxtrain.training import optim, prepare, replicas

ROWS_PER_RUN = 50  # train.log_every_steps=0: about this many metrics rows, whatever the length


def chunk_rows(per_step: dict, previous: int, ends: list, run: prepare.Setup,
               train_seconds: float, seconds: float, wait: float, schedules) -> list[dict]:
    """The metrics rows of a chunk that ran steps previous+1 .. in `seconds` (`wait` of
    them waiting for input), train_seconds in all: metrics_rows with the epoch, the
    learning rate and the time, within the chunk in proportion to its steps. A replicated
    run (per_step with a leading replica axis) has a row per replica and end, which
    names the replica, its seed and its swept settings; `schedules`: run_schedules."""
    if run.runs:
        rows = [dict(row, replica=one.replica, seed=one.seed, **one.settings)
                for one in run.runs for row in chunk_rows(
                    {name: values[one.replica] for name, values in per_step.items()},
                    previous, ends, dataclasses.replace(run, runs=None), train_seconds,
                    seconds, wait, schedules[one.replica:one.replica + 1])]
        return sorted(rows, key=lambda row: (row["step"], row["replica"]))
    rows = metrics_rows(per_step, previous, ends)
    step = previous + len(per_step["loss"])
    for row in rows:
        row.update(epoch=round(row["step"] / run.steps_per_epoch, 4),
                   learning_rate=float(schedules[0](row["step"] - 1)),
                   input_wait_fraction=round(wait / max(seconds, 1e-9), 4),
                   seconds=round(train_seconds - seconds * (step - row["step"])
                                 / max(step - previous, 1), 4))
    return rows


def row_grid(log_every_steps: int, steps_per_epoch: int, total_steps: int):
    """Which steps get a metrics.jsonl row: every multiple of train.log_every_steps, or
    (0) about ROWS_PER_RUN a run, spread evenly within each epoch and ending on its
    last step (so no row averages a sliver of steps). Returns step -> bool."""
    if log_every_steps > 0:
        return lambda step: step % log_every_steps == 0
    per_epoch = max(1, round(ROWS_PER_RUN * steps_per_epoch / total_steps))
    if per_epoch >= steps_per_epoch:
        return lambda step: True
    positions = {round(j * steps_per_epoch / per_epoch) for j in range(1, per_epoch + 1)}
    return lambda step: (step % steps_per_epoch or steps_per_epoch) in positions


def metrics_rows(per_step: dict, first: int, ends: list) -> list[dict]:
    """metrics.jsonl rows of one chunk (steps first+1 ..), one ending at each step in
    `ends`, from the chunk's per-step metrics: each row is the mean over its finite
    steps since the row before (None: none finite), with the count of skipped
    (non-finite) steps where there were any."""
    rows, begin = [], first
    for end in ends:
        window = slice(begin - first, end - first)
        losses = np.asarray(per_step["loss"][window], np.float64)
        accuracies = np.asarray(per_step["accuracy"][window], np.float64)
        finite = np.isfinite(losses)
        row = {"step": end,
               "train_loss": float(losses[finite].mean()) if finite.any() else None,
               "train_accuracy": float(accuracies[finite].mean()) if finite.any() else None}
        if not finite.all():
            row["skipped_steps"] = int((~finite).sum())
        rows.append(row)
        begin = end
    return rows


def run_schedules(config, run: prepare.Setup) -> list:
    """The learning-rate schedule of each replica (one for a single run), for the rows."""
    if not run.runs:
        return [run.schedule]
    return [optim.create_schedule(replicas.run_config(config, one).optimizer, run.total_steps)
            for one in run.runs]


def profile_window(start_step: int, total_steps: int, steps: int):
    """(first, end) global steps of a --profile trace: `steps` steps after one warm-up step
    of this process (the first call of a compiled program pays one-off costs); None when
    not profiling or nothing is left to trace."""
    first = start_step + 1
    if steps <= 0 or first >= total_steps:
        return None
    return first, min(first + steps, total_steps)


def plan_chunks(total_steps: int, steps_per_epoch: int, every_steps=(), start_step: int = 0,
                breaks=()):
    """[(epoch, first_step_in_epoch, num_steps)] from start_step to total_steps.

    Chunks end at every epoch end, at every multiple of each interval in every_steps
    (checkpoints, evaluations; 0 = none) and at the steps in breaks. The grid does not
    depend on start_step, so a resumed run computes the same chunks as an uninterrupted
    one. Metrics rows need no chunk end: they come from each chunk's per-step metrics.
    """
    plan, step = [], start_step
    while step < total_steps:
        epoch, in_epoch = divmod(step, steps_per_epoch)
        end = min(step - in_epoch + steps_per_epoch, total_steps)
        for every in every_steps:
            if every > 0:
                end = min(end, step - step % every + every)
        end = min([end] + [b for b in breaks if b > step])
        plan.append((epoch, in_epoch, end - step))
        step = end
    return plan


def save_interval(config, steps_per_epoch: int) -> int:
    """checkpoint.every_steps, else checkpoint.every_epochs in steps; 0 = only at the end."""
    if config.checkpoint.every_steps > 0:
        return config.checkpoint.every_steps
    return max(config.checkpoint.every_epochs, 0) * steps_per_epoch


def evaluates_after(step: int, steps_per_epoch: int, total_steps: int, every_epochs: int,
                    every_steps: int = 0):
    """Evaluation schedule: after the last step, every `every_epochs` epochs and every
    `every_steps` steps (0: neither)."""
    epoch_done = step % steps_per_epoch == 0
    return (step == total_steps
            or (epoch_done and every_epochs > 0 and (step // steps_per_epoch) % every_epochs == 0)
            or (every_steps > 0 and step % every_steps == 0))
