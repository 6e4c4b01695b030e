"""Training and evaluation: pure jitted functions, and the host loop that drives them.

The data path runs one way: host uint8 arrays are put on the device once; every
step gathers its batch from the device-resident arrays, augments and
normalises it inside the compiled program; a chunk of steps (an epoch, or
`train.log_every_steps` steps) is one `lax.scan`, so Python runs once per
chunk, not once per step (on the CPU, once per step: see `resolve_loop`).
Checkpoints are saved between chunks; see jaxtrain/checkpoint.py.
"""
import copy
import functools
import json
import math
import os
import signal
import threading
import time
from typing import Any, NamedTuple

import flax
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax.training import train_state

from jaxtrain import (augment, checkpoint, checks, data, defaults, input, models, optim, parallel,
                      report, user_model)
from jaxtrain.data import folder_stream
from jaxtrain.checks import PRECISIONS, check_config  # noqa: F401  (train.check_config)
from jaxtrain.errors import ConfigError, TrainingError

CONFIG_FILE = "config.json"


class Interrupted(TrainingError):
    """SIGTERM or SIGINT stopped the run: during training after a checkpoint was saved
    (step), or in another phase (while loading data, compiling, ...)."""

    def __init__(self, signum: int, step: int | None = None, directory: str | None = None,
                 phase: str | None = None):
        self.signum, self.step = signum, step
        name = signal.Signals(signum).name
        if step is not None:
            message = (f"interrupted by {name} at step {step}; checkpoint saved in "
                       f"{directory}/{step}. Run the same command again to resume")
        else:
            message = f"interrupted by {name} while {phase or 'starting'}"
        super().__init__(message)


# What the run is doing (for a signal's message), and whether a signal may end the
# process at once: true while nothing could be saved (see raise_on_signals).
PHASE = {"doing": "starting", "stop_at_once": True}


def enter_phase(doing: str, stop_at_once: bool = True) -> None:
    PHASE.update(doing=doing, stop_at_once=stop_at_once)


def raise_on_signals() -> None:
    """From now on SIGINT and SIGTERM stop the run with one line naming the phase.

    Python runs a signal handler only between bytecodes, so a handler alone would wait
    for a long XLA compile (or a stalled download) to return. The interpreter also
    writes each signal to a wakeup pipe the moment it arrives; a watcher thread reads
    it and, while nothing could be saved (loading, compiling), prints the line and exits
    at once (status 128 + N). Otherwise the handler raises Interrupted in the main
    thread, so `finally` blocks run; training itself stops between steps after a
    checkpoint (StopRequest)."""
    def handler(signum, frame):
        raise Interrupted(signum, phase=PHASE["doing"])
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handler)
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    threading.Thread(target=_stop_at_once_on_signals, args=(read_end,), daemon=True,
                     name="jaxtrain-signals").start()


def _stop_at_once_on_signals(read_end: int) -> None:
    while True:
        for signum in os.read(read_end, 64):
            if signum in (signal.SIGINT, signal.SIGTERM) and PHASE["stop_at_once"]:
                os.write(2, f"stopped: {Interrupted(signum, phase=PHASE['doing'])}\n".encode())
                os._exit(128 + signum)


class TrainState(train_state.TrainState):
    batch_stats: Any = None


# ---------------------------------------------------------------- pure, jitted parts

def normalize(images, mean, std):
    """uint8 images -> float32, per-channel (x / 255 - mean) / std."""
    x = images.astype(jnp.float32) / 255.0
    return (x - jnp.asarray(mean, jnp.float32)) / jnp.asarray(std, jnp.float32)


def create_train_state(key, model, tx, image_shape, sharding=None,
                       stem_kernel=None) -> TrainState:
    """Initial parameters and optimiser state, placed by `sharding` (e.g. replicated);
    `stem_kernel` replaces the initial stem weights (a whitened stem)."""
    def init(key):
        variables = model.init(key, jnp.zeros((1, *image_shape), jnp.float32), train=False)
        params = variables["params"]
        if stem_kernel is not None:
            params = models.with_stem_kernel(params, jnp.asarray(stem_kernel))
        return TrainState.create(apply_fn=model.apply, params=params, tx=tx,
                                 batch_stats=variables.get("batch_stats", {}))
    return jax.jit(init, out_shardings=sharding)(key)


