"""The host loop: a short skeleton that runs the planned compiled chunks (train.py) and
hands each chunk's results to the run's actions (actions.py: rows, evaluation, reports,
checkpoints, the user's callbacks, stops), then writes the summary. Resumes exactly.

What the actions share lives in a Session: the setup (prepare.py), the state and its
step, the checkpoint manager (checkpoint.py), the reporter (report.py), the phase clock
(phases.py) and the compiled programs."""
import json
import os

import flax
import jax
import jax.numpy as jnp
import numpy as np

from jaxtrain import (actions, callbacks as callbacks_lib, checkpoint, checks, memory, models,
                      optim, parallel, phases, prepare, replicas, report, signals, supervise,
                      train, user_model, xla_cache, xla_flags)
from jaxtrain.errors import ConfigError

PROFILE_DIR = actions.PROFILE_DIR
ROWS_PER_RUN = 50  # train.log_every_steps=0: about this many metrics rows, whatever the length


def train_and_evaluate(config, workdir: str, *, model=None, start_time: float | None = None,
                       profile_steps: int = 0, warm_up: bool = False, callbacks=()) -> dict:
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
    with jaxtrain.Callback's methods, after those config.callbacks names.
    """
    clock = phases.Clock(start_time, say=print_now if parallel.is_main_process() else None)
    clock.lap("imports", "imported JAX, Flax and jaxtrain" if start_time is not None else None)
    config = checked_config(config, workdir, model)
    complete = completed_summary(workdir, config)
    if complete is not None:  # nothing left to train: say so instead of starting anew
        return complete
    session, user_callbacks = start(config, workdir, model, clock, profile_steps, warm_up,
                                    callbacks)
    checkpoints = actions.Checkpoints(session)
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
    summary = summarize(session)
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


class Session:
    """What the actions of one run share (see actions.py)."""

    def __init__(self, **fields):
        self.__dict__.update(fields)
        self.step = self.start_step
        self.test_metrics = self.test_step = self.stop_reason = None
        self.stopped = False
        self.wait_seconds = self.chunk_seconds = 0.0
        self.latest = {row.get("replica"): row for row in self.reporter.records}
        # One process alone may not stop mid-chunk: the others would wait for it forever.
        self.single_process = jax.process_count() == 1

    def run(self, chunk, between_steps=None) -> None:
        """Runs `chunk`'s compiled program on the state; times it. A chunk run one call
        per step calls between_steps(steps done, the step's metrics) after each and can
        stop after any (a signal, in a single-process run)."""
        streaming = self.stream is not None
        waited = self.stream.wait_seconds if streaming else 0.0
        done = [0]

        def after_step(metrics) -> bool:
            done[0] += 1
            if between_steps is not None:
                between_steps(done[0], metrics)
            return self.single_process and bool(self.signal())
        (self.state, metrics), chunk.seconds = train.timed(
            self.run_chunk, self.state, self.data_key, chunk.epoch, chunk.first_step,
            chunk.length, after_step)
        chunk.metrics = jax.device_get(metrics)
        chunk.wait = self.stream.wait_seconds - waited if streaming else 0.0
        self.train_seconds += chunk.seconds
        self.wait_seconds += chunk.wait
        self.chunk_seconds += chunk.seconds
        self.step = chunk.step = train.current_step(self.state)
        chunk.last = chunk.step == self.setup.total_steps
        chunk.stopping = parallel.any_process(self.signal())

    def evaluates(self, step: int) -> bool:
        return evaluates_after(step, self.setup.steps_per_epoch, self.setup.total_steps,
                               self.config.eval.every_epochs, self.config.eval.every_steps)

    def chunk_rows(self, chunk, ends: list) -> list:
        return chunk_rows(chunk.metrics["per_step"], chunk.previous, ends, self.setup,
                          self.train_seconds, chunk.seconds, chunk.wait, self.schedules)

    def save(self, metrics: dict | None = None) -> None:
        save(self.manager, self.setup, self.config, self.state, self.data_key, self.stream,
             self.train_seconds, self.eval_seconds, self.test_metrics, metrics)

    def ask_to_stop(self, reason: str) -> None:
        """A callback's StopTraining: the first reason is kept (actions.Stops acts on it)."""
        if self.stop_reason is None:
            self.stop_reason = reason

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()
        self.reporter.close()
        self.manager.close()


def checked_config(config, workdir: str, model=None):
    """The run's config, checked (checks.check_config), with absolute paths, the name of a
    model passed in, and resumable from what `workdir` holds (check_resumable); a copy."""
    signals.enter_phase("checking the config; nothing written yet")
    checks.check_config(config)
    config = checks.with_absolute_paths(config)  # a copy: the caller's stays as it was
    if model is not None:
        with config.unlocked():
            config.model.name = user_model.instance_name(model)
    check_resumable(workdir, config)
    return config


def completed_summary(workdir: str, config) -> dict | None:
    """summary.json of a run in `workdir` that already reached the end `config` asks for
    (its newest checkpoint is the summary's last step), after one line saying so; None
    when there is anything left to train. Nothing is loaded, compiled or evaluated."""
    path = os.path.join(workdir, report.SUMMARY_FILE)
    steps = checkpoint.saved_steps(checkpoint.checkpoint_dir(workdir))
    if not steps or not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            summary = json.load(f)
    except (OSError, ValueError):
        return None  # unreadable: the run writes it anew
    train = config.train
    asked = (summary.get("steps") == train.num_steps if train.num_steps > 0
             else summary.get("epochs") == train.num_epochs)
    if max(steps) != summary.get("steps") or not asked:
        return None
    if saved_recipe_changes(workdir, config):  # allowed to change: the checkpoint is loaded
        return None
    if parallel.is_main_process():
        accuracy = summary.get("test_accuracy")
        print_now(f"the run in {workdir} is complete: step {summary['steps']} of "
                  f"{summary['steps']}, test accuracy "
                  + (f"{accuracy:.2%}" if isinstance(accuracy, (int, float)) else "n/a")
                  + f"; its summary is {path} (--mode=eval evaluates it again; another "
                  "--workdir starts a new run)")
    return summary


def start(config, workdir: str, model, clock, profile_steps: int, warm_up: bool, given=()):
    """Everything before the first chunk: the config checked, the data and model built,
    the checkpoint restored, the programs compiled, the console's header printed.
    Returns (Session, the user's callbacks)."""
    main_process = parallel.is_main_process()
    user_callbacks = callbacks_lib.from_config(config, given)
    cache_dir = xla_cache.enable(config.train.compilation_cache)
    mesh = prepare.create_mesh(config)
    prepare.check_batch_split(config.train.batch_size, mesh, config.train.accumulate_steps)
    signals.enter_phase("loading the data and building the model; nothing written yet")
    # Resuming: the initial state's shapes only (no init compiled or run for nothing);
    # the checkpoint fills them.
    resuming = bool(checkpoint.saved_steps(checkpoint.checkpoint_dir(workdir)))
    run = prepare.setup(config, mesh, model=model, clock=clock, abstract_state=resuming)
    streaming = run.placement == "stream"
    manager = checkpoint.create_manager(checkpoint.checkpoint_dir(workdir), config.checkpoint.keep,
                                        stream=streaming,
                                        best=checkpoint.best_policy(config.checkpoint))
    parallel.CHECKPOINTS["directory"] = manager.directory  # named if a peer process is lost
    supervise.tell(workdir, str(manager.directory))  # and by the parent, if it watches
    target = (checkpoint.restore_target(run.state, prepare.state_sharding(run)) if resuming
              else run.state)
    restored = checkpoint.restore(manager, target, run.data_key)
    if restored is None and resuming:  # no step Orbax recognises: start afresh after all
        run = prepare.setup(config, mesh, model=model)
    state, data_key, meta = restored if restored is not None else (run.state, run.data_key, {})
    if meta.get("init_from"):  # what the first start loaded (a resumed run reads no weights)
        run = run._replace(init_from=meta["init_from"])
    start_step = train.current_step(state)
    clock.lap("restore", None if restored is None else (
        f"resumed from checkpoint step {start_step} ({manager.directory}/{start_step}) "
        "in {seconds:.1f} s"))
    if main_process:
        report.write_json_atomically(os.path.join(workdir, checkpoint.CONFIG_FILE),
                                     config.to_dict())
    clock.lap("write")
    signals.enter_phase(f"compiling; nothing trained in this run yet (checkpoints in "
                        f"{manager.directory})")

    eval_arrays = prepare.put_eval_data(config, run)
    save_every = save_interval(config, run.steps_per_epoch)
    traced = profile_window(start_step, run.total_steps, profile_steps)
    if profile_steps and traced is None and main_process:
        print_now(f"--profile={profile_steps}: no step left to trace after the warm-up step "
                  f"(the run ends at step {run.total_steps}); nothing traced")
    cuts = finished_group_cuts(config, run)
    plan = plan_chunks(run.total_steps, run.steps_per_epoch,
                       (save_every, config.eval.every_steps, config.train.chunk_steps), start_step,
                       breaks=(*(traced or ()), *cuts))
    stream, train_arrays = start_input(config, run, data_key, manager, meta, start_step)
    clock.lap("load")  # the copy to the devices, or the stream's start
    cache_before = xla_cache.counts()
    run_chunk = compile_training(config, run, state, data_key, plan, stream, train_arrays, cuts)
    eval_fn = prepare.compile_eval(config, run, state, eval_arrays)
    compile_seconds = clock.lap("compile", f"compiled the {'training and ' if plan else ''}"
                                "evaluation programs in {seconds:.1f} s"
                                + cache_note(cache_dir, cache_before))
    if warm_up and not streaming:
        run_programs_once(config, run_chunk, eval_fn, state, data_key, plan, eval_arrays,
                          run.steps_per_epoch, cuts)
        clock.lap("warmup", "ran every compiled program once, untimed, in {seconds:.1f} s")
    if streaming and start_step < run.total_steps:
        stream.fill()  # the workers started while XLA compiled; their first batches now
    clock.lap("load")
    signals.enter_phase("training", stop_at_once=False)  # StopRequest: a checkpoint, then stop

    reporter = report.Reporter(workdir, total_steps=run.total_steps, start_step=start_step,
                               write=main_process, spread=bool(run.runs))
    where = "host, streamed" if streaming else "devices"
    reporter.print_line(f"data on the {where}: {run.placement_reason}"
                        + (f"; {stream.workers} Grain workers" if streaming and stream.workers
                           else ""))
    replica_info = {"replicas": len(run.runs)} if run.runs else {}
    reporter.print_header(model=config.model.name, **replica_info,
                          params=prepare.param_count(state.params, run.runs),
                          dataset=run.dataset.origin, device=jax.devices()[0].device_kind,
                          devices=jax.device_count(), processes=jax.process_count(),
                          steps=run.total_steps, compile_seconds=compile_seconds)
    clock.lap("write")
    session = Session(
        config=config, workdir=workdir, setup=run, manager=manager, state=state,
        data_key=data_key, start_step=start_step, resumed=restored is not None, plan=plan,
        traced=traced, stream=stream, run_chunk=run_chunk, eval_fn=eval_fn,
        eval_arrays=eval_arrays, clock=clock, reporter=reporter, cache_dir=cache_dir,
        compile_seconds=compile_seconds, save_every=save_every, signal=None,
        on_grid=row_grid(config.train.log_every_steps, run.steps_per_epoch, run.total_steps),
        schedules=run_schedules(config, run),
        train_seconds=meta.get("train_seconds", 0.0), eval_seconds=meta.get("eval_seconds", 0.0))
    return session, user_callbacks


def summarize(session: Session) -> dict:
    """summary.json's figures: the test metrics (a replicated run's means, and each
    replica's results), times, throughput, the run's shape and versions."""
    run, state, config = session.setup, session.state, session.config
    test_metrics, records = session.test_metrics, session.reporter.records
    if parallel.is_main_process():
        session.reporter.plot()
    replica_results = None
    if run.runs:  # every replica's results; the top-level figures are their means
        # Hashed from one host copy: indexing the replicas on their devices would
        # dispatch a multi-device program per leaf and replica, whose collectives can
        # stall XLA:CPU's in-process communicator when more devices than cores share it.
        weights = jax.tree.map(checkpoint.host_value,
                               {"params": state.params, "batch_stats": state.batch_stats})
        replica_results = replicas.summarize(run.runs, [
            {"test_accuracy": test_metrics["accuracy"][r], "test_loss": test_metrics["loss"][r],
             "train_loss": report.epoch_means(records, run.steps_per_epoch, r)["train_loss"],
             "params_sha256": checkpoint.params_sha256(
                 state.replace(**replicas.take(weights, r)))}
            for r in range(len(run.runs))])
        test_metrics = {name: replicas.mean_std(values)[0]
                        for name, values in test_metrics.items()}
    train_loss = (replicas.mean_std(r["train_loss"] for r in replica_results["replicas"])[0]
                  if run.runs else
                  report.epoch_means(records, run.steps_per_epoch).get("train_loss"))
    copies = len(run.runs) if run.runs else 1
    train_seconds, eval_seconds = session.train_seconds, session.eval_seconds
    summary = {
        "test_accuracy": test_metrics["accuracy"],
        "test_loss": test_metrics["loss"],
        "train_loss": train_loss,
        "params_sha256": checkpoint.params_sha256(state),
        "train_seconds": train_seconds,  # training and evaluation, over every resume
        "train_only_seconds": train_seconds - eval_seconds,
        "eval_seconds": eval_seconds,
        "compile_seconds": session.compile_seconds,
        "compilation_cache": session.cache_dir,
        "xla_flags": xla_flags.in_effect(),
        "data_placement": run.placement,
        "input_wait_fraction": (session.wait_seconds / session.chunk_seconds
                                if session.chunk_seconds else 0.0),
        "images_per_second": (copies * run.total_steps * config.train.batch_size
                              / max(train_seconds - eval_seconds, 1e-9)),  # all replicas'
        "epochs": run.total_steps / run.steps_per_epoch,
        "steps": run.total_steps,
        "resumed_from_step": session.start_step if session.resumed else None,
        "batch_size": config.train.batch_size,
        "param_count": prepare.param_count(state.params, run.runs),
        "device_kind": jax.devices()[0].device_kind,
        "device_count": jax.device_count(),
        "process_count": jax.process_count(),
        "jax_version": jax.__version__,
        "flax_version": flax.__version__,
        "dataset": run.dataset.origin,
        "init_from": run.init_from,  # what model.init_from loaded and re-initialised
        # XLA's memory analysis of the training program per device (memory.py); with the
        # layout's state bytes on the most loaded device
        "step_memory": memory.programs_memory(getattr(session.run_chunk, "programs", ())),
        "state_bytes_per_device": max(parallel.bytes_per_device(state).values(), default=0),
        "fsdp": parallel.fsdp_size(run.mesh),
        "config": config.to_dict(),
    }
    for name, value in test_metrics.items():  # train.ema_decay: test_accuracy_ema, ...
        summary.setdefault(f"test_{name}", value)
    if replica_results is not None:
        summary.update(replica_results)
        summary["images_per_second_per_replica"] = summary["images_per_second"] / copies
        summary["replica_layout"] = ("split: each device trains whole replicas"
                                     if prepare.splits_replicas(run) else
                                     "replicated: every replica's batch split over the devices")
    return summary

def run_programs_once(config, run_chunk, eval_fn, state, data_key, plan, eval_arrays,
                      steps_per_epoch: int = 1, cuts=None) -> None:
    """Each compiled chunk (one step of a per-step loop) and the evaluation, run once on a
    copy of `state` (the chunks donate it) with the results dropped: their first-run
    costs are then paid before the clock starts. `cuts` (finished_group_cuts): each
    phase's programs are run at a chunk of that phase."""
    kind = train.resolve_loop(config.train.loop, models.xla_convolutions(config.model))
    programs = {}  # (phase, length) -> the first planned chunk that runs that program
    for epoch, first_step, length in plan:
        phase = train.constant_at(cuts or {}, epoch * steps_per_epoch + first_step)
        length = length if kind == "scan" else 1
        programs.setdefault((phase, length), (epoch, first_step, length))
    for epoch, first_step, length in sorted(programs.values()):
        jax.block_until_ready(run_chunk(jax.tree.map(jnp.copy, state), data_key, epoch,
                                        first_step, length))
    jax.block_until_ready(eval_fn(state, *eval_arrays))


def start_input(config, run: prepare.Setup, data_key, manager, meta: dict, start_step: int):
    """The training data ready for the first step: (None, arrays on the devices), or (a
    stream opened at start_step, from the checkpoint's Grain state when resuming, None)."""
    if run.placement != "stream":
        return None, prepare.put_train_data(run)
    stream = prepare.open_stream(config, run, data_key)
    if start_step < run.total_steps:
        if "step" in meta:
            resume_stream(stream, manager, meta, start_step)
        else:
            stream.open(start_step)
    return stream, None


def compile_training(config, run: prepare.Setup, state, data_key, plan, stream, train_arrays,
                     cuts=None):
    """The training steps compiled ahead of time: run_chunk (train.compile_chunks), or None
    when no step is left (a resumed finished run compiles evaluation alone). `cuts`
    (finished_group_cuts): the chunks after each cut are programs of their own, which
    compute no gradient for the parameters held constant there (train.phased_chunks)."""
    if not plan:
        return None
    step_kwargs, replicated = prepare.step_arguments(config, run), parallel.replicated(run.mesh)
    out_sharding = (prepare.state_sharding(run), replicated)  # (the state's, the metrics')
    kind = train.resolve_loop(config.train.loop, models.xla_convolutions(config.model))

    def compile_phase(constant, lengths):
        kwargs = dict(step_kwargs, constant_params=constant) if constant else step_kwargs
        if stream is not None:
            return train.compile_stream_chunks(state, stream, data_key,
                                               len(run.dataset.x_train), kwargs, out_sharding)
        return train.compile_chunks(kind, state, *train_arrays, data_key, lengths, kwargs,
                                    out_sharding, replicas=bool(run.runs))
    return train.phased_chunks(plan, run.steps_per_epoch, cuts or {}, compile_phase)


def finished_group_cuts(config, run: prepare.Setup) -> dict:
    """train.drop_finished_groups: {step: the parameters held constant from it on}
    (train.finished_groups); else {} (every step computes every gradient)."""
    if not config.train.get("drop_finished_groups", False):
        return {}
    return train.finished_groups(config.optimizer, run.state.params, run.total_steps,
                                 models.frozen_params(config.model))


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
                    previous, ends, run._replace(runs=None), train_seconds, seconds, wait,
                    schedules[one.replica:one.replica + 1])]
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


