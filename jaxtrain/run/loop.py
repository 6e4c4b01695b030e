"""One run, top to bottom (run_checked): set up and restore or initialise (start.py), then
for each planned chunk: train it, take its rows; if a signal came, save its steps and stop;
else evaluate and save when due, write the rows, hand them to the user's callbacks, and
stop where one asked; then the summary (summary.py). Each line of the loop is a function
below it, in the loop's order, or a chunk's own (chunk.py: train it, check it, its rows)."""
import signal

import jax
import numpy as np

from jaxtrain.config import checks
from jaxtrain.models import user
from jaxtrain.run import callbacks as callbacks_lib
from jaxtrain.run import chunk as chunk_lib
from jaxtrain.run import profiling, projection as projection_lib, resume
from jaxtrain.run import rows as rows_lib
from jaxtrain.run import start as start_lib
from jaxtrain.run import summary as summary_lib
from jaxtrain.runtime import phases, processes, signals
from jaxtrain.training import checkpoint, chunks, evaluation, train_state

PROFILE_DIR = profiling.PROFILE_DIR


def train_and_evaluate(config, workdir: str, *, model=None, start_time: float | None = None,
                       profile_steps: int = 0, warm_up: bool = False, callbacks=(),
                       peers=None) -> dict:
    """Trains and evaluates the model the config describes; writes reports to workdir.

    Resumes from the newest checkpoint in workdir/checkpoints when there is one.
    Returns the summary (also written to workdir/summary.json). In a multi-process
    run every process calls this; process 0 alone prints and writes the reports.
    start_time: when the process started (main.py), so summary.json's total_seconds
    and its phase_seconds cover the imports too. profile_steps > 0: trace that many
    steps after a warm-up step into workdir/profile and print the costliest XLA ops.
    warm_up: run every compiled program once, untimed, on a copy of the state before
    training (jaxtrain.compare: first-run costs kept out of train_seconds, as the PyTorch
    twins' warm-up keeps them out); the run itself is unchanged. callbacks: objects
    with jaxtrain.Callback's methods, after those config.callbacks names. peers: what
    processes.initialize returned in a multi-process run (told where the checkpoints go).
    """
    clock = phases.Clock(start_time, say=print_now if processes.is_main_process() else None)
    clock.lap("imports", "imported JAX, Flax and jaxtrain" if start_time is not None else None)
    signals.enter_phase("checking the config; nothing written yet")
    checks.check_config(config)
    return run_checked(config, workdir, model=model, clock=clock, profile_steps=profile_steps,
                       warm_up=warm_up, callbacks=callbacks, peers=peers)


def run_checked(config, workdir: str, *, model=None, clock=None, profile_steps: int = 0,
                warm_up: bool = False, callbacks=(), peers=None) -> dict:
    """train_and_evaluate with a config already checked (checks.check_config), where the
    command that started it checked it (jaxtrain.compare)."""
    if clock is None:
        clock = phases.Clock(None, say=print_now if processes.is_main_process() else None)
    config = run_config(config, workdir, model)
    complete = resume.completed_summary(workdir, config)
    if complete is not None:  # nothing left to train: say so instead of starting anew
        return complete
    s, given = start_lib.start(config, workdir, model, clock, profile_steps, warm_up,
                               callbacks, peers)
    users = callbacks_lib.UserCallbacks(s, given)
    profiler = profiling.Profiler(workdir, s.traced, s.reporter)
    projection = projection_lib.Projection(s.setup.total_steps, config.model.name,
                                           s.reporter.print_line)
    try:
        try:
            with signals.StopRequest() as stop:
                users.start()
                stopped_early = stop_if_asked(s, users)
                if not stopped_early and evaluation_missing(s):  # a signal cut it short
                    new = evaluate(s, users, s.step, stop, [])
                    log(s, new)
                    users.deliver(new)
                for epoch, first_step, length in [] if stopped_early else s.plan:
                    chunk = rows_lib.Chunk(epoch, first_step, length, previous=s.step)
                    profiler.before(chunk)
                    chunk_lib.train(s, chunk, stop, projection)
                    profiler.after(chunk)
                    chunk_lib.check_finite(s, chunk)
                    new = chunk_lib.take_rows(s, chunk)
                    if processes.any_process(stop()):  # before any evaluation
                        stop_for_signal(s, users, new, stop)
                    if s.evaluates(s.step):
                        new = evaluate(s, users, s.step, stop, new)
                    log(s, new)
                    if saves_at(s, s.step):
                        save(s)
                    users.deliver(new, s.step if s.saved_step == s.step else None)
                    stopped_early = stop_if_asked(s, users)
                    if stopped_early:
                        break
                best = finish(s, users, stop, restore_best=any(
                    getattr(callback, "restore_best_weights", False) for callback in given))
            signals.enter_phase(f"evaluating and writing the reports after the last step; its "
                                f"checkpoint is saved in {s.manager.directory}/{s.step}",
                                stop_at_once=False)
            if stop():  # a signal while the last checkpoint was written
                raise signals.Interrupted(stop.signal, s.step, s.manager.directory)
        finally:
            profiler.close()
            s.close()
        clock.lap("checkpoint")
        summary = summary_lib.summarize(s)
        summary.update(best)
        if stopped_early:
            summary["stopped_early"] = stopped_early
        if profiler.table is not None:
            summary["profile"] = profiler.table
        clock.lap("write")
        summary["phase_seconds"] = dict(clock.seconds)  # this process's; they add up to the total
        summary["total_seconds"] = clock.total()
        s.reporter.print_line(clock.breakdown())
        s.reporter.write_summary(summary)
        users.run_end(summary)
    except BaseException as error:
        users.failed(error)  # a tracker ends its run as killed or failed
        raise
    return summary