def train_step(state, images, labels, key, mirror=None, *, mean, std, augment_kwargs,
               num_classes, label_smoothing, skip_nonfinite=False):
    """One SGD step on a uint8 batch: augment, normalise, forward, backward, update.

    `mirror`: the batch's alternating-flip bits (augment.alternate_flip), else None.
    With skip_nonfinite, a step whose loss is not finite leaves the state as it was.
    """
    augment_key, dropout_key = jax.random.split(key)
    images = augment.augment_batch(images, augment_key, mirror=mirror, **augment_kwargs)
    inputs = normalize(images, mean, std)
    targets = optax.smooth_labels(jax.nn.one_hot(labels, num_classes), label_smoothing)

    def loss_fn(params):
        logits, updates = state.apply_fn({"params": params, "batch_stats": state.batch_stats},
                                         inputs, train=True, mutable=["batch_stats"],
                                         rngs={"dropout": dropout_key})
        loss = optax.softmax_cross_entropy(logits, targets).mean()
        return loss, (logits, updates.get("batch_stats", state.batch_stats))

    (loss, (logits, batch_stats)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    new_state = state.apply_gradients(grads=grads, batch_stats=batch_stats)
    if skip_nonfinite:
        keep = jnp.isfinite(loss)
        skipped = state.replace(step=state.step + 1,
                                opt_state=advance_schedules(state.opt_state))
        new_state = jax.tree.map(lambda new, old: jnp.where(keep, new, old), new_state, skipped)
    accuracy = jnp.mean(jnp.argmax(logits, -1) == labels)
    return new_state, {"loss": loss, "accuracy": accuracy}


def advance_schedules(opt_state):
    """`opt_state` with every learning-rate schedule's step count one further: a skipped
    step keeps the optimiser's moments but uses up its slot of the schedule, so the
    rate stays that of state.step (the one train.py logs)."""
    if isinstance(opt_state, optax.ScaleByScheduleState):
        return opt_state._replace(count=optax.safe_increment(opt_state.count))
    if isinstance(opt_state, tuple) and hasattr(opt_state, "_fields"):  # other NamedTuples
        return type(opt_state)(*(advance_schedules(field) for field in opt_state))
    if isinstance(opt_state, (tuple, list)):
        return type(opt_state)(advance_schedules(item) for item in opt_state)
    if isinstance(opt_state, dict):
        return {key: advance_schedules(value) for key, value in opt_state.items()}
    return opt_state


def alternates_flip(augment_kwargs) -> bool:
    """Whether the `augment` block asks for alternating (per-epoch, per-image) flips."""
    return bool(augment_kwargs.get("flip") and augment_kwargs.get("alternate_flip"))


def epoch_order(key, epoch, num_examples: int, alternate_flip: bool = False):
    """(order, augment_key, flips) of an epoch, derived from (key, epoch) alone, so any
    step of any epoch can be rerun or resumed exactly. flips: which images to mirror
    (augment.alternating_flips) with alternate_flip, else None."""
    order_key, augment_key = input.epoch_keys(key, epoch)
    flips = augment.alternating_flips(key, epoch, num_examples) if alternate_flip else None
    return jax.random.permutation(order_key, num_examples), augment_key, flips


def train_step_at(state, step, x_train, y_train, order, augment_key, flips=None, *,
                  batch_size, batch_sharding=None, **step_kwargs):
    """Step `step` of an epoch: gathers its batch (and its flip bits) from the
    device-resident data.

    With `batch_sharding`, each device gathers only its slice of the batch from
    its replica of the data, and XLA partitions the step over the batch.
    """
    indices = jax.lax.dynamic_slice_in_dim(order, step * batch_size, batch_size)
    if batch_sharding is not None:
        indices = jax.lax.with_sharding_constraint(indices, batch_sharding)
    mirror = None if flips is None else flips[indices]
    return train_step(state, x_train[indices], y_train[indices],
                      jax.random.fold_in(augment_key, step), mirror, **step_kwargs)


def train_step_streamed(state, images, labels, indices, data_key, epoch, step, *,
                        num_examples: int, batch_size=None, batch_sharding=None, **step_kwargs):
    """Step `step` of `epoch` on a streamed batch (input.Stream): the key and the flip
    bits are those train_step_at derives, so both paths take the same step.
    `indices`: the batch's training-image indices."""
    del batch_size, batch_sharding  # the batch arrives whole and already laid out
    _, augment_key = input.epoch_keys(data_key, epoch)
    mirror = None
    if alternates_flip(step_kwargs["augment_kwargs"]):
        mirror = augment.alternating_flips(data_key, epoch, num_examples)[indices]
    return train_step(state, images, labels, jax.random.fold_in(augment_key, step), mirror,
                      **step_kwargs)


def summarize_chunk(steps, metrics):
    """Mean metrics over a chunk's finite steps, its first step with a non-finite loss
    (-1: none) and how many such steps it had."""
    finite = jnp.isfinite(metrics["loss"])
    summary = {name: jnp.sum(jnp.where(finite, values, 0.0)) / jnp.maximum(jnp.sum(finite), 1)
               for name, values in metrics.items()}
    summary["nonfinite_step"] = jnp.where(jnp.all(finite), -1, steps[jnp.argmin(finite)])
    summary["nonfinite_steps"] = jnp.sum(~finite)
    return summary


def train_epoch_chunk(state, x_train, y_train, data_key, epoch, first_step, *, num_steps,
                      **step_kwargs):
    """Steps first_step .. first_step + num_steps - 1 of `epoch`, as one lax.scan.

    The one epoch driver (training and the benchmark): the epoch's order, key and
    flips are derived here from (data_key, epoch), so a chunk that starts mid-epoch
    sees exactly the steps of the uninterrupted run.
    """
    order, augment_key, flips = epoch_order(
        data_key, epoch, x_train.shape[0], alternates_flip(step_kwargs["augment_kwargs"]))
    steps = first_step + jnp.arange(num_steps, dtype=jnp.int32)

    def body(state, step):
        return train_step_at(state, step, x_train, y_train, order, augment_key, flips,
                             **step_kwargs)

    state, metrics = jax.lax.scan(body, state, steps)
    return state, summarize_chunk(steps, metrics)


def predict_logits(state, images, *, mean, std, tta, pad_mode):
    """TTA-averaged logits for a uint8 batch, with BatchNorm in inference mode.

    All views go through the model as one batch: one forward of V x N images
    keeps the device busier than V forwards of N. The views are stacked per
    image (N, V, ...), so a batch split over devices stays split the same way.
    """
    views, weights = augment.tta_views(images, tta, pad_mode)
    variables = {"params": state.params, "batch_stats": state.batch_stats}
    if len(views) == 1:
        return state.apply_fn(variables, normalize(views[0], mean, std), train=False)
    n = images.shape[0]
    stacked = jnp.stack(views, axis=1).reshape(n * len(views), *images.shape[1:])
    logits = state.apply_fn(variables, normalize(stacked, mean, std), train=False)
    logits = logits.reshape(n, len(views), -1)
    return jnp.sum(logits * jnp.asarray(weights, logits.dtype)[:, None], axis=1)


def eval_logits(state, x_batches, valid_batches, *, mean, std, tta, pad_mode, tta_images=None):
    """Logits of padded test batches (B, batch, classes), BatchNorm in inference mode.

    tta_images=None: TTA on every image; k: plain logits, then TTA only on the k
    least confident valid images (max softmax probability; padding is never picked),
    gathered into whole batches, so most of the TTA cost goes where it can change
    an answer; 0: no TTA. k is static: the shapes of the TTA pass depend on it.
    """
    predict = functools.partial(predict_logits, state, mean=mean, std=std, pad_mode=pad_mode)
    if tta_images is None and tta != "none":
        return jax.lax.map(functools.partial(predict, tta=tta), x_batches)
    plain = jax.lax.map(functools.partial(predict, tta="none"), x_batches)
    if tta == "none" or not tta_images:
        return plain
    num_batches, batch = valid_batches.shape
    flat = plain.reshape(num_batches * batch, plain.shape[-1])
    confidence = jnp.max(jax.nn.softmax(flat, axis=-1), axis=-1)
    confidence = jnp.where(valid_batches.reshape(-1) > 0, confidence, jnp.inf)
    # Whole batches: the extra picks (the next least confident) are computed, not used.
    whole = -(-tta_images // batch) * batch
    _, picked = jax.lax.top_k(-confidence, whole)
    images = x_batches.reshape(num_batches * batch, *x_batches.shape[2:])[picked]
    tta_logits = jax.lax.map(functools.partial(predict, tta=tta),
                             images.reshape(whole // batch, batch, *x_batches.shape[2:]))
    tta_logits = tta_logits.reshape(whole, -1)[:tta_images]
    return flat.at[picked[:tta_images]].set(tta_logits).reshape(plain.shape)


def evaluate(state, x_batches, y_batches, valid_batches, **logits_kwargs):
    """Mean loss and accuracy over padded test batches (padding masked out);
    logits_kwargs: those of eval_logits."""
    logits = eval_logits(state, x_batches, valid_batches, **logits_kwargs)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, y_batches)
    correct = jnp.argmax(logits, -1) == y_batches
    count = jnp.sum(valid_batches)
    return {"loss": jnp.sum(jnp.sum(losses * valid_batches, axis=1)) / count,
            "accuracy": jnp.sum(jnp.sum(correct * valid_batches, axis=1)) / count}


# ---------------------------------------------------------------- host side

def batch_for_eval(images: np.ndarray, labels: np.ndarray, batch_size: int, multiple_of: int = 1):
    """Pads the test split to whole batches: (B, batch, ...) arrays and a validity mask.

    The batch is rounded up to a multiple of `multiple_of` (the device count) so
    that it splits evenly over the devices.
    """
    batch_size = -(-min(batch_size, len(images)) // multiple_of) * multiple_of
    num_batches = -(-len(images) // batch_size)
    pad = num_batches * batch_size - len(images)
    valid = np.concatenate([np.ones(len(images), np.float32), np.zeros(pad, np.float32)])
    images = np.concatenate([images, np.zeros((pad, *images.shape[1:]), images.dtype)])
    labels = np.concatenate([labels, np.zeros(pad, labels.dtype)])
    return (images.reshape(num_batches, batch_size, *images.shape[1:]),
            labels.reshape(num_batches, batch_size), valid.reshape(num_batches, batch_size))


def channel_stats(dataset: data.Dataset, config) -> tuple[tuple, tuple]:
    """data.mean/data.std from the config, or computed from the training split."""
    mean, std = tuple(config.data.mean), tuple(config.data.std)
    channels = dataset.image_shape[-1]
    if not mean or not std:
        # from each channel's histogram of byte values: exact, and ~10x faster than
        # numpy's mean and std over axes (0, 1, 2) of a uint8 array. A streamed
        # folder: from STATS_IMAGES images spread evenly over it.
        images = dataset.x_train
        if not isinstance(images, np.ndarray):
            images = images[np.linspace(0, len(images) - 1, min(len(images), STATS_IMAGES),
                                        dtype=np.int64)]
        pixels = images.reshape(-1, channels)
        values = np.arange(256, dtype=np.float64) / 255.0
        counts = [np.bincount(pixels[:, c], minlength=256) for c in range(channels)]
        means = [float(values @ n / n.sum()) for n in counts]
        stds = [float(np.sqrt(((values - m) ** 2) @ n / n.sum())) for m, n in zip(means, counts)]
        mean, std = mean or tuple(means), std or tuple(stds)
    for key, value in (("data.mean", mean), ("data.std", std)):
        if len(value) not in (1, channels):
            raise ConfigError(f"config.{key}={value!r}: needs 1 or {channels} values "
                              f"for {channels}-channel images")
    return mean, std


STATS_IMAGES = 2048  # a streamed folder's mean and std come from this many of its images


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


def resolve_loop(loop: str, convolutional: bool) -> str:
    """train.loop 'auto': one lax.scan per chunk, except for convolutional models on the CPU.

    XLA:CPU runs convolution weight gradients inside a while loop on a slow
    generic path (measured here: the weight gradient of one 3x3 conv, 64 to 64
    channels, batch 256 at 16x16, took 7.9 s per iteration inside lax.scan and
    0.35 s outside), so there each step is its own compiled call instead. Dense
    models scan on the CPU too (the MLP recipe: 3.6 s against 5.3 s for 1,404 steps).
    """
    if loop == "auto":
        return "python" if convolutional and jax.default_backend() == "cpu" else "scan"
    return loop


def epoch_order_fn(num_examples: int, step_kwargs: dict, out_sharding=None):
    """epoch_order for a training split of num_examples images and this run's
    augmentation, jitted (the Python loop calls it once per epoch)."""
    return jax.jit(functools.partial(epoch_order, num_examples=num_examples,
                                     alternate_flip=alternates_flip(step_kwargs["augment_kwargs"])),
                   out_shardings=out_sharding)


def compile_chunks(loop, state, x_train, y_train, data_key, lengths, step_kwargs,
                   out_sharding=None):
    """Ahead-of-time compiles the training steps; returns
    run_chunk(state, data_key, epoch, first_step, num_steps, should_stop) -> (state, summary).

    A scanned chunk is one train_epoch_chunk program, run to its end. The Python
    loop computes the epoch's order once per epoch and calls one compiled
    train_step_at per step; it can stop after any step when should_stop() says
    so. `out_sharding` places the new state and the metrics (replicated, for
    data parallelism).
    """
    if loop == "scan":
        chunk_fns = {}
        for length in sorted(lengths):
            fn = jax.jit(functools.partial(train_epoch_chunk, num_steps=length, **step_kwargs),
                         donate_argnums=0, out_shardings=out_sharding)
            chunk_fns[length] = fn.lower(state, x_train, y_train, data_key, np.int32(0),
                                         np.int32(0)).compile()

        def run_chunk(state, data_key, epoch, first_step, num_steps, should_stop=None):
            return chunk_fns[num_steps](state, x_train, y_train, data_key, np.int32(epoch),
                                        np.int32(first_step))
        return run_chunk

    order_fn = epoch_order_fn(x_train.shape[0], step_kwargs, out_sharding)
    order_fn = order_fn.lower(data_key, np.int32(0)).compile()
    step_fn = jax.jit(functools.partial(train_step_at, **step_kwargs), donate_argnums=0,
                      out_shardings=out_sharding)
    step_fn = step_fn.lower(state, np.int32(0), x_train, y_train,
                            *order_fn(data_key, np.int32(0))).compile()
    current = {}  # the last epoch's key, number and order: one order_fn call per epoch

    def run_chunk(state, data_key, epoch, first_step, num_steps, should_stop=None):
        if current.get("key") is not data_key or current.get("epoch") != epoch:
            current.update(key=data_key, epoch=epoch, order=order_fn(data_key, np.int32(epoch)))
        return step_by_step(
            lambda state, step: step_fn(state, np.int32(step), x_train, y_train,
                                        *current["order"]),
            state, first_step, num_steps, should_stop)
    return run_chunk


def step_by_step(take_step, state, first_step: int, num_steps: int, should_stop=None):
    """A chunk as one compiled call per step: take_step(state, step) -> (state, metrics)
    for each step (stopping after any step should_stop() asks to); (state, summary)."""
    metrics = []
    for step in range(first_step, first_step + num_steps):
        state, step_metrics = take_step(state, step)
        metrics.append(step_metrics)
        if should_stop is not None and should_stop():
            break
    stacked = jax.tree.map(lambda *values: jnp.stack(values), *metrics)
    steps = jnp.arange(first_step, first_step + len(metrics), dtype=jnp.int32)
    return state, summarize_chunk(steps, stacked)


def compile_stream_chunks(state, stream, data_key, num_examples: int, step_kwargs,
                          out_sharding=None):
    """compile_chunks for streamed data: one compiled train_step_streamed per step, fed by
    `stream` (input.Stream). Its batches are put on the devices ahead of time, and
    each step is dispatched without waiting for the one before, so reading the next
    batch overlaps the running step. Same run_chunk signature as compile_chunks."""
    step_fn = jax.jit(functools.partial(train_step_streamed, num_examples=num_examples,
                                        **step_kwargs),
                      donate_argnums=0, out_shardings=out_sharding)
    step_fn = step_fn.lower(state, *stream.batch_spec(), data_key, np.int32(0),
                            np.int32(0)).compile()

    def run_chunk(state, data_key, epoch, first_step, num_steps, should_stop=None):
        stream.seek(epoch * stream.source.steps_per_epoch + first_step)
        return step_by_step(
            lambda state, step: step_fn(state, *stream.next(), data_key, np.int32(epoch),
                                        np.int32(step)),
            state, first_step, num_steps, should_stop)
    return run_chunk


def timed(fn, *args):
    """Calls fn and waits for its results; returns (results on host, seconds)."""
    start = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    return out, time.perf_counter() - start


class Setup(NamedTuple):
    """Everything a run derives from its config before the first step."""
    mesh: Any
    dataset: data.Dataset
    placement: str  # 'device' or 'stream' (input.py)
    placement_reason: str
    model: Any
    stem_kernel: Any  # None, or the whitened stem's fixed weights (None with abstract_state)
    mean: tuple
    std: tuple
    schedule: Any
    state: TrainState
    data_key: Any
    steps_per_epoch: int
    total_steps: int


def check_batch_split(batch_size: int, mesh) -> None:
    """The global batch must split evenly over the devices; says which sizes would."""
    devices = mesh.size
    if batch_size % devices:
        lower, upper = batch_size // devices * devices, -(-batch_size // devices) * devices
        options = " or ".join(str(size) for size in (lower, upper) if size > 0)
        raise ConfigError(f"config.train.batch_size={batch_size} does not split evenly over "
                          f"{devices} devices: use a multiple of {devices} (e.g. {options})")


def whitening_fn(config, mean, std):
    """models.whitening_kernel for this run's stem, jitted: training and the benchmark
    (inside its timed program) compute the same filters from the training images."""
    return jax.jit(functools.partial(models.whitening_kernel, mean=tuple(mean), std=tuple(std),
                                     filters=config.model.stem_width))


def abstract_init(model, model_config, image_shape):
    """The model's variables as shapes (jax.eval_shape of its init); a model that cannot
    take the images is a ConfigError naming the key that sizes it."""
    try:
        return jax.eval_shape(functools.partial(
            model.init, x=jnp.zeros((1, *image_shape)), train=False), jax.random.key(0))
    except Exception as error:  # whatever Flax or XLA raise for impossible shapes
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        size = "x".join(map(str, image_shape))
        if model_config.name == "cifar_cnn":
            key, value = "model.widths", tuple(model_config.widths)
            what = (f"cifar_cnn halves the image once per block: {len(value)} blocks are too "
                    f"many for {size} images")
        else:
            key, value = "model.name", model_config.name
            what = f"the model cannot take {size} images"
        raise ConfigError(f"config.{key}={value!r}: {what} ({type(error).__name__}: "
                          f"{reason})") from None


def setup(config, mesh=None, abstract_state: bool = False, model=None) -> Setup:
    """Data, model, optimiser and the initial state (shared by training and evaluation).

    The state is replicated over `mesh` (default: all devices), the data-parallel layout.
    With abstract_state, the state holds only shapes and dtypes (jax.eval_shape): for
    callers that build the state inside their own program, it saves compiling the init.
    `model`: a Flax Linen or NNX module instance to train instead of model.name's.
    """
    check_config(config)
    mesh = parallel.create_mesh() if mesh is None else mesh
    dataset, placement, placement_reason = input.load(config.data)
    mean, std = channel_stats(dataset, config)
    batch_size = config.train.batch_size
    steps_per_epoch = len(dataset.x_train) // batch_size
    if steps_per_epoch == 0:
        raise ConfigError(f"config.train.batch_size={batch_size} is larger than the training "
                          f"split ({len(dataset.x_train)} images)")
    total_steps = (config.train.num_steps if config.train.num_steps > 0
                   else config.train.num_epochs * steps_per_epoch)
    if model is not None:
        model = user_model.from_instance(model)
    else:
        try:
            model = models.create_model(config.model, dataset.num_classes,
                                        PRECISIONS[config.train.precision])
        except ValueError as error:  # an unknown or unimportable model.name
            raise ConfigError(str(error)) from None
    abstract_params = abstract_init(model, config.model, dataset.image_shape)
    stem_kernel = None
    if models.has_whitened_stem(config.model):
        try:
            models.check_stem(config.model, dataset.image_shape[-1])
        except ValueError as error:
            raise ConfigError(str(error)) from None
        if not abstract_state:  # callers of an abstract state compute it in their program
            stem_kernel = whitening_fn(config, mean, std)(
                dataset.x_train[:models.WHITENING_IMAGES])
    schedule = optim.create_schedule(config.optimizer, total_steps)
    frozen = models.frozen_params(config.model)
    optim.check_groups(config.optimizer, abstract_params["params"], frozen)
    tx = optim.create_optimizer(config.optimizer, schedule, frozen)
    replicated = parallel.replicated(mesh)
    init_key, data_key = jax.jit(lambda: jax.random.split(jax.random.key(config.seed)),
                                 out_shardings=replicated)()
    init = functools.partial(create_train_state, model=model, tx=tx,
                             image_shape=dataset.image_shape, sharding=replicated,
                             stem_kernel=stem_kernel)
    state = jax.eval_shape(init, init_key) if abstract_state else init(init_key)
    return Setup(mesh, dataset, placement, placement_reason, model, stem_kernel, mean, std,
                 schedule, state, data_key, steps_per_epoch, total_steps)


def put_eval_data(config, run: Setup):
    """The test split as padded batches on the devices, each batch split over them."""
    arrays = batch_for_eval(run.dataset.x_test, run.dataset.y_test, config.eval.batch_size,
                            run.mesh.size)
    return tuple(parallel.put(a, parallel.batch_sharded(run.mesh, batch_axis=1)) for a in arrays)


def step_arguments(config, run: Setup) -> dict:
    """The static keyword arguments of train_step_at (and train_epoch_chunk) for this run."""
    return dict(batch_size=config.train.batch_size,
                batch_sharding=parallel.batch_sharded(run.mesh), mean=run.mean, std=run.std,
                augment_kwargs=augment.device_kwargs(config.augment),
                num_classes=run.dataset.num_classes,
                label_smoothing=config.train.label_smoothing,
                skip_nonfinite=config.train.nonfinite == "skip")


def tta_image_count(fraction: float, num_images: int):
    """eval.tta_fraction as evaluate's static tta_images: None = all, else
    ceil(fraction x num_images) (within float rounding: 0.3 x 10 is 3, not 4)."""
    count = min(max(math.ceil(fraction * num_images - 1e-9), 0), num_images)
    return None if count == num_images else count


def eval_arguments(config, run: Setup) -> dict:
    """The static keyword arguments of evaluate for this run (predict_logits takes
    all but tta_images)."""
    return dict(mean=run.mean, std=run.std, tta=config.eval.tta, pad_mode=config.augment.pad_mode,
                tta_images=tta_image_count(config.eval.tta_fraction, len(run.dataset.x_test)))


def put_train_data(run: Setup):
    """The training split, replicated on every device (see jaxtrain/parallel.py for why)."""
    replicated = parallel.replicated(run.mesh)
    return (parallel.put(run.dataset.x_train, replicated),
            parallel.put(run.dataset.y_train, replicated))


def compile_eval(config, run: Setup, state, eval_arrays):
    fn = jax.jit(functools.partial(evaluate, **eval_arguments(config, run)),
                 out_shardings=parallel.replicated(run.mesh))
    return fn.lower(state, *eval_arrays).compile()


def checkpoint_meta(run: Setup, config, state, train_seconds: float, eval_seconds: float):
    """The JSON half of a checkpoint: the data-order position and what inference needs."""
    step = int(state.step)
    return {"step": step, "epoch": step // run.steps_per_epoch,
            "step_in_epoch": step % run.steps_per_epoch, "seed": config.seed,
            "train_seconds": train_seconds, "eval_seconds": eval_seconds,
            "mean": list(run.mean), "std": list(run.std),
            "class_names": list(run.dataset.class_names),
            "image_shape": list(run.dataset.image_shape)}


def evaluates_after(step: int, steps_per_epoch: int, total_steps: int, every_epochs: int):
    """Evaluation schedule: after the last step and every `every_epochs` epochs."""
    epoch_done = step % steps_per_epoch == 0
    return step == total_steps or (epoch_done and every_epochs > 0
                                   and (step // steps_per_epoch) % every_epochs == 0)


def save_interval(config, steps_per_epoch: int) -> int:
    """checkpoint.every_steps, else checkpoint.every_epochs in steps; 0 = only at the end."""
    if config.checkpoint.every_steps > 0:
        return config.checkpoint.every_steps
    return max(config.checkpoint.every_epochs, 0) * steps_per_epoch


class StopRequest:
    """Turns SIGTERM/SIGINT into a request to stop after the current step."""

    def __init__(self):
        self.signal = None

    def __call__(self) -> bool:
        return self.signal is not None

    def __enter__(self):
        def handler(signum, frame):
            self.signal = signum
        self._previous = {}
        if threading.current_thread() is threading.main_thread():  # signals need the main thread
            self._previous = {sig: signal.signal(sig, handler)
                              for sig in (signal.SIGTERM, signal.SIGINT)}
        return self

    def __exit__(self, *exc):
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)


def train_and_evaluate(config, workdir: str, *, model=None,
                       start_time: float | None = None) -> dict:
    """Trains and evaluates the model the config describes; writes reports to workdir.

    Resumes from the newest checkpoint in workdir/checkpoints when there is one.
    Returns the summary (also written to workdir/summary.json). In a multi-process
    run every process calls this; process 0 alone prints and writes the reports.
    """
    start_time = time.time() if start_time is None else start_time
    enter_phase("checking the config; nothing written yet")
    check_config(config)
    if model is not None:
        config = copy.deepcopy(config)
        with config.unlocked():
            config.model.name = user_model.instance_name(model)
    check_resumable(workdir, config)
    mesh = parallel.create_mesh()
    check_batch_split(config.train.batch_size, mesh)
    enter_phase("loading the data and building the model; nothing written yet")
    run = setup(config, mesh, model=model)
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
    enter_phase(f"compiling; nothing trained in this run yet (checkpoints in "
                f"{manager.directory})")

    replicated = parallel.replicated(run.mesh)
    eval_arrays = put_eval_data(config, run)
    step_kwargs = step_arguments(config, run)
    every_save = save_interval(config, run.steps_per_epoch)
    plan = plan_chunks(run.total_steps, run.steps_per_epoch, config.train.log_every_steps,
                       every_save, start_step)

    compile_start = time.perf_counter()
    stream = None
    if streaming:
        stream = open_stream(config, run, data_key)
        if restored is not None and start_step < run.total_steps:
            resume_stream(stream, manager, meta, start_step)
        elif start_step < run.total_steps:
            stream.open(start_step)
        run_chunk = compile_stream_chunks(state, stream, data_key, len(run.dataset.x_train),
                                          step_kwargs, replicated)
    else:
        x_train, y_train = put_train_data(run)
        loop = resolve_loop(config.train.loop, models.is_convolutional(config.model.name))
        run_chunk = compile_chunks(loop, state, x_train, y_train, data_key,
                                   {length for _, _, length in plan}, step_kwargs, replicated)
    eval_fn = compile_eval(config, run, state, eval_arrays)
    compile_seconds = time.perf_counter() - compile_start
    if streaming and start_step < run.total_steps:
        stream.fill()  # the workers started while XLA compiled; their first batches now
    enter_phase("training", stop_at_once=False)  # StopRequest: a checkpoint, then stop

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
        with StopRequest() as stop:
            for epoch, first_step, length in plan:
                waited = stream.wait_seconds if streaming else 0.0
                (state, metrics), seconds = timed(run_chunk, state, data_key, epoch,
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
                    test_metrics, seconds = timed(eval_fn, state, *eval_arrays)
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
                    raise Interrupted(stop.signal or signal.SIGTERM, step, manager.directory)
            checkpoint.wait(manager)
            enter_phase(f"evaluating and writing the reports after the last step; its "
                        f"checkpoint is saved in {manager.directory}/{step}", stop_at_once=False)
            if stop():  # a signal while the last checkpoint was written
                raise Interrupted(stop.signal, step, manager.directory)
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


def open_stream(config, run: Setup, data_key) -> input.Stream:
    """The training split as an input.Stream for this run: Grain worker processes for
    a folder (data.workers, 0: one per core), threads for arrays already in memory."""
    images = run.dataset.x_train
    workers = 0
    if isinstance(images, folder_stream.FolderImages):
        workers = config.data.workers or folder_stream.folder._cpu_count()
        if config.augment.crop != "none":
            images = images.with_random_crop(config.seed, config.augment.crop_scale,
                                             config.augment.crop_ratio, config.augment.flip)
    return input.Stream(images, run.dataset.y_train, data_key,
                        batch_size=config.train.batch_size, steps_per_epoch=run.steps_per_epoch,
                        total_steps=run.total_steps, sharding=parallel.batch_sharded(run.mesh),
                        workers=workers)


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


def evaluate_checkpoint(config, workdir: str, checkpoint_path: str | None = None) -> dict:
    """--mode=eval: restores the newest checkpoint (or checkpoint_path: a step number of
    workdir's, or a step directory) and evaluates it. A missing checkpoint is reported
    before the data is loaded."""
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
        saved = sorted(int(n) for n in (os.listdir(directory) if os.path.isdir(directory) else ())
                       if n.isdigit())
        where = f"step {step} in {directory}" if step is not None else directory
        raise checkpoint.CheckpointError(
            f"no checkpoint at {where} (saved steps: "
            f"{', '.join(map(str, saved)) if saved else 'none'})")
    run = setup(config)
    manager = checkpoint.create_manager(directory, create=False)
    try:
        restored = checkpoint.restore(manager, run.state, run.data_key, step)
    finally:
        manager.close()
    if restored is None:
        raise checkpoint.CheckpointError(f"no checkpoint in {directory}")
    state = restored[0]
    eval_arrays = put_eval_data(config, run)
    metrics = jax.device_get(compile_eval(config, run, state, eval_arrays)(state, *eval_arrays))
    tta = config.eval.tta
    if tta != "none" and config.eval.tta_fraction < 1:
        tta += f" on the least confident {config.eval.tta_fraction:.0%} of images"
    result = {"step": int(state.step), "test_accuracy": float(metrics["accuracy"]),
              "test_loss": float(metrics["loss"]), "device_count": jax.device_count(),
              "tta": tta}
    if parallel.is_main_process():
        print(f"checkpoint step {result['step']}: test_accuracy={result['test_accuracy']:.2%}  "
              f"test_loss={result['test_loss']:.4f}  (TTA: {tta}; on {jax.device_count()} "
              f"device{'s' if jax.device_count() > 1 else ''})")
    return result


def run_config(workdir: str, overrides=None):
    """The config a workdir's run recorded (config.json) on top of the defaults, with
    `overrides` ({dotted key: value}) on top; None when the workdir has no config.json."""
    path = os.path.join(workdir, CONFIG_FILE)
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
        *blocks, name = key.split(".")
        node = config
        for block in blocks:
            node = node[block]
        with node.ignore_type():
            node[name] = value
    return config
