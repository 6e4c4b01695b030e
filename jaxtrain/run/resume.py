"""Saving and resuming a run: what a checkpoint records beside the state, whether a
workdir's checkpoints belong to this recipe, a finished run recognised, a stream put
back at its step."""
import json
import os

from jaxtrain.config import checks
from jaxtrain.errors import ConfigError
from jaxtrain.runtime import processes, report
from jaxtrain.training import checkpoint, optim, prepare, train_state


def completed_summary(workdir: str, config) -> dict | None:
    """summary.json of a run in `workdir` that already reached the end `config` asks for,
    after one line saying so; None when there is anything left to train. Nothing is
    loaded, compiled or evaluated."""
    summary = finished_summary(workdir)
    train = config.train
    if summary is None or not (summary["steps"] == train.num_steps if train.num_steps > 0
                               else summary.get("epochs") == train.num_epochs):
        return None
    if saved_recipe_changes(workdir, config):  # allowed to change: the checkpoint is loaded
        return None
    if processes.is_main_process():
        accuracy = summary.get("test_accuracy")
        print(f"the run in {workdir} is complete: step {summary['steps']} of "
              f"{summary['steps']}, test accuracy "
              + (f"{accuracy:.2%}" if isinstance(accuracy, (int, float)) else "n/a")
              + f"; its summary is {os.path.join(workdir, report.SUMMARY_FILE)} (--mode=eval "
              "evaluates it again; another --workdir starts a new run)", flush=True)
    return summary


def finished_summary(workdir: str) -> dict | None:
    """summary.json of a run in `workdir` that trained every step it planned (not one
    stopped early) and whose newest checkpoint is its last step; None for any other (or
    an unreadable summary: the run writes it anew). Summaries from before planned_steps
    was kept count as planned."""
    steps = checkpoint.saved_steps(checkpoint.checkpoint_dir(workdir))
    try:
        with open(os.path.join(workdir, report.SUMMARY_FILE)) as f:
            summary = json.load(f)
    except (OSError, ValueError):
        return None
    finished = summary.get("steps") == summary.get("planned_steps", summary.get("steps"))
    return summary if steps and max(steps) == summary.get("steps") and finished else None


def save(run, state, window, times, evaluation, best=None) -> None:
    """Starts saving a checkpoint of `state`, with the metrics of the steps since the last
    row (`window`, rows.RowWindow), the times so far and the stream's position when
    streaming. A replicated run's records its replicas and their test accuracies at the
    last `evaluation` (what jaxtrain.restore picks the best replica by). `best`: what
    checkpoint.best ranks the step by."""
    setup = run.setup
    meta = checkpoint_meta(setup, run.seed, state, times.train, times.eval)
    meta["rows"] = window.to_json()  # the steps since the last metrics row
    if setup.runs:
        meta["replicas"] = [one._asdict() for one in setup.runs]
        if evaluation is not None:
            meta["replica_test_accuracy"] = evaluation.metrics["accuracy"]
    input_state = None
    if run.stream is not None:
        meta["input"], input_state = run.stream.checkpoint()
    checkpoint.save(run.manager, state, run.data_key, meta, input_state, best)


def checkpoint_meta(run: prepare.Setup, seed: int, state, train_seconds: float,
                    eval_seconds: float) -> dict:
    """The JSON half of a checkpoint: the data-order position and what inference needs."""
    step = train_state.current_step(state)
    return {"step": step, "epoch": step // run.steps_per_epoch,
            "step_in_epoch": step % run.steps_per_epoch, "seed": seed,
            "train_seconds": train_seconds, "eval_seconds": eval_seconds,
            "mean": list(run.mean), "std": list(run.std),
            "class_names": list(run.dataset.class_names),
            "image_shape": list(run.dataset.image_shape),
            **({"init_from": run.init_from} if run.init_from else {})}


