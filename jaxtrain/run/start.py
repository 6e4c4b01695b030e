"""A run's start: everything before its first chunk. The data and model built
(training/prepare.py), the checkpoint restored, the input opened, the programs compiled
(and, for jaxtrain.compare, run once untimed), the console's header printed; the
session.Run the loop goes on with is what it returns."""
import dataclasses
import os

import jax
import jax.numpy as jnp

from jaxtrain import models
from jaxtrain.models import user
from jaxtrain.config import checks
from jaxtrain.run import plan as plan_lib
from jaxtrain.run import resume
from jaxtrain.run import rows as rows_lib
from jaxtrain.run import session as session_lib
from jaxtrain.runtime import mesh as mesh_lib
from jaxtrain.runtime import processes, report, signals, supervise, xla_cache
from jaxtrain.training import (checkpoint, chunks, inputs, model_state, parts as parts_lib,
                               placement, prepare, step, train_state)


def start(config, workdir: str, parts, clock, profile_steps: int, warm_up: bool,
          peers=None):
    """Everything before the first chunk: the data and model built, the checkpoint
    restored, the programs compiled, the console's header printed.
    Returns (session.Run, the initial state, the row window (rows.RowWindow), the times
    so far (session.Times), whether chunks run paced from the start)."""
    main_process = processes.is_main_process()
    cache_dir = xla_cache.enable(config.train.compilation_cache)
    mesh = placement.create_mesh(config.parallel.fsdp)
    placement.check_batch_split(config.train.batch_size, mesh, config.train.accumulate_steps)
    signals.enter_phase("loading the data and building the model; nothing written yet")
    run, manager, state, data_key, meta = restore_or_init(config, workdir, parts, clock, mesh,
                                                          peers)
    resumed, meta = meta is not None, meta or {}
    start_step = train_state.current_step(state)
    if main_process:
        report.write_json_atomically(os.path.join(workdir, checkpoint.CONFIG_FILE),
                                     config.to_dict())
    clock.lap("write")
    signals.enter_phase(f"compiling; nothing trained in this run yet (checkpoints in "
                        f"{manager.directory})")

    eval_arrays = placement.put_eval_data(config.eval.batch_size, run)
    save_every = plan_lib.save_interval(config.checkpoint, run.steps_per_epoch)
    traced = plan_lib.profile_window(start_step, run.total_steps, profile_steps)
    if profile_steps and traced is None and main_process:
        print(f"--profile={profile_steps}: no step left to trace after the warm-up step "
              f"(the run ends at step {run.total_steps}); nothing traced", flush=True)
    cuts = finished_group_cuts(config, run)
    pace = chunks.Pace(config.train.chunk_seconds) if config.train.chunk_seconds > 0 else None
    paced = pace is not None and paced_from_the_start()
    plan = plan_lib.plan_chunks(
        run.total_steps, run.steps_per_epoch,
        (save_every, config.eval.every_steps, config.train.chunk_steps), start_step,
        breaks=(*(traced or ()), *cuts))
    stream, train_arrays = start_input(config, run, data_key, manager, meta, start_step)
    clock.lap("load")  # the copy to the devices, or the stream's start
    cache_before = xla_cache.counts()
    run_chunk = compile_training(config, run, state, data_key, plan, stream, train_arrays, cuts,
                                 pace, paced)
    eval_fn = prepare.compile_eval(config, run, state, eval_arrays)
    compile_seconds = clock.lap("compile", f"compiled the {'training and ' if plan else ''}"
                                "evaluation programs in {seconds:.1f} s"
                                + cache_note(cache_dir, cache_before))
    if warm_up and stream is None:
        run_programs_once(run, config.train.loop, run_chunk, eval_fn, state, data_key, plan,
                          eval_arrays, cuts, paced)
        clock.lap("warmup", "ran every compiled program once, untimed, in {seconds:.1f} s")
    if stream is not None and start_step < run.total_steps:
        stream.fill()  # the workers started while XLA compiled; their first batches now
    clock.lap("load")
    signals.enter_phase("training", stop_at_once=False)  # StopRequest: a checkpoint, then stop

    # The steps since the last row before the checkpoint (a resumed run's next row
    # covers them, as the uninterrupted run's did); checkpoints from before the window
    # was kept start one at their step.
    window = (rows_lib.RowWindow.from_json(meta["rows"]) if "rows" in meta
              else rows_lib.RowWindow(start_step))
    reporter = open_reporter(config, workdir, run, state, start_step, window, stream,
                             compile_seconds)
    clock.lap("write")
    started = session_lib.Run(
        config=config, workdir=workdir, setup=run, manager=manager, data_key=data_key,
        start_step=start_step, resumed=resumed, plan=plan, traced=traced,
        stream=stream, run_chunk=run_chunk, pace=pace, eval_fn=eval_fn,
        eval_arrays=eval_arrays, clock=clock, reporter=reporter, cache_dir=cache_dir,
        schedules=rows_lib.run_schedules(config, run),
        on_grid=rows_lib.row_grid(config.train.log_every_steps, run.steps_per_epoch,
                                  run.total_steps),
        save_every=save_every, eval_every=(config.eval.every_epochs, config.eval.every_steps),
        best=checkpoint.best_policy(config.checkpoint),
        stop_at_nonfinite=config.train.nonfinite == "stop", seed=config.seed,
        batch_size=config.train.batch_size,
        precision=checks.resolve_precision(config.train.precision),
        model_name=config.model.name)
    times = session_lib.Times(train=meta.get("train_seconds", 0.0),
                              eval=meta.get("eval_seconds", 0.0), compile=compile_seconds)
    return started, state, window, times, paced or kind_of_loop(config, run) != "scan"


