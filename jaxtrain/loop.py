"""The host loop: runs the compiled chunks (train.py), evaluates, reports (report.py)
and saves checkpoints (checkpoint.py) on schedule, and resumes exactly."""
import copy
import json
import os
import signal
import time

import flax
import jax

from jaxtrain import (checkpoint, checks, models, parallel, prepare, report, signals, train,
                      user_model)
from jaxtrain.errors import ConfigError, TrainingError


CONFIG_FILE = "config.json"


def train_and_evaluate(config, workdir: str, *, model=None,
                       start_time: float | None = None) -> dict:
    """Trains and evaluates the model the config describes; writes reports to workdir.

    Resumes from the newest checkpoint in workdir/checkpoints when there is one.
    Returns the summary (also written to workdir/summary.json). In a multi-process
    run every process calls this; process 0 alone prints and writes the reports.
    """
    start_time = time.time() if start_time is None else start_time
    signals.enter_phase("checking the config; nothing written yet")
    checks.check_config(config)
    if model is not None:
        config = copy.deepcopy(config)
        with config.unlocked():
            config.model.name = user_model.instance_name(model)
    check_resumable(workdir, config)
    mesh = parallel.create_mesh()
    prepare.check_batch_split(config.train.batch_size, mesh)
    signals.enter_phase("loading the data and building the model; nothing written yet")
    run = prepare.setup(config, mesh, model=model)
    main_process = parallel.is_main_process()
    state, data_key = run.state, run.data_key
    streaming = run.placement == "stream"
    manager = checkpoint.create_manager(checkpoint.checkpoint_dir(workdir), config.checkpoint.keep,
                                        stream=streaming)
    parallel.CHECKPOINTS["directory"] = manager.directory  # named if a peer process is lost
    restored = checkpoint.restore(manager, state, data_key)
    train_seconds = eval_seconds = 0.0
    if restored is not None:
        state, data_key, meta = restored
        train_seconds, eval_seconds = meta["train_seconds"], meta["eval_seconds"]
    start_step = int(state.step)
    if main_process:
        report.write_json_atomically(os.path.join(workdir, CONFIG_FILE), config.to_dict())
    signals.enter_phase(f"compiling; nothing trained in this run yet (checkpoints in "
                f"{manager.directory})")

    replicated = parallel.replicated(run.mesh)
    eval_arrays = prepare.put_eval_data(config, run)
    step_kwargs = prepare.step_arguments(config, run)
    every_save = save_interval(config, run.steps_per_epoch)
    plan = plan_chunks(run.total_steps, run.steps_per_epoch, config.train.log_every_steps,
                       every_save, start_step)

    compile_start = time.perf_counter()
    stream = None
    if streaming:
        stream = prepare.open_stream(config, run, data_key)
        if restored is not None and start_step < run.total_steps:
            resume_stream(stream, manager, meta, start_step)
        elif start_step < run.total_steps:
            stream.open(start_step)
        run_chunk = train.compile_stream_chunks(state, stream, data_key, len(run.dataset.x_train),
                                          step_kwargs, replicated)
    else:
        x_train, y_train = prepare.put_train_data(run)
        loop = train.resolve_loop(config.train.loop, models.is_convolutional(config.model.name))
        run_chunk = train.compile_chunks(loop, state, x_train, y_train, data_key,
                                   {length for _, _, length in plan}, step_kwargs, replicated)
    eval_fn = prepare.compile_eval(config, run, state, eval_arrays)
    compile_seconds = time.perf_counter() - compile_start
    if streaming and start_step < run.total_steps:
        stream.fill()  # the workers started while XLA compiled; their first batches now
    signals.enter_phase("training", stop_at_once=False)  # signals.StopRequest: a checkpoint, then stop

    reporter = report.Reporter(workdir, total_steps=run.total_steps, start_step=start_step,
                               write=main_process)
    where = "host, streamed" if streaming else "devices"
    reporter.print_line(f"data on the {where}: {run.placement_reason}"
                        + (f"; {stream.workers} Grain workers" if streaming and stream.workers
                           else ""))
    reporter.print_header(model=config.model.name, params=models.count_params(state.params),
                          dataset=run.dataset.origin, device=jax.devices()[0].device_kind,
                          devices=jax.device_count(), processes=jax.process_count(),
                          steps=run.total_steps, compile_seconds=compile_seconds)
    if restored is not None:
        reporter.print_line(f"resumed from checkpoint step {start_step} "
                            f"({manager.directory}/{start_step})")
    step = start_step
    epoch_sums = {"loss": 0.0, "accuracy": 0.0, "steps": 0}
    test_metrics = None
    wait_seconds = chunk_seconds = 0.0
    record = reporter.records[-1] if reporter.records else {}
    # One process alone may not stop mid-chunk: the others would wait for it forever.
    single_process = jax.process_count() == 1
    try:
        with signals.StopRequest() as stop:
            for epoch, first_step, length in plan:
                waited = stream.wait_seconds if streaming else 0.0
                (state, metrics), seconds = train.timed(run_chunk, state, data_key, epoch,
                                                  first_step, length,
                                                  stop if single_process else None)
                train_seconds += seconds
                chunk_wait = stream.wait_seconds - waited if streaming else 0.0
                wait_seconds += chunk_wait
                chunk_seconds += seconds
                metrics = jax.device_get(metrics)
                if metrics["nonfinite_step"] >= 0 and config.train.nonfinite == "stop":
                    bad = epoch * run.steps_per_epoch + int(metrics["nonfinite_step"])
                    raise TrainingError(
                        f"non-finite training loss at step {bad} (epoch {epoch}); the last "
                        f"good checkpoint is kept in {manager.directory}. Lower "
                        "optimizer.learning_rate, check the data, or set "
                        "train.nonfinite='skip' to skip such steps")
                done = int(state.step) - step
                step = int(state.step)
                epoch_sums["loss"] += float(metrics["loss"]) * done
                epoch_sums["accuracy"] += float(metrics["accuracy"]) * done
                epoch_sums["steps"] += done
                record = {"step": step, "epoch": round(step / run.steps_per_epoch, 4),
                          "train_loss": float(metrics["loss"]),
                          "train_accuracy": float(metrics["accuracy"]),
                          "learning_rate": float(run.schedule(step - 1)),
                          "input_wait_fraction": round(chunk_wait / max(seconds, 1e-9), 4)}
                if metrics["nonfinite_steps"]:
                    record["skipped_steps"] = int(metrics["nonfinite_steps"])
                epoch_done = step % run.steps_per_epoch == 0
                last = step == run.total_steps
                if evaluates_after(step, run.steps_per_epoch, run.total_steps,
                                   config.eval.every_epochs):
                    test_metrics, seconds = train.timed(eval_fn, state, *eval_arrays)
                    test_metrics = {k: float(v) for k, v in jax.device_get(test_metrics).items()}
                    eval_seconds += seconds
                    train_seconds += seconds
                    record.update(test_loss=test_metrics["loss"],
                                  test_accuracy=test_metrics["accuracy"])
                record["seconds"] = round(train_seconds, 4)
                reporter.log(record)
                if epoch_done or last:
                    reporter.print_row(dict(
                        record, train_loss=epoch_sums["loss"] / max(epoch_sums["steps"], 1),
                        train_accuracy=epoch_sums["accuracy"] / max(epoch_sums["steps"], 1)))
                    epoch_sums = {"loss": 0.0, "accuracy": 0.0, "steps": 0}
                stopping = parallel.any_process(stop())
                if last or stopping or (every_save > 0 and step % every_save == 0):
                    meta, input_state = checkpoint_meta(
                        run, config, state, train_seconds, eval_seconds), None
                    if streaming:
                        meta["input"], input_state = stream.checkpoint()
                    checkpoint.save(manager, state, data_key, meta, input_state)
                if stopping:
                    checkpoint.wait(manager)
                    raise signals.Interrupted(stop.signal or signal.SIGTERM, step, manager.directory)
            checkpoint.wait(manager)
            signals.enter_phase(f"evaluating and writing the reports after the last step; its "
                        f"checkpoint is saved in {manager.directory}/{step}", stop_at_once=False)
            if stop():  # a signal while the last checkpoint was written
                raise signals.Interrupted(stop.signal, step, manager.directory)
    finally:
        if stream is not None:
            stream.close()
        reporter.close()
        manager.close()

    if test_metrics is None:  # resumed from a checkpoint of the finished run
        test_metrics = {k: float(v) for k, v in jax.device_get(eval_fn(state, *eval_arrays)).items()}
    if main_process:
        reporter.plot()
    summary = {
        "test_accuracy": test_metrics["accuracy"],
        "test_loss": test_metrics["loss"],
        "train_loss": record.get("train_loss"),
        "params_sha256": checkpoint.params_sha256(state),
        "train_seconds": train_seconds,
        "eval_seconds": eval_seconds,
        "compile_seconds": compile_seconds,
        "data_placement": run.placement,
        "input_wait_fraction": wait_seconds / chunk_seconds if chunk_seconds else 0.0,
        "images_per_second": (run.total_steps * config.train.batch_size
                              / max(train_seconds - eval_seconds, 1e-9)),
        "epochs": run.total_steps / run.steps_per_epoch,
        "steps": run.total_steps,
        "resumed_from_step": start_step if restored is not None else None,
        "batch_size": config.train.batch_size,
        "param_count": models.count_params(state.params),
        "device_kind": jax.devices()[0].device_kind,
        "device_count": jax.device_count(),
        "process_count": jax.process_count(),
        "jax_version": jax.__version__,
        "flax_version": flax.__version__,
        "dataset": run.dataset.origin,
        "config": config.to_dict(),
    }
    summary["total_seconds"] = time.time() - start_time
    reporter.write_summary(summary)
    return summary


