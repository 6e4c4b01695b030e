"""Orbax checkpoints: save during training, resume exactly, restore for evaluation.

A checkpoint is a plain Orbax CheckpointManager step directory under
WORKDIR/checkpoints/<step>/ with two items:
  state: {params, batch_stats, opt_state, step, rng} as an Orbax standard pytree
         (inference reads params, batch_stats and ema only: restore_weights)
  meta:  JSON {step, epoch, step_in_epoch, seed}: the data-order position
  input: (streamed runs) the Grain iterator's state, one JSON file per process,
         written by Grain's own Orbax CheckpointHandler
Nothing in it is pickled.
"""
import errno
import fcntl
import hashlib
import json
import logging
import os
import socket
import sys
import threading
import time
import traceback

import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxtrain.errors import ConfigError
from jaxtrain.training import optim, train_state

CHECKPOINT_DIR = "checkpoints"
CONFIG_FILE = "config.json"  # WORKDIR/config.json: the recipe of the checkpoints beside it


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or does not fit the model; the message says which."""


class OptimizerStateMismatch(CheckpointError):
    """A checkpoint whose weights fit the model but whose optimiser state is not the one
    this run's optimiser makes: resuming needs the optimiser that wrote it."""


def checkpoint_dir(workdir: str) -> str:
    return os.path.abspath(os.path.join(workdir, CHECKPOINT_DIR))


def restore_target(state, sharding):
    """`state`'s arrays as shapes laid out by `sharding` (one for all, or a tree of one
    per leaf: parallel.fsdp's): what restore fills without an initial state being
    computed first. Orbax reads each array into the layout its target says, whatever
    the device count or layout it was saved from."""
    if isinstance(sharding, jax.sharding.Sharding):
        return jax.tree.map(
            lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding), state)
    return jax.tree.map(lambda leaf, where: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype,
                                                                 sharding=where),
                        state, sharding)


def saved_steps(directory: str) -> list[int]:
    """The step numbers of the checkpoint folders in `directory` (none if it is missing)."""
    if not os.path.isdir(directory):
        return []
    return sorted(int(name) for name in os.listdir(directory) if name.isdigit())


BEST_MODES = ("auto", "max", "min")


def best_policy(checkpoint_config) -> tuple | None:
    """(metric, 'max' or 'min', how many) from checkpoint.best_metric / best_mode /
    keep_best; None when no best checkpoint is kept."""
    metric = checkpoint_config.get("best_metric", "")
    if not metric:
        return None
    mode = checkpoint_config.get("best_mode", "auto")
    if mode == "auto":
        mode = "max" if "accuracy" in metric else "min"
    return metric, mode, checkpoint_config.get("keep_best", 1)


class _NoMetricsWarning(logging.Filter):
    """Orbax warns at every save without metrics once it tracks the best; jaxtrain saves
    between evaluations on purpose (those steps are kept for resuming, not ranked)."""

    def filter(self, record):
        return "did not provide metrics" not in record.getMessage()


def create_manager(directory: str, keep: int = 3, create: bool = True, stream: bool = False,
                   best: tuple | None = None, weights_only: bool = False):
    """An Orbax CheckpointManager that saves asynchronously and keeps the last `keep`;
    `stream`: it also holds the Grain input iterator's state. `best` (best_policy's):
    it also keeps the best checkpoints by that test metric (Orbax's BestN policy beside
    LatestN, so the newest one that resume needs is always kept). `weights_only`: one
    that reads part of the state (restore_weights) and saves nothing."""
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise CheckpointError(f"cannot use {directory} for checkpoints: it is not a directory")
    if best is None:
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=create)
    else:
        metric, mode, count = best
        policies = ocp.checkpoint_managers
        options = ocp.CheckpointManagerOptions(
            create=create, best_fn=lambda metrics: metrics[metric], best_mode=mode,
            preservation_policy=policies.AnyPreservationPolicy([
                policies.LatestN(n=keep),
                policies.BestN(get_metric_fn=lambda metrics: metrics[metric],
                               reverse=mode == "min", n=count,
                               keep_checkpoints_without_metrics=False)]))
        for name in ("absl", ""):
            if not any(isinstance(f, _NoMetricsWarning) for f in logging.getLogger(name).filters):
                logging.getLogger(name).addFilter(_NoMetricsWarning())
    # The same files either way: StandardCheckpointHandler writes PyTreeCheckpointHandler's,
    # whose restore takes partial_restore (a target holding some of the saved subtrees).
    state_handler = (ocp.PyTreeCheckpointHandler() if weights_only
                     else ocp.StandardCheckpointHandler())
    handlers = {"state": state_handler, "meta": ocp.JsonCheckpointHandler()}
    if stream or _holds_input_state(directory):  # Orbax warns of items it has no handler for
        import grain  # only streaming runs pay for the import
        handlers["input"] = grain.checkpoint.CheckpointHandler()
    try:
        return ocp.CheckpointManager(directory, options=options, item_handlers=handlers)
    except OSError as error:
        raise CheckpointError(f"cannot write checkpoints in {directory}: {error}") from error


