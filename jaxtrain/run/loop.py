"""The host loop: a short skeleton that runs the planned compiled chunks
(training/chunks.py; the plan: plan.py) and hands each chunk's results to the run's
actions (actions.py: rows, evaluation, reports, checkpoints, the user's callbacks,
stops), then writes the summary. Resumes exactly (resume.py).

What the actions share lives in a Session (session.py): the Setup (training/prepare.py),
the state and its step, the checkpoint manager, the reporter, the phase clock and the
compiled programs."""
from jaxtrain.config import checks
from jaxtrain.models import user
from jaxtrain.run import actions, resume
from jaxtrain.run import start as start_lib
from jaxtrain.run import summary as summary_lib
from jaxtrain.runtime import phases, processes, signals

PROFILE_DIR = actions.PROFILE_DIR


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
    session, user_callbacks = start_lib.start(config, workdir, model, clock, profile_steps,
                                              warm_up, callbacks, peers)
    checkpoints = actions.Checkpoints(session, restore_best=any(
        getattr(callback, "restore_best_weights", False) for callback in user_callbacks))
    steps = [actions.Profile(session), actions.Rows(session), actions.Evaluation(session),
             actions.Log(session), actions.Projection(session), checkpoints,
             actions.UserCallbacks(session, user_callbacks), actions.Stops(session, checkpoints)]
    try:
        with signals.StopRequest() as session.signal:
            for action in steps:
                action.start()
            for epoch, first_step, length in session.plan:
                if session.stopped:  # a callback's StopTraining (actions.Stops)
                    break
                chunk = actions.Chunk(epoch, first_step, length, previous=session.step)
                for action in steps:
                    action.before_chunk(chunk)
                session.run(chunk, between_steps=lambda done, metrics, chunk=chunk: [
                    action.between_steps(chunk, done, metrics) for action in steps])
                for action in steps:
                    action.after_chunk(chunk)
            for action in steps:
                action.finish()
            signals.enter_phase(f"evaluating and writing the reports after the last step; its "
                                f"checkpoint is saved in {session.manager.directory}/"
                                f"{session.step}", stop_at_once=False)
            if session.signal():  # a signal while the last checkpoint was written
                raise signals.Interrupted(session.signal.signal, session.step,
                                          session.manager.directory)
    finally:
        for action in reversed(steps):
            action.close()
        session.close()
    clock.lap("checkpoint")
    summary = summary_lib.summarize(session)
    for action in steps:
        action.summarize(summary)
    clock.lap("write")
    summary["phase_seconds"] = dict(clock.seconds)  # this process's; they add up to the total
    summary["total_seconds"] = clock.total()
    session.reporter.print_line(clock.breakdown())
    session.reporter.write_summary(summary)
    for action in steps:
        action.run_end(summary)
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