def save(manager, run: prepare.Setup, config, state, data_key, stream, train_seconds: float,
         eval_seconds: float, test_metrics=None, metrics=None) -> None:
    """Starts saving a checkpoint of `state`, with the stream's position when streaming.
    A replicated run's records its replicas and their last test accuracies (what
    jaxtrain.restore picks the best replica by)."""
    meta, input_state = checkpoint_meta(run, config, state, train_seconds, eval_seconds), None
    if run.runs:
        meta["replicas"] = [one._asdict() for one in run.runs]
        if test_metrics is not None:
            meta["replica_test_accuracy"] = test_metrics["accuracy"]
    if stream is not None:
        meta["input"], input_state = stream.checkpoint()
    checkpoint.save(manager, state, data_key, meta, input_state, metrics)


def print_now(line: str) -> None:
    print(line, flush=True)


def cache_note(cache_dir: str | None, before: dict) -> str:
    """' (...)' after the compile line: how many programs the persistent cache gave.
    Returns a format string for Clock.lap (braces doubled)."""
    if cache_dir is None:
        return " (persistent compilation cache off: train.compilation_cache='')"
    now = xla_cache.counts()
    hits = now["hits"] - before["hits"]
    compiled = hits + now["misses"] - before["misses"]
    return f" ({hits} of {compiled} from the persistent cache in {cache_dir})"


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


