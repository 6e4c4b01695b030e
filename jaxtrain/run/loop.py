"""One run, top to bottom (run_checked): start (start.py), then for each planned chunk:
train it and take its rows (chunk.py); on a signal keep its steps and stop; evaluate and
save when due, write the rows, hand them to the user's callbacks, stop where one asked;
then the summary (summary.py). The loop holds what changes as the run goes (the state,
the row window, the last evaluation, the times) and hands it to each function below."""
import functools
import signal

import jax
import numpy as np

from jaxtrain.config import checks
from jaxtrain.run import callbacks as callbacks_lib
from jaxtrain.run import chunk as chunk_lib
from jaxtrain.run import profiling, projection as projection_lib, resume
from jaxtrain.run import rows as rows_lib
from jaxtrain.run import start as start_lib
from jaxtrain.run import summary as summary_lib
from jaxtrain.run.session import Evaluation
from jaxtrain.runtime import phases, processes, signals
from jaxtrain.training import checkpoint, chunks, evaluation as evaluation_lib, train_state
from jaxtrain.training import parts as parts_lib

PRINT = functools.partial(print, flush=True)  # the console's lines, as they happen


def train_and_evaluate(config, workdir: str, *, model=None, optimizer=None, loss=None,
                       augment=None, start_time: float | None = None,
                       profile_steps: int = 0, warm_up: bool = False, callbacks=(),
                       peers=None) -> dict:
    """Trains and evaluates the model the config describes; writes reports to workdir.

    Resumes from the newest checkpoint in workdir/checkpoints when there is one.
    Returns the summary (also written to workdir/summary.json). In a multi-process
    run every process calls this; process 0 alone prints and writes the reports.
    The parts of the run you bring from Python, instead of the config's choices:
    model: a Flax Linen or NNX module instance; optimizer: an optax.GradientTransformation,
    or a function of the learning rate returning one (called with the config's schedule,
    which a sweep sweeps); loss: fn(logits, targets) -> (N,) losses, targets being
    probability vectors (after label smoothing and MixUp/CutMix); augment: fn(images, key)
    -> images, on float32 (N, H, W, C) images in [0, 1] after the built-in augmentations.
    To resume the run, pass them again.
    start_time: when the process started (main.py), so summary.json's total_seconds
    and its phase_seconds cover the imports too. profile_steps > 0: trace that many
    steps after a warm-up step into workdir/profile and print the costliest XLA ops.
    warm_up: run every compiled program once, untimed, on a copy of the state before
    training (jaxtrain.compare: first-run costs kept out of train_seconds, as the PyTorch
    twins' warm-up keeps them out); the run itself is unchanged. callbacks: objects
    with jaxtrain.Callback's methods, after those config.callbacks names. peers: what
    processes.initialize returned in a multi-process run (told where the checkpoints go).
    """
    clock = phases.Clock(start_time, say=PRINT if processes.is_main_process() else None)
    clock.lap("imports", "imported JAX, Flax and jaxtrain" if start_time is not None else None)
    signals.enter_phase("checking the config; nothing written yet")
    checks.check_config(config)
    return run_checked(config, workdir, parts=parts_lib.Parts(model, optimizer, loss, augment),
                       clock=clock, profile_steps=profile_steps, warm_up=warm_up,
                       callbacks=callbacks, peers=peers)