def _holds_input_state(directory: str) -> bool:
    """Whether a checkpoint in `directory` holds a streamed run's input iterator state."""
    try:
        steps = [name for name in os.listdir(directory) if name.isdigit()]
    except OSError:
        return False
    return any(os.path.isdir(os.path.join(directory, step, "input")) for step in steps)


def state_tree(state, rng) -> dict:
    """What a checkpoint holds of a TrainState, plus the run's PRNG key data (and the
    weights' moving average, train.ema_decay)."""
    tree = {"params": state.params, "batch_stats": state.batch_stats,
            "opt_state": state.opt_state, "step": state.step,
            "rng": jax.random.key_data(rng)}
    if state.ema is not None:
        tree["ema"] = state.ema
    return tree


def save(manager, state, rng, meta: dict, input_state=None, metrics: dict | None = None) -> None:
    """Starts an asynchronous save of the state at its step; raises CheckpointError on failure.
    input_state: a Grain iterator (or its frozen state) to save beside it. metrics: the
    test metrics of this step, by which a manager keeping the best ranks it."""
    step = train_state.current_step(state)
    items = {"state": ocp.args.StandardSave(state_tree(state, rng)),
             "meta": ocp.args.JsonSave(meta)}
    if input_state is not None:
        import grain
        items["input"] = grain.checkpoint.CheckpointSave(input_state)
    try:
        manager.save(step, args=ocp.args.Composite(**items), metrics=metrics)
    except OSError as error:
        raise CheckpointError(f"saving the checkpoint of step {step} in {manager.directory} "
                              f"failed: {error}; earlier checkpoints are untouched") from error


def wait(manager) -> None:
    """Blocks until pending saves are on disk; a failed background save raises CheckpointError."""
    try:
        manager.wait_until_finished()
    except OSError as error:
        raise CheckpointError(f"writing a checkpoint in {manager.directory} failed: {error}; "
                              "earlier checkpoints are untouched") from error


# A checkpoint's parts, parameters first: they name the layer that differs most plainly.
PARTS = ("params", "batch_stats", "opt_state", "step", "rng", "ema")


def check_compatible(manager, step: int, target: dict, weights_only: bool = False) -> None:
    """Raises CheckpointError naming the first parameter whose shape or presence differs
    (OptimizerStateMismatch when the weights fit and the optimiser state does not).
    `weights_only`: the saved parts that `target` leaves out (the optimiser state, say)
    are not compared."""
    saved = manager.item_metadata(step)["state"]
    saved_leaves = {optim.param_path(p): leaf
                    for p, leaf in jax.tree_util.tree_leaves_with_path(saved)}
    if not saved_leaves:  # files gone: damage, not another model (restore falls back)
        raise FileNotFoundError(f"{manager.directory}/{step}: no readable state metadata")
    ordered = [(f"{top}/{optim.param_path(path)}" if path else top, leaf)
               for top in PARTS if top in target
               for path, leaf in jax.tree_util.tree_leaves_with_path(target[top])]
    for name, leaf in ordered:
        if name not in saved_leaves:
            raise mismatch(manager, step, name, "was written by a different model",
                           f"it has no {name!r}")
        saved_shape = tuple(saved_leaves.pop(name).shape)
        if saved_shape != tuple(np.shape(leaf)):
            raise mismatch(manager, step, name, "does not fit this model",
                           f"{name!r} has shape {saved_shape} there and "
                           f"{tuple(np.shape(leaf))} here")
    if weights_only:
        saved_leaves = {name: leaf for name, leaf in saved_leaves.items()
                        if part_of(name) in target}
    if saved_leaves:
        name = min(saved_leaves, key=lambda name: PARTS.index(part_of(name))
                   if part_of(name) in PARTS else len(PARTS))
        raise mismatch(manager, step, name, "was written by a different model",
                       f"this model has no {name!r}")


