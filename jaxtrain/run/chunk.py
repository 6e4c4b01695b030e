"""One planned chunk of a run (loop.py's first lines of each iteration): its steps trained,
in calls of train.chunk_seconds once a scanned chunk has run longer, its losses checked
(train.nonfinite='stop'), its training rows taken."""
import numpy as np

from jaxtrain.errors import TrainingError
from jaxtrain.run import rows as rows_lib
from jaxtrain.training import chunks, replicas


def train(run, state, chunk, stop, projection, times):
    """Runs the chunk's steps from `state`; returns the state after them and fills in the
    chunk's step, metrics and seconds. The progress bar moves after every compiled call;
    in a single-process run a signal stops the chunk after the call in hand
    (train.chunk_seconds keeps a scanned call that short; a call per step stops after
    the step). `projection` times the first steps as they run."""
    waited = run.stream.wait_seconds if run.stream is not None else 0.0

    def progress(done, metrics) -> bool:
        run.reporter.advance(chunk.previous + done)
        projection.during(chunk.previous, done, metrics)
        return run.single_process and stop()
    (state, out), chunk.seconds = chunks.timed(run.run_chunk, state, run.data_key, chunk.epoch,
                                               chunk.first_step, chunk.length, progress)
    chunk.per_step = out["per_step"]
    chunk.step = chunk.previous + np.shape(chunk.per_step["loss"])[-1]
    chunk.wait = run.stream.wait_seconds - waited if run.stream is not None else 0.0
    times.train += chunk.seconds
    times.chunks += chunk.seconds
    times.wait += chunk.wait
    return state


def over_pace(run, chunk, paced: bool) -> bool:
    """Whether a whole scanned chunk ran past train.chunk_seconds, with steps left after it
    (a GPU's chunks are compiled per length and run whole until one does)."""
    return (run.pace is not None and not paced and run.single_process
            and chunk.seconds > run.pace.seconds and chunk.step < run.setup.total_steps)


def pace_from_now(run, state, chunk, times) -> None:
    """Compiles the program that runs any number of steps: every later chunk runs in calls
    of about train.chunk_seconds."""
    run.clock.lap("train")
    run.run_chunk.pace_from_now(state, run.data_key)
    times.compile += run.clock.lap(
        "compile", f"a chunk took {chunk.seconds:.1f} s, over train.chunk_seconds="
        f"{run.pace.seconds:g}: from step {chunk.step} on, chunks run in calls of about that "
        "long (a signal stops the run after the one in hand); compiled in {seconds:.1f} s")


def check_finite(run, chunk) -> None:
    """train.nonfinite='stop': a TrainingError at the chunk's first non-finite loss,
    naming the step (and the replica, for a replicated run)."""
    if not run.stop_at_nonfinite:
        return
    losses = np.atleast_2d(chunk.per_step["loss"])  # (replicas, steps)
    bad = ~np.isfinite(losses)
    if not bad.any():
        return
    index = int(np.argmax(bad.any(axis=0)))
    replica = int(np.argmax(bad[:, index]))
    which = f" of {replicas.describe(run.setup.runs[replica])}" if run.setup.runs else ""
    raise TrainingError(
        f"non-finite training loss at step {chunk.previous + index + 1} (epoch {chunk.epoch})"
        f"{which}; the last good checkpoint is kept in {run.manager.directory}. Lower "
        "optimizer.learning_rate, check the data, or set train.nonfinite='skip' to skip "
        "such steps")


def take_rows(run, window, chunk, times) -> list:
    """The chunk's steps into the row window, and the training rows that end in it."""
    window.add(chunk.per_step)
    ends = [step for step in range(chunk.previous + 1, chunk.step + 1) if run.on_grid(step)]
    new = rows_lib.train_rows(window, ends, run.setup, run.schedules, times.train, chunk)
    run.clock.lap("train")
    return new