def run_config(config, workdir: str, parts):
    """The run's checked config with absolute paths and the names of the parts passed in
    (parts.Parts: a model instance, an optimiser, a loss, an augmentation), resumable from
    what `workdir` holds (resume.check_resumable); a copy."""
    config = checks.with_absolute_paths(config)  # a copy: the caller's stays as it was
    if parts.model is not None:
        with config.unlocked():
            config.model.name = user.instance_name(parts.model)
            config.model.kwargs = (user.instance_kwargs(parts.model)
                                   or config.model.get("kwargs", {}))
    parts_lib.record(config, parts)
    resume.check_resumable(workdir, config)
    return config


def restore_or_init(config, workdir: str, parts, clock, mesh, peers):
    """The data and model built (prepare.setup), workdir held for this run (process 0:
    checkpoint.hold_workdir, before anything is written there; loop.py lets go), and the
    newest checkpoint in it restored, else the initial state. Returns (the Setup, the
    checkpoint manager, the state, the data key, the checkpoint's meta (None when starting
    anew))."""
    main_process = processes.is_main_process()
    # Resuming: the initial state's shapes only (no init compiled or run for nothing);
    # the checkpoint fills them.
    resuming = bool(checkpoint.saved_steps(checkpoint.checkpoint_dir(workdir)))
    run = prepare.setup(config, mesh, parts=parts, clock=clock, abstract_state=resuming)
    note = precision_note(config.train.precision, config.model.name)
    if note and main_process:
        print(note, flush=True)
    if main_process:
        checkpoint.hold_workdir(workdir)
    if config.checkpoint.resume_step and resuming:
        if main_process:
            moved = checkpoint.set_aside_newer(workdir, config.checkpoint.resume_step)
            if moved:
                print(f"checkpoint.resume_step={config.checkpoint.resume_step}: moved the "
                      f"newer checkpoints (steps {', '.join(map(str, moved))}) to "
                      f"{os.path.join(workdir, checkpoint.SET_ASIDE_DIR)}; resuming from step "
                      f"{config.checkpoint.resume_step}", flush=True)
        processes.any_process(False)  # every process waits until they are moved
    manager = checkpoint.create_manager(checkpoint.checkpoint_dir(workdir), config.checkpoint.keep,
                                        stream=run.placement == "stream",
                                        best=checkpoint.best_policy(config.checkpoint))
    if peers is not None:  # named if a peer process is lost
        peers.checkpoints = str(manager.directory)
    supervise.tell(workdir, str(manager.directory))  # and by the parent, if it watches
    target = (checkpoint.restore_target(run.state, placement.state_sharding(run)) if resuming
              else run.state)
    restored = checkpoint.restore(manager, target, run.data_key)
    if restored is None:
        if resuming:  # step folders that Orbax does not list: none whole
            run = prepare.setup(config, mesh, parts=parts)
        clock.lap("restore")
        return run, manager, run.state, run.data_key, None
    state, data_key, meta = restored
    if meta.get("init_from"):  # what the first start loaded (a resumed run reads no weights)
        run = dataclasses.replace(run, init_from=meta["init_from"])
    step = train_state.current_step(state)
    clock.lap("restore", f"resumed from checkpoint step {step} ({manager.directory}/{step}) "
              "in {seconds:.1f} s")
    return run, manager, state, data_key, meta