def run_checked(config, workdir: str, *, parts=None, clock=None, profile_steps: int = 0,
                warm_up: bool = False, callbacks=(), peers=None) -> dict:
    """train_and_evaluate with a config already checked (checks.check_config), where the
    command that started it checked it (jaxtrain.compare)."""
    if clock is None:
        clock = phases.Clock(None, say=PRINT if processes.is_main_process() else None)
    parts = parts or parts_lib.Parts()
    config = start_lib.run_config(config, workdir, parts)
    complete = resume.completed_summary(workdir, config)
    if complete is not None:  # nothing left to train: say so instead of starting anew
        return complete
    given = callbacks_lib.from_config(config, callbacks)
    try:
        run, state, window, times, paced = start_lib.start(config, workdir, parts, clock,
                                                           profile_steps, warm_up, peers)
    except BaseException:
        checkpoint.let_go(workdir)  # start held it from its first write there
        raise
    del config  # read once: from here on, the run's values (session.Run)
    users = callbacks_lib.UserCallbacks(run, window, given)
    profiler = profiling.Profiler(workdir, run.traced, run.reporter)
    projection = projection_lib.Projection(run.setup.total_steps, run.model_name,
                                           run.reporter.print_line)
    step, evaluation = run.start_step, None
    try:
        try:
            with signals.StopRequest() as stop:
                users.start()
                stopped_early = stop_if_asked(run, state, step, window, times, None, users)
                if not stopped_early and evaluation_missing(run, step):  # a signal cut it short
                    evaluation = evaluate(run, state, step, window, times, None, users, stop)
                    new = rows_lib.with_test_metrics([], step, evaluation.metrics, run.setup,
                                                     times.train)
                    log(run, new)
                    users.deliver(new, step)
                for epoch, first_step, length in [] if stopped_early else run.plan:
                    chunk = rows_lib.Chunk(epoch, first_step, length, previous=step)
                    profiler.before(chunk)
                    state = chunk_lib.train(run, state, chunk, stop, projection, times)
                    step = chunk.step
                    projection.after(chunk)
                    profiler.after(chunk)
                    if chunk_lib.over_pace(run, chunk, paced):
                        chunk_lib.pace_from_now(run, state, chunk, times)
                        paced = True
                    chunk_lib.check_finite(run, chunk)
                    new = chunk_lib.take_rows(run, window, chunk, times)
                    if processes.any_process(stop()):  # before any evaluation
                        stop_for_signal(run, state, step, window, times, evaluation, users,
                                        new, stop)
                    if run.evaluates(step):
                        evaluation = evaluate(run, state, step, window, times, evaluation,
                                              users, stop, new)
                        new = rows_lib.with_test_metrics(new, step, evaluation.metrics,
                                                         run.setup, times.train)
                    log(run, new)
                    saved = saves_at(run, step, evaluation)
                    if saved:
                        save(run, state, step, window, times, evaluation)
                    users.deliver(new, step, step if saved else None)
                    stopped_early = stop_if_asked(run, state, step, window, times, evaluation,
                                                  users)
                    if stopped_early:
                        break
                state, evaluation, best = finish(
                    run, state, step, window, times, evaluation, users, stop,
                    restore_best=any(getattr(callback, "restore_best_weights", False)
                                     for callback in given))
            signals.enter_phase(f"evaluating and writing the reports after the last step; its "
                                f"checkpoint is saved in {run.manager.directory}/{step}",
                                stop_at_once=False)
            if stop():  # a signal while the last checkpoint was written
                raise signals.Interrupted(stop.signal, step, run.manager.directory)
        finally:
            profiler.close()
            run.close()
        summary = report_summary(run, state, step, evaluation, times, {
            **best, **({"stopped_early": stopped_early} if stopped_early else {}),
            **({"profile": profiler.table} if profiler.table is not None else {})})
        users.run_end(summary)
    except BaseException as error:
        users.failed(error)  # a tracker ends its run as killed or failed
        raise
    finally:
        checkpoint.let_go(workdir)  # after the summary: another run may start there
    return summary


def report_summary(run, state, step: int, evaluation, times, extra: dict) -> dict:
    """summary.json: what was trained (summary.summarize), with `extra` (the best
    checkpoint, an early stop, the profile) and where this process's time went (the
    phases add up to the total), also the console's last lines."""
    run.clock.lap("checkpoint")
    summary = summary_lib.summarize(run, state, step, evaluation, times)
    summary.update(extra)
    run.clock.lap("write")
    summary["phase_seconds"] = dict(run.clock.seconds)
    summary["total_seconds"] = run.clock.total()
    run.reporter.print_line(run.clock.breakdown())
    run.reporter.write_summary(summary)
    return summary


def evaluation_missing(run, step: int) -> bool:
    """Whether the step the run resumed at lacks the evaluation due there (a signal cut it
    short after its checkpoint was saved)."""
    return run.resumed and run.evaluates(step) and not any(
        row["step"] == step and "test_loss" in row for row in run.reporter.records)


def stop_for_signal(run, state, step: int, window, times, evaluation, users, new: list, stop,
                    phase: str | None = None) -> None:
    """A signal: the trained steps kept (keep_trained_steps), the run stops (exit 128 + N)."""
    keep_trained_steps(run, state, step, window, times, evaluation, users, new)
    raise signals.Interrupted(stop.signal or signal.SIGTERM, step, run.manager.directory, phase)


def keep_trained_steps(run, state, step: int, window, times, evaluation, users,
                       new=()) -> None:
    """Before the run stops at `step`: the rows `new` written, with one for the steps since
    the last (the window keeps them too: a resumed run's next row covers them again), the
    state saved unless on disk already, the user's callbacks handed rows and checkpoint."""
    new = list(new) + stop_rows(run, step, window, times)
    log(run, new)
    saved = None
    if step not in checkpoint.saved_steps(run.manager.directory):
        save(run, state, step, window, times, evaluation)
        saved = step
    checkpoint.wait(run.manager)
    users.deliver(new, step, saved)


def stop_rows(run, step: int, window, times) -> list:
    """Rows at `step` for the window's steps, leaving them in the window."""
    if not window.steps:
        return []
    copy = rows_lib.RowWindow(window.after, dict(window.per_step))
    here = rows_lib.Chunk(0, 0, 0, previous=step, step=step)
    return rows_lib.train_rows(copy, [step], run.setup, run.schedules, times.train, here)


