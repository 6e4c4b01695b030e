"""One planned chunk of a run (loop.py's first lines of each iteration): its steps
trained, in calls of train.chunk_seconds once a scanned chunk has run longer, its losses
checked (train.nonfinite='stop'), its training rows taken."""
import numpy as np

from jaxtrain.errors import TrainingError
from jaxtrain.run import rows as rows_lib
from jaxtrain.training import chunks, replicas


def train(s, chunk, stop, projection) -> None:
    """Runs the chunk's steps. The progress bar moves after every compiled call; in a
    single-process run a signal stops the chunk after the call in hand (train.chunk_seconds
    keeps a scanned call that short; a call per step stops after the step)."""
    waited = s.stream.wait_seconds if s.stream is not None else 0.0

    def progress(done, metrics) -> bool:
        s.reporter.advance(chunk.previous + done)
        projection.during(chunk.previous, done, metrics)
        return s.single_process and stop()
    (s.state, out), chunk.seconds = chunks.timed(s.run_chunk, s.state, s.data_key, chunk.epoch,
                                                 chunk.first_step, chunk.length, progress)
    chunk.per_step = out["per_step"]
    chunk.step = s.step = chunk.previous + np.shape(chunk.per_step["loss"])[-1]
    chunk.wait = s.stream.wait_seconds - waited if s.stream is not None else 0.0
    s.train_seconds += chunk.seconds
    s.chunk_seconds += chunk.seconds
    s.wait_seconds += chunk.wait
    projection.after(chunk)
    if (s.pace is not None and not s.paced and s.single_process
            and chunk.seconds > s.pace.seconds and s.step < s.setup.total_steps):
        pace_from_now(s, chunk)


def pace_from_now(s, chunk) -> None:
    """A scanned chunk ran past train.chunk_seconds (a GPU's chunks are compiled per length
    and run whole): the program that runs any number of steps is compiled now, and every
    later chunk runs in calls of about that long."""
    s.clock.lap("train")
    s.run_chunk.pace_from_now(s.state, s.data_key)
    s.paced = True
    s.compile_seconds += s.clock.lap(
        "compile", f"a chunk took {chunk.seconds:.1f} s, over train.chunk_seconds="
        f"{s.pace.seconds:g}: from step {chunk.step} on, chunks run in calls of about that "
        "long (a signal stops the run after the one in hand); compiled in {seconds:.1f} s")


def check_finite(s, chunk) -> None:
    """train.nonfinite='stop': a TrainingError at the chunk's first non-finite loss,
    naming the step (and the replica, for a replicated run)."""
    if s.config.train.nonfinite != "stop":
        return
    losses = np.atleast_2d(chunk.per_step["loss"])  # (replicas, steps)
    bad = ~np.isfinite(losses)
    if not bad.any():
        return
    index = int(np.argmax(bad.any(axis=0)))
    replica = int(np.argmax(bad[:, index]))
    which = f" of {replicas.describe(s.setup.runs[replica])}" if s.setup.runs else ""
    raise TrainingError(
        f"non-finite training loss at step {chunk.previous + index + 1} (epoch {chunk.epoch})"
        f"{which}; the last good checkpoint is kept in {s.manager.directory}. Lower "
        "optimizer.learning_rate, check the data, or set train.nonfinite='skip' to skip "
        "such steps")


def take_rows(s, chunk) -> list:
    """The chunk's steps into the row window, and the training rows that end in it."""
    s.window.add(chunk.per_step)
    ends = [step for step in range(chunk.previous + 1, chunk.step + 1) if s.on_grid(step)]
    new = rows_lib.train_rows(s.window, ends, s.setup, s.schedules, s.train_seconds, chunk)
    s.clock.lap("train")
    return new