def part_of(name: str) -> str:
    """The checkpoint part ('params', 'opt_state', ...) a check_compatible name is in."""
    return name.split("/", 1)[0]


def mismatch(manager, step: int, name: str, verdict: str, detail: str) -> CheckpointError:
    """`checkpoint DIR/STEP <verdict>: <detail>` for the first leaf `name` that differs;
    one in the optimiser state (the weights having fitted) says so and names the run's
    config.optimizer.name instead: the model is not what differs."""
    if part_of(name) != "opt_state":
        return CheckpointError(f"checkpoint {manager.directory}/{step} {verdict}: {detail}")
    recorded = recorded_optimizer(str(manager.directory))
    named = f"config.optimizer.name={recorded!r}" if recorded else "config.optimizer.name"
    return OptimizerStateMismatch(
        f"checkpoint {manager.directory}/{step}: its optimiser state does not match this "
        f"run's optimiser ({named}): {detail}; its weights fit the model. Resume with the "
        "optimiser that wrote it (pass the same one again), or use another workdir")


def recorded_optimizer(directory: str) -> str | None:
    """config.optimizer.name in the config.json beside the checkpoint folder `directory`
    (the run's recipe), or None when there is none to read."""
    try:
        with open(os.path.join(os.path.dirname(directory), CONFIG_FILE)) as f:
            return json.load(f)["optimizer"]["name"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


# What Orbax and TensorStore raise for a checkpoint whose files are damaged or missing
# (truncated: ValueError from TensorStore's decoding; deleted: FileNotFoundError). Orbax
# raises a bare Exception for an array it cannot read, with TensorStore's error as its cause.
DAMAGE = (OSError, ValueError, KeyError)


def resume_from(step: int) -> str:
    return (f"--config.checkpoint.resume_step={step} resumes from the newest of them (the "
            "newer ones are moved aside, not deleted)")


def restore(manager, state, rng, step: int | None = None, choose=resume_from):
    """Restores checkpoint `step` (default: the newest) into `state`'s structure.

    Returns (state, rng, meta), or None when there is no checkpoint at all. A checkpoint
    of a different model (or whose optimiser state another optimiser wrote:
    OptimizerStateMismatch), or one that cannot be read, stops with CheckpointError before
    anything is restored: one that cannot be read names the older steps on disk and
    choose(the newest of them), how to take it instead; nothing is skipped or deleted.
    """
    steps = sorted(manager.all_steps())
    if not steps:
        return None
    step = steps[-1] if step is None else step
    restored = read_state(manager, step, state_tree(state, rng), choose)
    tree = restored["state"]
    state = state.replace(params=tree["params"], batch_stats=tree["batch_stats"],
                          opt_state=tree["opt_state"], step=tree["step"], ema=tree.get("ema"))
    return state, jax.random.wrap_key_data(tree["rng"]), restored["meta"]


def restore_weights(manager, state, step: int):
    """`state` (shapes: restore_target's) with checkpoint `step`'s weights: its params,
    BatchNorm statistics, step and, when it kept one, the weights' moving average.
    Returns (state, meta). Its optimiser state is neither compared nor read: inference
    needs none, and the checkpoint's may be any optimiser's (one passed from Python
    cannot be rebuilt to make a target for it). `manager`: create_manager's with
    weights_only. A checkpoint of another model, or one that cannot be read, stops with
    CheckpointError as restore's does."""
    target = {"params": state.params, "batch_stats": state.batch_stats, "step": state.step}
    if state.ema is not None:
        target["ema"] = state.ema
    restored = read_state(manager, step, target, weights_only=True)
    return state.replace(**restored["state"]), restored["meta"]


def read_state(manager, step: int, target: dict, choose=resume_from,
               weights_only: bool = False) -> dict:
    """Checkpoint `step`'s state (into `target`: all of it, or with `weights_only` the
    parts `target` holds) and meta, once check_compatible has passed; damage is a
    CheckpointError naming choose(the newest older step)."""
    quiet = QuietAbandonedReads()
    try:
        check_compatible(manager, step, target, weights_only)
        state = (ocp.args.PyTreeRestore(
            target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
            partial_restore=True) if weights_only else ocp.args.StandardRestore(target))
        restored = manager.restore(step, args=ocp.args.Composite(
            state=state, meta=ocp.args.JsonRestore()))
    except Exception as error:  # re-raised below unless it is damage (damage())
        cause = damage(error)
        if cause is None:
            raise
        older = older_choice(sorted(manager.all_steps()), step, choose)
        raise CheckpointError(f"checkpoint {manager.directory}/{step} cannot be read "
                              f"({type(cause).__name__}: {first_line(cause)}); nothing was "
                              f"deleted; {older}") from error
    quiet.remove()
    return restored


def older_choice(steps: list, step: int, choose=resume_from) -> str:
    """What to do about a damaged checkpoint `step`: choose(the newest of the older
    `steps`), naming them, or that there is none."""
    older = [s for s in steps if s < step]
    return (f"the older checkpoints on disk are steps {', '.join(map(str, older))}: "
            f"{choose(older[-1])}" if older else "no older checkpoint is on disk")


def damage(error: BaseException) -> BaseException | None:
    """The DAMAGE error `error` is, or (Orbax's bare Exception for an array it cannot
    read) has as its cause; None for any other error."""
    for candidate in (error, error.__cause__):
        if isinstance(candidate, DAMAGE):
            return candidate
    return None


class QuietAbandonedReads:
    """Orbax stops a restore at the first array it cannot read and closes its event loop
    while TensorStore still reads the others. As each of those ends it reports 'Event
    loop is closed' (sys.unraisablehook), and each read left unfinished reports its own
    failure when collected (the hook, or asyncio's log): tracebacks that say nothing the
    CheckpointError does not. While installed, those are dropped; any other report goes
    where it went before. A restore that fails leaves it installed (its reads end later)."""

    def __init__(self):
        self.previous = sys.unraisablehook
        sys.unraisablehook = self.unraisable
        logging.getLogger("asyncio").addFilter(self.keeps)

    def unraisable(self, report) -> None:
        error, code = report.exc_value, getattr(report.object, "cr_code", None)
        closed_loop = isinstance(error, RuntimeError) and str(error) == "Event loop is closed"
        if not (closed_loop or (code is not None and in_orbax(code.co_filename))):
            self.previous(report)

    def keeps(self, record) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return not ("exception was never retrieved" in record.getMessage()
                    and error is not None and (damage(error) is not None or
                                               raised_in_orbax(error)))

    def remove(self) -> None:
        sys.unraisablehook = self.previous
        logging.getLogger("asyncio").removeFilter(self.keeps)


def in_orbax(filename: str) -> bool:
    return f"{os.sep}orbax{os.sep}" in filename


def raised_in_orbax(error: BaseException) -> bool:
    frames = traceback.extract_tb(error.__traceback__)
    return bool(frames) and in_orbax(frames[-1].filename)


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else ""


SET_ASIDE_DIR = "checkpoints-set-aside"  # WORKDIR/checkpoints-set-aside/<step>


def set_aside_newer(workdir: str, step: int) -> list[int]:
    """checkpoint.resume_step=`step`: moves the checkpoints newer than it out of the
    run's checkpoint folder into WORKDIR/checkpoints-set-aside/ (nothing is deleted), so
    that the run resumes from `step` and its later saves cannot collide with them.
    Returns the steps moved; a step that is not on disk is a CheckpointError naming those
    that are."""
    directory = checkpoint_dir(workdir)
    steps = saved_steps(directory)
    if step not in steps:
        raise CheckpointError(f"config.checkpoint.resume_step={step}: no such checkpoint in "
                              f"{directory} (the steps on disk: "
                              f"{', '.join(map(str, steps)) or 'none'})")
    newer = [s for s in steps if s > step]
    aside = os.path.join(os.path.dirname(directory), SET_ASIDE_DIR)
    for moved in newer:
        os.makedirs(aside, exist_ok=True)
        target = os.path.join(aside, str(moved))
        if os.path.exists(target):
            raise CheckpointError(f"cannot set checkpoint {directory}/{moved} aside: "
                                  f"{target} exists (move or delete it)")
        os.rename(os.path.join(directory, str(moved)), target)
    return newer


LOCK_FILE = "run.lock"  # WORKDIR/run.lock: which process trains there now
HELD = {}  # the real path of a workdir -> (the lock file, the thread whose run holds it)


def hold_workdir(workdir: str) -> None:
    """Marks `workdir` as this process's run until let_go(workdir): a second run started
    in it meanwhile stops with one line (ConfigError) instead of writing over its
    checkpoints and rows. An OS lock (fcntl.lockf), so a run that was killed holds
    nothing; the file says which process holds it, for that line."""
    key = os.path.realpath(workdir)
    if key in HELD:  # the OS lock does not stop this process's own
        raise ConfigError(f"{workdir} is in use by another run of this process: wait for it "
                          "to end, or use another workdir")
    try:
        os.makedirs(workdir, exist_ok=True)
        lock = open(os.path.join(workdir, LOCK_FILE), "a+")
    except OSError as error:
        why = "a file is there, not a folder" if os.path.isfile(workdir) else error
        raise CheckpointError(f"cannot write in the workdir {workdir}: {why}") from None
    try:
        fcntl.lockf(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as error:
        if error.errno in (errno.EAGAIN, errno.EACCES):
            lock.seek(0)
            holder = lock.read().strip() or "another process"
            lock.close()
            raise ConfigError(f"{workdir} is in use by another run ({holder}): wait for it "
                              "to end, or use another --workdir") from None
        # else a filesystem without locks (ENOLCK): the run goes on unguarded
    else:
        lock.truncate(0)
        lock.write(f"process {os.getpid()} on {socket.gethostname()}, since "
                   f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        lock.flush()
    HELD[key] = (lock, threading.get_ident())


def let_go(workdir: str) -> None:
    """hold_workdir's lock released, if this thread's run holds it (a run refused there
    lets go of nothing)."""
    key = os.path.realpath(workdir)
    if HELD.get(key, (None, None))[1] == threading.get_ident():
        HELD.pop(key)[0].close()


def restore_input(manager, step: int, iterator) -> None:
    """Sets a Grain iterator to the state saved with checkpoint `step`."""
    import grain
    try:
        manager.restore(step, args=ocp.args.Composite(
            input=grain.checkpoint.CheckpointRestore(iterator)))
    except Exception as error:  # re-raised below unless it is damage (damage())
        cause = damage(error)
        if cause is None:
            raise
        raise CheckpointError(
            f"checkpoint {manager.directory}/{step}: its data iterator state cannot be "
            f"restored ({type(cause).__name__}: {first_line(cause)}); nothing was deleted; "
            f"{older_choice(sorted(manager.all_steps()), step)}") from error


def best_step(manager) -> int:
    """The step of the best checkpoint kept (a manager made with `best`)."""
    step = manager.best_step()
    if step is None:
        raise CheckpointError(f"no checkpoint with test metrics in {manager.directory}: the "
                              "best is chosen among the checkpoints saved at evaluations")
    return step


def read_meta(manager, step: int | None = None) -> dict:
    """The JSON half of the given (or the newest) checkpoint."""
    step = manager.latest_step() if step is None else step
    if step is None:
        raise CheckpointError(f"no checkpoint in {manager.directory}")
    try:
        return manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    except Exception as error:  # re-raised below unless it is damage (damage())
        cause = damage(error)
        if cause is None:
            raise
        raise CheckpointError(f"checkpoint {manager.directory}/{step} cannot be read "
                              f"({type(cause).__name__}: {first_line(cause)})") from error


def params_sha256(state) -> str:
    """SHA-256 over the bytes of every parameter and BatchNorm statistic, in a fixed order."""
    digest = hashlib.sha256()
    for tree in (state.params, state.batch_stats):
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
            digest.update(optim.param_path(path).encode())
            digest.update(np.ascontiguousarray(host_value(leaf)).tobytes())
    return digest.hexdigest()


def host_value(leaf) -> np.ndarray:
    """An array's whole value on this host; one split over several processes'
    devices (parallel.fsdp across machines) is gathered from all of them, so every
    process must call this for it together."""
    if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
        from jax.experimental import multihost_utils
        return np.asarray(multihost_utils.process_allgather(leaf, tiled=True))
    return np.asarray(jax.device_get(leaf))