def plan_chunks(total_steps: int, steps_per_epoch: int, log_every_steps: int,
                save_every_steps: int = 0, start_step: int = 0):
    """[(epoch, first_step_in_epoch, num_steps)] from start_step to total_steps.

    Chunks end at every epoch end, every log_every_steps within an epoch and
    every multiple of save_every_steps. The grid does not depend on start_step,
    so a resumed run computes the same chunks as an uninterrupted one.
    """
    chunk = log_every_steps if 0 < log_every_steps < steps_per_epoch else steps_per_epoch
    plan, step = [], start_step
    while step < total_steps:
        epoch, in_epoch = divmod(step, steps_per_epoch)
        end = min(step - in_epoch + steps_per_epoch, step - in_epoch % chunk + chunk, total_steps)
        if save_every_steps > 0:
            end = min(end, step - step % save_every_steps + save_every_steps)
        plan.append((epoch, in_epoch, end - step))
        step = end
    return plan


def save_interval(config, steps_per_epoch: int) -> int:
    """checkpoint.every_steps, else checkpoint.every_epochs in steps; 0 = only at the end."""
    if config.checkpoint.every_steps > 0:
        return config.checkpoint.every_steps
    return max(config.checkpoint.every_epochs, 0) * steps_per_epoch


def evaluates_after(step: int, steps_per_epoch: int, total_steps: int, every_epochs: int):
    """Evaluation schedule: after the last step and every `every_epochs` epochs."""
    epoch_done = step % steps_per_epoch == 0
    return step == total_steps or (epoch_done and every_epochs > 0
                                   and (step // steps_per_epoch) % every_epochs == 0)


def checkpoint_meta(run: prepare.Setup, config, state, train_seconds: float, eval_seconds: float):
    """The JSON half of a checkpoint: the data-order position and what inference needs."""
    step = int(state.step)
    return {"step": step, "epoch": step // run.steps_per_epoch,
            "step_in_epoch": step % run.steps_per_epoch, "seed": config.seed,
            "train_seconds": train_seconds, "eval_seconds": eval_seconds,
            "mean": list(run.mean), "std": list(run.std),
            "class_names": list(run.dataset.class_names),
            "image_shape": list(run.dataset.image_shape)}


def check_resumable(workdir: str, config) -> None:
    """A workdir with checkpoints resumes only the recipe that wrote them: any change that
    alters training (checks.recipe_changes) stops here, before anything is loaded or
    written, unless checkpoint.allow_recipe_change says to go on (and then it is said)."""
    path = os.path.join(workdir, CONFIG_FILE)
    directory = checkpoint.checkpoint_dir(workdir)
    saved_steps = [n for n in os.listdir(directory) if n.isdigit()] if os.path.isdir(
        directory) else []
    if not saved_steps or not os.path.isfile(path):
        return
    try:
        with open(path) as f:
            saved = json.load(f)
    except (OSError, ValueError) as error:
        raise checkpoint.CheckpointError(f"{path}: cannot be read ({error}); it records the "
                                         "recipe of the checkpoints beside it") from None
    changes = checks.recipe_changes(saved, config)
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