def open_reporter(config, workdir: str, run: prepare.Setup, state, start_step: int, window,
                  stream, compile_seconds: float) -> report.Reporter:
    """The console, metrics.jsonl and TensorBoard, opened at start_step, and the console's
    header: where the data is, the model, the devices, the compile time."""
    reporter = report.Reporter(workdir, total_steps=run.total_steps, start_step=start_step,
                               write=processes.is_main_process(), spread=bool(run.runs),
                               ema=config.train.get("ema_decay") is not None,
                               rows_through=window.after)
    where = "host, streamed" if stream is not None else "devices"
    reporter.print_line(f"data on the {where}: {run.placement_reason}"
                        + (f"; {stream.workers} Grain workers" if stream and stream.workers
                           else ""))
    replica_info = {"replicas": len(run.runs)} if run.runs else {}
    reporter.print_header(model=config.model.name, **replica_info,
                          params=model_state.param_count(state.params, run.runs),
                          dataset=run.dataset.origin, device=jax.devices()[0].device_kind,
                          devices=jax.device_count(), processes=jax.process_count(),
                          steps=run.total_steps, compile_seconds=compile_seconds)
    return reporter


def run_programs_once(run: prepare.Setup, loop: str, run_chunk, eval_fn, state, data_key, plan,
                      eval_arrays, cuts=None, paced: bool = False) -> None:
    """Each compiled chunk (one step of a per-step loop or a paced one) and the evaluation,
    run once on a copy of `state` (the chunks donate it) with the results dropped: their
    first-run costs are then paid before the clock starts. `cuts` (finished_group_cuts):
    each phase's programs are run at a chunk of that phase. `loop`: config.train.loop."""
    kind = chunks.resolve_loop(loop, run.xla_convolutions)
    programs = {}  # (phase, length) -> the first planned chunk that runs that program
    for epoch, first_step, length in plan:
        phase = step.constant_at(cuts or {}, epoch * run.steps_per_epoch + first_step)
        length = length if kind == "scan" and not paced else 1
        programs.setdefault((phase, length), (epoch, first_step, length))
    for epoch, first_step, length in sorted(programs.values()):
        jax.block_until_ready(run_chunk(jax.tree.map(jnp.copy, state), data_key, epoch,
                                        first_step, length))
    jax.block_until_ready(eval_fn(state, *eval_arrays))


def start_input(config, run: prepare.Setup, data_key, manager, meta: dict, start_step: int):
    """The training data ready for the first step: (None, arrays on the devices), or (a
    stream opened at start_step, from the checkpoint's Grain state when resuming, None)."""
    if run.placement != "stream":
        return None, placement.put_train_data(run)
    stream = inputs.open_stream(run, data_key, batch_size=config.train.batch_size,
                                workers=config.data.workers, augment_config=config.augment,
                                seed=config.seed)
    if start_step < run.total_steps:
        if "step" in meta:
            resume.resume_stream(stream, manager, meta, start_step)
        else:
            stream.open(start_step)
    return stream, None


