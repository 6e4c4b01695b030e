"""--mode=eval (main.py's other mode): a saved checkpoint evaluated on the test split, with
the config its run recorded."""
import json
import os

import jax
import ml_collections
import numpy as np

from jaxtrain.config import checks, defaults
from jaxtrain.runtime import processes, report, xla_cache
from jaxtrain.training import checkpoint, placement, prepare, replicas, train_state


def evaluate_checkpoint(config, workdir: str, checkpoint_path: str | None = None) -> dict:
    """--mode=eval: restores the newest checkpoint (or checkpoint_path: a step number of
    workdir's, or a step directory) and evaluates it. A missing checkpoint is reported
    before the data is loaded. checkpoint_path='best': the best checkpoint by the run's
    checkpoint.best_metric."""
    checks.check_config(config)
    best = checkpoint.best_policy(config.checkpoint)
    if checkpoint_path == "best":
        if not checkpoint.saved_steps(checkpoint.checkpoint_dir(workdir)):
            raise checkpoint.CheckpointError(
                f"--checkpoint=best: no checkpoint in {checkpoint.checkpoint_dir(workdir)}")
        if best is None:
            raise checkpoint.CheckpointError(
                "--checkpoint=best: this run kept no best checkpoint (it trained with "
                "checkpoint.best_metric='')")
        manager = checkpoint.create_manager(checkpoint.checkpoint_dir(workdir), create=False,
                                            best=best)
        try:
            checkpoint_path = str(checkpoint.best_step(manager))
        finally:
            manager.close()
    if checkpoint_path and checkpoint_path.strip().isdigit():
        directory, step = checkpoint.checkpoint_dir(workdir), int(checkpoint_path)
    elif checkpoint_path:
        path = os.path.abspath(checkpoint_path.rstrip("/"))
        directory, name = os.path.split(path)
        if not name.isdigit():
            raise checkpoint.CheckpointError(f"--checkpoint={checkpoint_path}: expected a step "
                                             "directory such as WORKDIR/checkpoints/1000")
        step = int(name)
    else:
        directory, step = checkpoint.checkpoint_dir(workdir), None
    if not os.path.isdir(directory if step is None else os.path.join(directory, str(step))):
        saved = checkpoint.saved_steps(directory)
        where = f"step {step} in {directory}" if step is not None else directory
        raise checkpoint.CheckpointError(
            f"no checkpoint at {where} (saved steps: "
            f"{', '.join(map(str, saved)) if saved else 'none'})")
    xla_cache.enable(config.train.compilation_cache)
    run = prepare.setup(config, abstract_state=True)  # the checkpoint gives the state
    manager = checkpoint.create_manager(directory, create=False)
    try:
        restored = checkpoint.restore(
            manager, checkpoint.restore_target(run.state, placement.state_sharding(run)),
            run.data_key, step, choose=lambda older: f"--checkpoint={older} evaluates the "
            "newest of them")
    finally:
        manager.close()
    if restored is None:
        raise checkpoint.CheckpointError(f"no checkpoint in {directory}")
    state = restored[0]
    eval_arrays = placement.put_eval_data(config.eval.batch_size, run)
    evaluate = prepare.compile_eval(config, run, state, eval_arrays)
    with report.evaluation_progress(evaluate.batches, processes.is_main_process()) as bar:
        metrics = jax.device_get(evaluate(state, *eval_arrays, progress=bar.update))
    tta = config.eval.tta
    if tta != "none" and config.eval.tta_fraction < 1:
        tta += f" on the least confident {config.eval.tta_fraction:.0%} of images"
    step = train_state.current_step(state)
    result = {"step": step, "device_count": jax.device_count(), "tta": tta}
    if run.runs:  # every replica's figures; the top-level ones are their means
        result["replicas"] = [{"replica": r, "test_accuracy": float(metrics["accuracy"][r]),
                               "test_loss": float(metrics["loss"][r])}
                              for r in range(len(run.runs))]
    result.update(test_accuracy=float(np.mean(metrics["accuracy"])),
                  test_loss=float(np.mean(metrics["loss"])))
    if processes.is_main_process():
        for line in result.get("replicas", []):
            print(f"{replicas.describe(run.runs[line['replica']])}: test_accuracy="
                  f"{line['test_accuracy']:.2%}  test_loss={line['test_loss']:.4f}")
        mean = f" (mean of {len(run.runs)} replicas)" if run.runs else ""
        print(f"checkpoint step {step}: test_accuracy={result['test_accuracy']:.2%}  "
              f"test_loss={result['test_loss']:.4f}{mean}  (TTA: {tta}; on "
              f"{jax.device_count()} device{'s' if jax.device_count() > 1 else ''})")
    return result


def run_config(workdir: str, overrides=None):
    """The config a workdir's run recorded (config.json) on top of the defaults, with
    `overrides` ({dotted key: value}) on top; None when the workdir has no config.json."""
    path = os.path.join(workdir, checkpoint.CONFIG_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            saved = json.load(f)
    except (OSError, ValueError) as error:
        raise checkpoint.CheckpointError(f"{path}: cannot be read ({error})") from None
    config = defaults.get_config()

    def merge(node, values):
        for name, value in values.items():
            if isinstance(value, dict) and name in node and isinstance(
                    node[name], ml_collections.ConfigDict):
                merge(node[name], value)
            else:
                if isinstance(value, list):
                    value = tuple(value)
                with node.ignore_type():
                    node[name] = (ml_collections.ConfigDict(value) if isinstance(value, dict)
                                  else value)
    merge(config, saved)
    for key, value in (overrides or {}).items():
        block, _, name = key.rpartition(".")
        node = defaults.value_at(config, block) if block else config
        with node.ignore_type():
            node[name] = value
    return config