def evaluate(run, state, step: int, window, times, last, users, stop, new=(),
             counted: bool = True) -> Evaluation:
    """The test split at `step` (also the EMA's weights, train.ema_decay), batch by batch
    with a progress bar. A signal between two batches (agreed by every process) stops the
    run there, its trained steps and the rows `new` kept (stop_for_signal; `last`: the
    evaluation before). `counted`: part of the run's train_seconds."""
    try:
        metrics, seconds = timed_evaluation(run, state, stop)
        if state.ema is not None:
            ema, more = timed_evaluation(run, train_state.ema_weights(state), stop)
            metrics.update({f"{name}_ema": value for name, value in ema.items()})
            seconds += more
    except evaluation_lib.EvaluationStopped:
        stop_for_signal(run, state, step, window, times, last, users, list(new), stop,
                        f"evaluating step {step} (evaluated when the run resumes)")
    if counted:
        times.eval += seconds
        times.train += seconds
    run.clock.lap("eval")
    return Evaluation(step, metrics)


def timed_evaluation(run, state, stop):
    """(metrics as Python floats, a list per metric for a replicated run; seconds)."""
    with run.reporter.evaluation_progress(run.eval_fn.batches) as bar:
        metrics, seconds = chunks.timed(run.eval_fn, state, *run.eval_arrays,
                                        lambda: processes.any_process(stop()), bar.update)
    return {name: float(value) if np.ndim(value) == 0 else [float(v) for v in value]
            for name, value in jax.device_get(metrics).items()}, seconds


def log(run, new: list) -> None:
    """The rows into metrics.jsonl and TensorBoard; the console's row where they reach an
    epoch's end or the last step."""
    for row in new:
        run.reporter.log(row)
    spe = run.setup.steps_per_epoch
    if any(row["step"] % spe == 0 or row["step"] == run.setup.total_steps for row in new):
        run.reporter.print_row(rows_lib.console_row(run.reporter.records, spe))
    run.clock.lap("train")


def saves_at(run, step: int, evaluation) -> bool:
    """checkpoint.every_steps / every_epochs, the last step, and with checkpoint.best_metric
    every evaluation (Orbax's BestN keeps the best)."""
    return (step == run.setup.total_steps or (run.save_every > 0 and step % run.save_every == 0)
            or (run.best is not None and evaluation is not None and evaluation.step == step))


def save(run, state, step: int, window, times, evaluation) -> None:
    """Starts saving a checkpoint of the state (asynchronously; resume.save says what it
    records), with the best metric when one is kept and this step was evaluated."""
    best = None
    if run.best and evaluation is not None and evaluation.step == step:
        name = run.best[0]
        best = {name: float(np.mean(evaluation.metrics[name.removeprefix("test_")]))}
    resume.save(run, state, window, times, evaluation, best)
    run.clock.lap("checkpoint")


def stop_if_asked(run, state, step: int, window, times, evaluation, users) -> dict | None:
    """A callback's StopTraining, on any process: every process keeps its trained steps
    and stops at this step, in one line. Returns stopped_early."""
    asking = processes.first_process(users.stop_reason is not None)
    if asking is None:
        return None
    reason = users.stop_reason or f"a callback of process {asking} asked to stop"
    keep_trained_steps(run, state, step, window, times, evaluation, users)
    run.reporter.print_line(f"stopped early at step {step}: {reason}")
    return {"step": step, "reason": reason}


def finish(run, state, step: int, window, times, evaluation, users, stop, restore_best: bool):
    """After the last chunk: the saves on disk, the test figures of the last step (a
    finished run resumed, or one stopped early between evaluations: not part of
    training's time), and the best checkpoint (restored, for a callback's
    restore_best_weights). Returns (the state, its evaluation, the summary's
    best_checkpoint entries)."""
    checkpoint.wait(run.manager)
    run.clock.lap("checkpoint")
    if evaluation is None or evaluation.step != step:
        evaluation = evaluate(run, state, step, window, times, evaluation, users, stop,
                              counted=False)
    found = {}
    if run.best:  # over every checkpoint kept, also those of the run before a resume
        name = run.best[0]
        best = run.manager.best_step()
        values = [row[name] for row in run.reporter.records
                  if row["step"] == best and row.get(name) is not None]
        if best is not None and values:
            found["best_checkpoint"] = {"step": best, name: float(np.mean(values)),
                                        "path": f"{run.manager.directory}/{best}"}
            if restore_best:
                state, evaluation = restore(run, state, best)
                found["restored_best_weights"] = {"step": best}
    run.clock.lap("checkpoint")
    return state, evaluation, found


def restore(run, state, step: int):
    """The state of checkpoint `step` and its test figures (from the rows)."""
    state = checkpoint.restore(run.manager, state, run.data_key, step)[0]
    at_step = sorted((row for row in run.reporter.records
                      if row["step"] == step and row.get("test_loss") is not None),
                     key=lambda row: row.get("replica", 0))
    names = [key for key in at_step[0] if key.startswith("test_")]
    metrics = {key.removeprefix("test_"): at_step[0][key] if len(at_step) == 1
               else [row[key] for row in at_step] for key in names}
    return state, Evaluation(step, metrics)