def checkpoint_meta(run: prepare.Setup, config, state, train_seconds: float, eval_seconds: float):
    """The JSON half of a checkpoint: the data-order position and what inference needs."""
    step = train.current_step(state)
    return {"step": step, "epoch": step // run.steps_per_epoch,
            "step_in_epoch": step % run.steps_per_epoch, "seed": config.seed,
            "train_seconds": train_seconds, "eval_seconds": eval_seconds,
            "mean": list(run.mean), "std": list(run.std),
            "class_names": list(run.dataset.class_names),
            "image_shape": list(run.dataset.image_shape),
            **({"init_from": run.init_from} if run.init_from else {})}


def check_resumable(workdir: str, config) -> None:
    """A workdir with checkpoints resumes only the recipe that wrote them: any change that
    alters training (checks.recipe_changes) stops here, before anything is loaded or
    written, unless checkpoint.allow_recipe_change says to go on (and then it is said)."""
    changes = saved_recipe_changes(workdir, config, say_moved=True)
    if not changes:
        return
    listed = "; ".join(f"{key}: {before!r} -> {after!r}" for key, before, after in changes)
    if not config.checkpoint.allow_recipe_change:
        raise ConfigError(
            f"{workdir} holds checkpoints of another recipe ({listed}). Use a new --workdir, "
            "or resume anyway with --config.checkpoint.allow_recipe_change=True (the run is "
            "then no longer an exact resume)")
    if parallel.is_main_process():
        print(f"resuming with a changed recipe ({listed}): checkpoint.allow_recipe_change=True;"
              " the run is no longer an exact resume of the one that wrote the checkpoints",
              flush=True)