def run_config(config, workdir: str, model=None):
    """The run's checked config with absolute paths and the name of a model passed in,
    resumable from what `workdir` holds (resume.check_resumable); a copy."""
    config = checks.with_absolute_paths(config)  # a copy: the caller's stays as it was
    if model is not None:
        with config.unlocked():
            config.model.name = user.instance_name(model)
    resume.check_resumable(workdir, config)
    return config


def print_now(line: str) -> None:
    print(line, flush=True)


def evaluation_missing(s) -> bool:
    """Whether the step the run resumed at was due an evaluation that a signal cut short
    (its checkpoint saved, its rows without test metrics)."""
    return s.resumed and s.evaluates(s.step) and not any(
        row["step"] == s.step and "test_loss" in row for row in s.reporter.records)


def stop_for_signal(s, users, new: list, stop, phase: str | None = None) -> None:
    """A signal: every step trained is kept. The rows are written, with one for the steps
    since the last (the window keeps them too: the checkpoint carries them, and a resumed
    run's next row covers them again), the state is saved unless this step's checkpoint
    is on disk, the user's callbacks get the rows and the checkpoint, and the run stops
    (Interrupted: exit status 128 + N)."""
    new = new + stop_rows(s)
    log(s, new)
    saved = None
    if s.step not in checkpoint.saved_steps(s.manager.directory):
        save(s)
        saved = s.step
    checkpoint.wait(s.manager)
    users.deliver(new, saved)
    raise signals.Interrupted(stop.signal or signal.SIGTERM, s.step, s.manager.directory, phase)


def stop_rows(s) -> list:
    """Rows at the current step for the window's steps, leaving them in the window."""
    if not s.window.steps:
        return []
    window = rows_lib.RowWindow(s.window.after, dict(s.window.per_step))
    here = rows_lib.Chunk(0, 0, 0, previous=s.step, step=s.step)
    return rows_lib.train_rows(window, [s.step], s.setup, s.schedules, s.train_seconds, here)


def evaluate(s, users, step: int, stop, new: list, counted: bool = True) -> list:
    """The test split at `step` (also the EMA's weights, train.ema_decay), batch by batch
    with a progress bar; returns `new` with its metrics. A signal between two batches
    (agreed by every process) stops the run there, its trained steps kept
    (stop_for_signal). `counted`: part of the run's train_seconds."""
    try:
        metrics, seconds = timed_evaluation(s, s.state, stop)
        if s.state.ema is not None:
            ema, more = timed_evaluation(s, train_state.ema_weights(s.state), stop)
            metrics.update({f"{name}_ema": value for name, value in ema.items()})
            seconds += more
    except evaluation.EvaluationStopped:
        stop_for_signal(s, users, new, stop, f"evaluating step {step} (evaluated when the "
                                             "run resumes)")
    s.test_metrics, s.test_step = metrics, step
    if counted:
        s.eval_seconds += seconds
        s.train_seconds += seconds
    s.clock.lap("eval")
    return rows_lib.with_test_metrics(new, step, metrics, s.setup, s.train_seconds)