def check_resumable(workdir: str, config) -> None:
    """A workdir with checkpoints resumes only the recipe that wrote them: any change that
    alters training (checks.recipe_changes) stops here, before anything is loaded or
    written, unless checkpoint.allow_recipe_change says to go on (and then it is said);
    another optimiser (optimizer.name) stops here either way (optimizer_change)."""
    changes = saved_recipe_changes(workdir, config, say_moved=True)
    if not changes:
        return
    optimizer = optimizer_change(workdir, changes, config.checkpoint.allow_recipe_change)
    if optimizer is not None:
        raise ConfigError(optimizer)
    missing = python_part_missing(workdir, changes)
    if missing is not None:
        raise ConfigError(missing)
    note = extension(workdir, config, changes)
    if note is not None:  # a finished run trained on for longer: allowed, and said
        if processes.is_main_process():
            print(note, flush=True)
        return
    listed = "; ".join(f"{key}: {before!r} -> {after!r}" for key, before, after in changes)
    if not config.checkpoint.allow_recipe_change:
        raise ConfigError(
            f"{workdir} holds checkpoints of another recipe ({listed}). Use a new --workdir, "
            "or resume anyway with --config.checkpoint.allow_recipe_change=True (the run is "
            "then no longer an exact resume)")
    if processes.is_main_process():
        print(f"resuming with a changed recipe ({listed}): checkpoint.allow_recipe_change=True;"
              " the run is no longer an exact resume of the one that wrote the checkpoints",
              flush=True)


def optimizer_change(workdir: str, changes: list, allowed: bool) -> str | None:
    """The line refusing a resume whose optimizer.name is not the one that wrote the
    checkpoints (to or from one passed from Python, 'python:module:name', too), when it
    is the only change or the others are allowed: the optimiser state they hold is the
    other optimiser's, which allow_recipe_change cannot make this one's. None otherwise
    (several changes, refused: the recipe line lists them all)."""
    names = [(before, after) for key, before, after in changes if key == "optimizer.name"]
    if not names or (len(changes) > 1 and not allowed):
        return None
    (before, after), = names
    again = ("pass that optimiser to train_and_evaluate(optimizer=...) again"
             if str(before).startswith(optim.PYTHON) else f"--config.optimizer.name={before}")
    return (f"config.optimizer.name: the checkpoints in {workdir} were written with "
            f"{before!r}, this run uses {after!r}; the optimiser state they hold is "
            f"{before!r}'s. Resume with the same optimiser ({again}), or use another "
            f"--workdir (--config.model.init_from={workdir} starts a new run from its weights)")


# The config keys that record a part passed from Python (parts.py), and its argument.
PYTHON_PARTS = {"train.loss": "loss", "augment.fn": "augment"}


def python_part_missing(workdir: str, changes: list) -> str | None:
    """The line refusing a resume without the loss or augmentation the run was given from
    Python (recorded as 'python:module:name'), when that is the only change; None
    otherwise (the recipe line lists several)."""
    if len(changes) != 1 or changes[0][0] not in PYTHON_PARTS:
        return None
    (key, before, after), = changes
    if not str(before).startswith(optim.PYTHON):
        return None
    argument = PYTHON_PARTS[key]
    return (f"config.{key}: the run in {workdir} was trained with a {argument} passed from "
            f"Python ({before!r}), this run has {after!r}; pass it again "
            f"(train_and_evaluate(..., {argument}=...)) to resume, or use another --workdir")


LENGTH_KEYS = ("train.num_steps", "train.num_epochs")


def extension(workdir: str, config, changes: list) -> str | None:
    """The line for a finished run that `config` only makes longer (train.num_epochs or
    num_steps raised; its newest checkpoint is its summary's last step), as Keras's fit
    trains on from where it stopped; None for any other change."""
    if any(key not in LENGTH_KEYS for key, _, _ in changes):
        return None
    summary = finished_summary(workdir)
    train = config.train
    if summary is None or not (train.num_steps > summary["steps"] if train.num_steps > 0
                               else train.num_epochs > summary.get("epochs", float("inf"))):
        return None
    length = (f"{train.num_steps} steps" if train.num_steps > 0
              else f"{train.num_epochs} epochs")
    return (f"extending the finished run in {workdir} (step {summary['steps']}) to {length}: "
            "the learning-rate schedule is the new length's from here on, so this is not "
            "the run the longer recipe would have trained from the start")


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
        if say_moved and processes.is_main_process():
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