def saved_recipe_changes(workdir: str, config, say_moved: bool = False) -> list:
    """checks.recipe_changes between the config.json beside workdir's checkpoints and
    `config` ([] without checkpoints); a data.dir that moved is not a change."""
    path = os.path.join(workdir, checkpoint.CONFIG_FILE)
    if not checkpoint.saved_steps(checkpoint.checkpoint_dir(workdir)) or not os.path.isfile(path):
        return []
    try:
        with open(path) as f:
            saved = json.load(f)
    except (OSError, ValueError) as error:
        raise checkpoint.CheckpointError(f"{path}: cannot be read ({error}); it records the "
                                         "recipe of the checkpoints beside it") from None
    moved = checks.moved_data_dir(saved, config)
    if moved is not None:  # the same recipe on data that moved
        saved["data"]["dir"] = config.data.dir
        if say_moved and parallel.is_main_process():
            print(f"data.dir moved: the checkpoints' run read {moved} (no longer there); "
                  f"resuming with {config.data.dir}", flush=True)
    return checks.recipe_changes(saved, config)


def resume_stream(stream, manager, meta: dict, step: int) -> None:
    """Positions `stream` at `step`: from the checkpoint's Grain iterator state when it has
    one (a streamed run's), else (a device-placement checkpoint) by starting to read
    there."""
    saved = meta.get("input")
    if saved is None:
        stream.open(step)
        return
    if saved["position"] != step:
        raise checkpoint.CheckpointError(
            f"checkpoint {manager.directory}/{meta['step']}: its data iterator is at step "
            f"{saved['position']}, its model at step {step}")
    stream.open(saved["first_step"], restore=(
        lambda it: checkpoint.restore_input(manager, meta["step"], it), saved["position"]))