def timed_evaluation(s, state, stop):
    """(metrics as Python floats, a list per metric for replicas; seconds)."""
    several = jax.process_count() > 1
    should_stop = ((lambda: processes.any_process(bool(stop()))) if several
                   else (lambda: bool(stop())))
    with s.reporter.evaluation_progress(s.eval_fn.batches) as bar:
        metrics, seconds = chunks.timed(s.eval_fn, state, *s.eval_arrays, should_stop,
                                        bar.update)
    return host_metrics(metrics), seconds


def host_metrics(metrics) -> dict:
    """Evaluation results as Python floats (a list per metric for a replicated run)."""
    return {name: float(value) if np.ndim(value) == 0 else [float(v) for v in value]
            for name, value in jax.device_get(metrics).items()}


def log(s, new: list) -> None:
    """The rows into metrics.jsonl and TensorBoard; the console's row where they reach an
    epoch's end or the last step."""
    for row in new:
        s.reporter.log(row)
    spe = s.setup.steps_per_epoch
    if any(row["step"] % spe == 0 or row["step"] == s.setup.total_steps for row in new):
        s.reporter.print_row(rows_lib.console_row(s.reporter.records, spe))
    s.clock.lap("train")


def saves_at(s, step: int) -> bool:
    """checkpoint.every_steps / every_epochs, the last step, and with checkpoint.best_metric
    every evaluation (Orbax's BestN keeps the best)."""
    return (step == s.setup.total_steps or (s.save_every > 0 and step % s.save_every == 0)
            or (bool(s.config.checkpoint.best_metric) and s.test_step == step))


def save(s) -> None:
    """Starts saving a checkpoint of the state (asynchronously; resume.save says what it
    records), with the best metric when one is kept and this step was evaluated."""
    best = checkpoint.best_policy(s.config.checkpoint)
    metrics = None
    if best and s.test_step == s.step:
        metrics = {best[0]: float(np.mean(s.test_metrics[best[0].removeprefix("test_")]))}
    resume.save(s, metrics)
    s.saved_step = s.step
    s.clock.lap("checkpoint")


def stop_if_asked(s, users) -> dict | None:
    """A callback's StopTraining (on any process; every process stops at this step): a
    row for the steps since the last, a checkpoint, one line. Returns stopped_early."""
    asking = processes.first_process(users.stop_reason is not None)
    if asking is None:
        return None
    reason = users.stop_reason or f"a callback of process {asking} asked to stop"
    last = stop_rows(s)
    log(s, last)
    users.deliver(last)
    if s.step not in checkpoint.saved_steps(s.manager.directory):
        save(s)
    checkpoint.wait(s.manager)
    s.reporter.print_line(f"stopped early at step {s.step}: {reason}")
    return {"step": s.step, "reason": reason}


def finish(s, users, stop, restore_best: bool) -> dict:
    """After the last chunk: the saves on disk, the test figures of the last step (a
    finished run resumed, or one stopped early between evaluations: not part of
    training's time), and the best checkpoint (restored, for a callback's
    restore_best_weights). Returns the summary's best_checkpoint entries."""
    checkpoint.wait(s.manager)
    s.clock.lap("checkpoint")
    if s.test_step != s.step:
        evaluate(s, users, s.step, stop, [], counted=False)
    found = {}
    best = checkpoint.best_policy(s.config.checkpoint)
    if best:  # over every checkpoint kept, also those of the run before a resume
        step = s.manager.best_step()
        values = [row[best[0]] for row in s.reporter.records
                  if row["step"] == step and row.get(best[0]) is not None]
        if step is not None and values:
            found["best_checkpoint"] = {"step": step, best[0]: float(np.mean(values)),
                                        "path": f"{s.manager.directory}/{step}"}
            if restore_best:
                restore(s, step)
                found["restored_best_weights"] = {"step": step}
    s.clock.lap("checkpoint")
    return found


def restore(s, step: int) -> None:
    """The state and test figures become those of checkpoint `step`."""
    s.state = checkpoint.restore(s.manager, s.state, s.data_key, step)[0]
    at_step = sorted((row for row in s.reporter.records
                      if row["step"] == step and row.get("test_loss") is not None),
                     key=lambda row: row.get("replica", 0))
    names = [key for key in at_step[0] if key.startswith("test_")]
    s.test_metrics = {key.removeprefix("test_"): at_step[0][key] if len(at_step) == 1
                      else [row[key] for row in at_step] for key in names}
    s.test_step = step
