"""test_scale's runs on several CPU devices, in a process of their own (the device
count is fixed when JAX starts): `python tests/scale_probe.py SPEC.json OUT.json`.

SPEC holds {"runs": [{"name", "workdir", "npz", "model", "fsdp", "steps", ...}, ...],
"memory": [{"name", "npz", "model", "batch_size", "accumulate_steps", "remat", "fsdp"}]};
a run's "kwargs" are model.kwargs (a model of your own), its "loop" train.loop.
Each run trains with train_and_evaluate (resuming if its workdir holds a checkpoint);
OUT gets, per run, its per-step train losses, summary.json's figures, and the bytes
its final parameters and optimiser state hold on each device; per memory entry,
memory.step_memory.
"""
import json
import sys

import jax
import ml_collections
import numpy as np

from jaxtrain.config.defaults import get_config
from jaxtrain.perf import memory
from jaxtrain.run import loop
from jaxtrain.runtime import mesh as mesh_lib
from jaxtrain.runtime import report


def config_for(spec: dict):
    config = get_config()
    config.data.name, config.data.dir = "arrays", spec["npz"]
    config.model.name = spec["model"]
    config.model.stem = spec.get("stem", "auto")
    config.model.remat = spec.get("remat", False)
    if "kwargs" in spec:
        config.model.kwargs = ml_collections.ConfigDict(spec["kwargs"])
    config.train.loop = spec.get("loop", "auto")
    config.train.precision = "float32"
    config.train.batch_size = spec.get("batch_size", 16)
    config.train.num_steps = spec.get("steps", 5)
    config.train.accumulate_steps = spec.get("accumulate_steps", 1)
    config.train.log_every_steps = 1
    config.train.compilation_cache = ""
    config.optimizer.name = spec.get("optimizer", "sgd")
    config.optimizer.learning_rate = spec.get("learning_rate", 0.01)
    config.eval.batch_size = 16
    config.eval.every_epochs = 0
    config.checkpoint.every_steps = spec.get("checkpoint_every", 0)
    config.checkpoint.every_epochs = 0
    config.parallel.fsdp = spec.get("fsdp", 1)
    return config


def captured_state(workdir: str):
    """The final state of the run in `workdir`, as its layout left it on the devices."""
    from jaxtrain.training import checkpoint, prepare
    from jaxtrain.training import placement
    config = config_for(json.loads(open(f"{workdir}/spec.json").read()))
    mesh = placement.create_mesh(config.parallel.fsdp)
    run = prepare.setup(config, mesh, abstract_state=True)
    manager = checkpoint.create_manager(checkpoint.checkpoint_dir(workdir), create=False)
    try:
        state, _, _ = checkpoint.restore(
            manager, checkpoint.restore_target(run.state, placement.state_sharding(run)),
            run.data_key)
    finally:
        manager.close()
    return state


def main(spec_path: str, out_path: str):
    spec = json.loads(open(spec_path).read())
    out = {"devices": jax.device_count(), "processes": jax.process_count(), "runs": {},
           "memory": {}}
    for run in spec.get("runs", []):
        with open(f"{run['workdir']}/spec.json", "w") as f:
            json.dump(run, f)
        loop.train_and_evaluate(config_for(run), run["workdir"])
        rows = [json.loads(line) for line in open(f"{run['workdir']}/{report.METRICS_FILE}")]
        losses = {row["step"]: row["train_loss"] for row in rows if "train_loss" in row}
        summary = json.loads(open(f"{run['workdir']}/{report.SUMMARY_FILE}").read())
        state = captured_state(run["workdir"])
        held = mesh_lib.bytes_per_device({"params": state.params, "opt": state.opt_state})
        total = sum(np.asarray(leaf).nbytes for leaf in jax.tree.leaves(
            {"params": state.params, "opt": state.opt_state}))
        out["runs"][run["name"]] = {
            "losses": losses, "fsdp": summary["fsdp"], "steps": summary["steps"],
            "resumed_from_step": summary["resumed_from_step"],
            "step_memory": summary["step_memory"],
            "params_and_opt_bytes_per_device": sorted(held.values()),
            "params_and_opt_bytes": int(total)}
    for entry in spec.get("memory", []):
        out["memory"][entry["name"]] = memory.step_memory(config_for(entry))
    if jax.process_index() == 0:
        with open(out_path, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:])
