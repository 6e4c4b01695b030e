"""summary.json's figures, from what a run ends with."""
import flax
import jax

from jaxtrain.perf import memory
from jaxtrain.runtime import mesh as mesh_lib
from jaxtrain.runtime import processes, report, xla_flags
from jaxtrain.training import checkpoint, model_state, placement, replicas


def summarize(started, state, step: int, evaluation, times) -> dict:
    """summary.json's figures: the test metrics of the last `evaluation` (a replicated
    run's means, and each replica's results), times, throughput, the run's shape and
    versions. `started`: the session.Run; `state`: the run's at `step`."""
    run, test_metrics, records = started.setup, evaluation.metrics, started.reporter.records
    if processes.is_main_process():
        started.reporter.plot()
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
    train_seconds, eval_seconds = times.train, times.eval
    # What was trained, over every resume: the state's steps, which an early stop or a
    # signal leaves short of the plan (whose length is planned_steps).
    images = copies * step * started.batch_size  # all replicas'

    summary = {
        "test_accuracy": test_metrics["accuracy"],
        "test_loss": test_metrics["loss"],
        "train_loss": train_loss,
        "params_sha256": checkpoint.params_sha256(state),
        "train_seconds": train_seconds,  # training and evaluation, over every resume
        "train_only_seconds": train_seconds - eval_seconds,
        "eval_seconds": eval_seconds,
        "compile_seconds": times.compile,
        "compilation_cache": started.cache_dir,
        "xla_flags": xla_flags.in_effect(),
        "data_placement": run.placement,
        "input_wait_fraction": times.wait / times.chunks if times.chunks else 0.0,
        "images": images,
        "images_per_second": images / max(train_seconds - eval_seconds, 1e-9),
        "epochs": step / run.steps_per_epoch,
        "steps": step,
        "planned_steps": run.total_steps,
        "precision": started.precision,
        "resumed_from_step": started.start_step if started.resumed else None,
        "batch_size": started.batch_size,
        "param_count": model_state.param_count(state.params, run.runs),
        "device_kind": jax.devices()[0].device_kind,
        "device_count": jax.device_count(),
        "process_count": jax.process_count(),
        "jax_version": jax.__version__,
        "flax_version": flax.__version__,
        "dataset": run.dataset.origin,
        "init_from": run.init_from,  # what model.init_from loaded and re-initialised
        # XLA's memory analysis of the training program per device (memory.py); with the
        # layout's state bytes on the most loaded device
        "step_memory": memory.programs_memory(getattr(started.run_chunk, "programs", ())),
        "state_bytes_per_device": max(mesh_lib.bytes_per_device(state).values(), default=0),
        "fsdp": mesh_lib.fsdp_size(run.mesh),
        "config": started.config.to_dict(),
    }
    for name, value in test_metrics.items():  # train.ema_decay: test_accuracy_ema, ...
        summary.setdefault(f"test_{name}", value)
    if replica_results is not None:
        summary.update(replica_results)
        summary["images_per_second_per_replica"] = summary["images_per_second"] / copies
        summary["replica_layout"] = ("split: each device trains whole replicas"
                                     if placement.splits_replicas(run) else
                                     "replicated: every replica's batch split over the devices")
    return summary