def paced_from_the_start() -> bool:
    """Whether scanned chunks run in calls of train.chunk_seconds from the first step: on a
    CPU, where an epoch's chunk can take minutes; elsewhere once a chunk has taken longer
    (chunk.pace_from_now). Only a single process: the others would cut elsewhere."""
    return jax.default_backend() == "cpu" and jax.process_count() == 1


def kind_of_loop(config, run: prepare.Setup) -> str:
    """'scan', 'python' (a call per step) or 'stream' (a call per streamed batch)."""
    if run.placement == "stream":
        return "stream"
    return chunks.resolve_loop(config.train.loop, run.xla_convolutions)


def compile_training(config, run: prepare.Setup, state, data_key, plan, stream, train_arrays,
                     cuts=None, pace=None, paced: bool = False):
    """The training steps compiled ahead of time: run_chunk (chunks.compile_chunks), or None
    when no step is left (a resumed finished run compiles evaluation alone). `cuts`
    (finished_group_cuts): the chunks after each cut are programs of their own, which
    compute no gradient for the parameters held constant there (chunks.phased_chunks).
    `pace`, `paced`: scanned chunks cut by time (chunks.ScannedChunks)."""
    if not plan:
        return None
    spec, replicated = prepare.step_spec(config, run), mesh_lib.replicated(run.mesh)
    out_sharding = (placement.state_sharding(run), replicated)  # (the state's, the metrics')
    kind = chunks.resolve_loop(config.train.loop, run.xla_convolutions)

    def compile_phase(constant, lengths):
        phase_spec = spec.replace(constant_params=constant) if constant else spec
        if stream is not None:
            return chunks.compile_stream_chunks(state, stream, data_key,
                                                len(run.dataset.x_train), phase_spec, out_sharding)
        return chunks.compile_chunks(kind, state, *train_arrays, data_key, lengths, phase_spec,
                                     out_sharding, replicas=bool(run.runs), pace=pace,
                                     paced=paced)
    return chunks.phased_chunks(plan, run.steps_per_epoch, cuts or {}, compile_phase)


def finished_group_cuts(config, run: prepare.Setup) -> dict:
    """train.drop_finished_groups: {step: the parameters held constant from it on}
    (step.finished_groups); else {} (every step computes every gradient)."""
    if not config.train.get("drop_finished_groups", False):
        return {}
    return step.finished_groups(config.optimizer, run.state.params, run.total_steps,
                                models.frozen_params(config.model))


def cache_note(cache_dir: str | None, before: dict) -> str:
    """' (...)' after the compile line: how many programs the persistent cache gave.
    Returns a format string for Clock.lap (braces doubled)."""
    if cache_dir is None:
        return " (persistent compilation cache off: train.compilation_cache='')"
    now = xla_cache.counts()
    hits = now["hits"] - before["hits"]
    compiled = hits + now["misses"] - before["misses"]
    return f" ({hits} of {compiled} from the persistent cache in {cache_dir})"


def precision_note(precision: str, model_name: str) -> str | None:
    """train.precision in one console line: what 'auto' chose here, or, for bfloat16
    asked of a convolutional model on a CPU (whose bfloat16 convolutions run many times
    slower than float32: BENCHMARKS.md), how to train faster; None for an explicit
    choice that needs no word."""
    if precision == "auto":
        chosen = checks.resolve_precision(precision)
        why = ("a CPU computes bfloat16 convolutions and matrix products slower than float32"
               if chosen == "float32" else f"{jax.default_backend().upper()} computes it fast")
        return (f"train.precision='auto': {chosen} on {jax.devices()[0].device_kind} ({why}; "
                "--config.train.precision=float32 or bfloat16 chooses)")
    if precision != "bfloat16" or jax.default_backend() != "cpu" \
            or not models.is_convolutional(model_name):
        return None
    return ("note: train.precision='bfloat16' on a CPU: its convolutions run about 20x slower "
            "than in float32 here (the recipe is for GPUs); --config.train.precision=float32 "
            "(or 'auto') trains this model much faster on this machine")
