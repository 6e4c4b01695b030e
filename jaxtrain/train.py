"""The pure, jitted parts of training and evaluation, and their compiled chunks.

The data path runs one way: host uint8 arrays are put on the device once; every
step gathers its batch from the device-resident arrays, augments and
normalises it inside the compiled program; a chunk of steps (an epoch, or up to
the next checkpoint or evaluation) is one `lax.scan`, so Python runs once per
chunk, not once per step (on the CPU with XLA's convolutions, once per step: see
`resolve_loop`).
Streamed batches (input.py) go through the same step. The host loop that
drives the chunks is jaxtrain/loop.py.
"""
import functools
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state

from jaxtrain import augment, input, models, optim


class TrainState(train_state.TrainState):
    batch_stats: Any = None
    ema: Any = None  # train.ema_decay: {"params", "batch_stats"} averaged over the steps


def ema_weights(state) -> "TrainState":
    """`state` with its exponential moving averages as its weights (to evaluate them)."""
    return state.replace(params=state.ema["params"], batch_stats=state.ema["batch_stats"])


def normalize(images, mean, std):
    """uint8 images -> float32, per-channel (x / 255 - mean) / std."""
    x = images.astype(jnp.float32) / 255.0
    return (x - jnp.asarray(mean, jnp.float32)) / jnp.asarray(std, jnp.float32)


def create_train_state(key, model, tx, image_shape, sharding=None, stem_kernel=None,
                       hyperparams=None, replicas: bool = False, ema: bool = False,
                       initial=None) -> TrainState:
    """Initial parameters and optimiser state, placed by `sharding` (e.g. replicated);
    `stem_kernel` replaces the initial stem weights (a whitened stem). With `replicas`,
    `key` has a leading axis and one state per key is made (jax.vmap); `hyperparams`
    ({name: (R,) values}) then set each one's swept optimiser values (replicas.py).
    `ema`: the state also holds a moving average of the weights, starting at them.
    `initial`: {'params/…' or 'batch_stats/…' path: array} replacing those leaves of the
    fresh init (model.init_from's weights, jaxtrain/weights.py) before the optimiser
    state is made from them; every replica starts from the same ones."""
    def init(key, hyperparams, initial):
        variables = model.init(key, jnp.zeros((1, *image_shape), jnp.float32), train=False)
        if initial:
            variables = {collection: jax.tree_util.tree_map_with_path(
                lambda path, leaf, c=collection: initial.get(f"{c}/{optim.param_path(path)}",
                                                             leaf), tree)
                for collection, tree in variables.items()}
        params = variables["params"]
        if stem_kernel is not None:
            params = models.with_stem_kernel(params, jnp.asarray(stem_kernel))
        state = TrainState.create(apply_fn=model.apply, params=params, tx=tx,
                                  batch_stats=variables.get("batch_stats", {}))
        if hyperparams:
            injected = dict(state.opt_state.hyperparams, **hyperparams)
            state = state.replace(opt_state=state.opt_state._replace(hyperparams=injected))
        if ema:
            state = state.replace(ema=jax.tree.map(jnp.copy, {
                "params": state.params, "batch_stats": state.batch_stats}))
        return state
    initial = {path: jnp.asarray(value) for path, value in (initial or {}).items()}
    init_fn = jax.vmap(init, in_axes=(0, 0, None)) if replicas else init
    return jax.jit(init_fn, out_shardings=sharding)(key, hyperparams, initial)


def current_step(state) -> int:
    """The state's step (every replica of a replicated state is at the same one)."""
    step = state.step
    if isinstance(step, jax.Array):
        step = step.addressable_data(0)
    return int(np.asarray(step).flat[0])


def hyperparam(state, name: str, default):
    """A swept value of this (replica's) state (replicas.py injects them into the
    optimiser state), else `default`, the config's."""
    values = getattr(state.opt_state, "hyperparams", None)
    return values[name] if isinstance(values, dict) and name in values else default


def train_step(state, images, labels, key, mirror=None, *, mean, std, augment_kwargs,
               num_classes, label_smoothing, skip_nonfinite=False, ema_decay=None,
               mix_kwargs=None, freeze_batch_stats=False, accumulate_steps=1,
               constant_params=frozenset()):
    """One SGD step on a uint8 batch: augment, normalise, forward, backward, update.

    `mirror`: the batch's alternating-flip bits (augment.alternate_flip), else None.
    `mix_kwargs` (augment.mix_kwargs): MixUp/CutMix of the normalised batch and its
    smoothed targets, keyed by fold_in(key, augment.MIX_STREAM), so the augmentation and
    dropout keys stay those of a run that does not mix. Accuracy counts the true labels.
    With skip_nonfinite, a step whose loss is not finite leaves the state as it was.
    With ema_decay (and a state holding an EMA), the average moves toward the new
    weights and BatchNorm statistics: ema = decay * ema + (1 - decay) * new.
    With freeze_batch_stats (model.freeze_batch_stats), the BatchNorm statistics stay as
    they are (the built-in models also normalise with them; your own may not).
    With accumulate_steps K > 1, the (augmented, mixed) batch is cut into K micro-batches
    that go through the model one after another (accumulated_gradients), and one
    optimiser update applies their mean gradient.
    `constant_params`: '/'-joined paths of parameters whose gradient is not computed
    (hold_constant); the optimiser still steps them, with a zero gradient.
    """
    augment_key, dropout_key = jax.random.split(key)
    images = augment.augment_batch(images, augment_key, mirror=mirror, **augment_kwargs)
    inputs = normalize(images, mean, std)
    targets = optax.smooth_labels(jax.nn.one_hot(labels, num_classes),
                                  hyperparam(state, "label_smoothing", label_smoothing))
    if mix_kwargs:
        inputs, targets = augment.mix_batch(
            inputs, targets, jax.random.fold_in(key, augment.MIX_STREAM), **mix_kwargs)
    if accumulate_steps == 1:
        loss, logits, batch_stats, grads = gradients(state, state.batch_stats, inputs, targets,
                                                     dropout_key, constant_params)
    else:
        loss, logits, batch_stats, grads = accumulated_gradients(
            state, inputs, targets, dropout_key, accumulate_steps, constant_params)
    if freeze_batch_stats:
        batch_stats = state.batch_stats
    new_state = state.apply_gradients(grads=grads, batch_stats=batch_stats)
    if ema_decay is not None and state.ema is not None:
        new_state = new_state.replace(ema=jax.tree.map(
            lambda average, new: ema_decay * average + (1.0 - ema_decay) * new, state.ema,
            {"params": new_state.params, "batch_stats": new_state.batch_stats}))
    if skip_nonfinite:
        keep = jnp.isfinite(loss)
        skipped = state.replace(step=state.step + 1,
                                opt_state=advance_schedules(state.opt_state))
        new_state = jax.tree.map(lambda new, old: jnp.where(keep, new, old), new_state, skipped)
    accuracy = jnp.mean(jnp.argmax(logits, -1) == labels)
    return new_state, {"loss": loss, "accuracy": accuracy}


def gradients(state, batch_stats, inputs, targets, dropout_key, constant_params=frozenset()):
    """Mean cross-entropy of a batch, its logits, the BatchNorm statistics after it and
    the loss's gradient with respect to state.params (zero for `constant_params`)."""
    def loss_fn(params):
        params = hold_constant(params, constant_params)
        logits, updates = state.apply_fn({"params": params, "batch_stats": batch_stats},
                                         inputs, train=True, mutable=["batch_stats"],
                                         rngs={"dropout": dropout_key})
        loss = optax.softmax_cross_entropy(logits, targets).mean()
        return loss, (logits, updates.get("batch_stats", batch_stats))

    (loss, (logits, batch_stats)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
        state.params)
    return loss, logits, batch_stats, grads


def hold_constant(params, paths=frozenset()):
    """`params` with those at `paths` ('/'-joined) cut out of the gradient
    (jax.lax.stop_gradient): their gradient is zero, and the backward work that only
    it needed (for the speedrun's stem bias: the stem's activation gradient and the
    first block's input gradient) is dead code that XLA drops from the program."""
    if not paths:
        return params
    return jax.tree_util.tree_map_with_path(
        lambda path, p: jax.lax.stop_gradient(p) if optim.param_path(path) in paths else p,
        params)


def finished_groups(opt, params, total_steps: int, frozen: tuple = ()) -> dict:
    """{step: the '/'-joined paths of the parameters whose optimizer group stops training
    there} for every group with 0 < train_steps < total_steps (train.drop_finished_groups).

    optim.group_schedule gives such a group a rate of 0 from its train_steps on, so
    holding its parameters constant from there (hold_constant) leaves them where the
    run that keeps computing their gradient leaves them; only the group's optimiser
    state (a momentum trace the zero rate never applies) differs. `params` may be
    abstract: only the paths are read."""
    if "groups" not in opt or not opt.groups:
        return {}
    labels = optim.param_labels(opt, params, frozen)
    paths = [(optim.param_path(path), label) for (path, _), label in zip(
        jax.tree_util.tree_leaves_with_path(params), jax.tree_util.tree_leaves(labels))]
    cuts = {}
    for name in opt.groups.keys():
        settings = optim.group_settings(opt, name)
        if settings.freeze or not 0 < settings.train_steps < total_steps:
            continue
        group = frozenset(path for path, label in paths if label == name)
        cuts[settings.train_steps] = cuts.get(settings.train_steps, frozenset()) | group
    return dict(sorted(cuts.items()))


def constant_at(cuts: dict, step: int) -> frozenset:
    """The parameters held constant at global `step`: those of every cut at or before it."""
    return frozenset().union(*(paths for cut, paths in cuts.items() if cut <= step))


def micro_batches(x, k: int):
    """(B, ...) -> (k, B / k, ...): micro-batch i holds rows i, i + k, i + 2k, ... Each
    device's slice of a batch split over devices holds B / devices consecutive rows
    (a multiple of k), so every micro-batch takes an equal share from every device:
    the cut moves no data between devices and each micro-batch stays split over all."""
    return jnp.swapaxes(x.reshape(x.shape[0] // k, k, *x.shape[1:]), 0, 1)


def accumulated_gradients(state, inputs, targets, dropout_key, k: int,
                          constant_params=frozenset()):
    """gradients() of k micro-batches, one after another in a lax.scan (so only one
    micro-batch's activations are alive at a time), averaged: the mean loss and gradient
    of the whole batch, up to float rounding. (Unrolled, XLA would be free to run the
    micro-batches' forward passes side by side, and on the CPU it does: the memory
    saving goes. The price of the scan on the CPU: XLA:CPU runs convolutions inside a
    loop several times slower, as train.loop='auto' notes.) BatchNorm normalises each micro-batch by
    its own statistics and its running averages move k times; micro-batch i's dropout
    key is fold_in(dropout_key, i)."""
    def body(carry, batch):
        grad_sum, batch_stats, loss_sum = carry
        inputs, targets, i = batch
        loss, logits, batch_stats, grads = gradients(
            state, batch_stats, inputs, targets, jax.random.fold_in(dropout_key, i),
            constant_params)
        return (jax.tree.map(jnp.add, grad_sum, grads), batch_stats, loss_sum + loss), logits

    zeros = jax.tree.map(jnp.zeros_like, state.params)
    (grad_sum, batch_stats, loss_sum), logits = jax.lax.scan(
        body, (zeros, state.batch_stats, jnp.zeros((), jnp.float32)),
        (micro_batches(inputs, k), micro_batches(targets, k), jnp.arange(k)))
    logits = jnp.swapaxes(logits, 0, 1).reshape(inputs.shape[0], -1)  # rows back in order
    return loss_sum / k, logits, batch_stats, jax.tree.map(lambda g: g / k, grad_sum)


def advance_schedules(opt_state):
    """`opt_state` with every learning-rate schedule's step count one further: a skipped
    step keeps the optimiser's moments but uses up its slot of the schedule, so the
    rate stays that of state.step (the one loop.py logs)."""
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
    (-1: none), how many such steps it had, and every step's metrics ("per_step"): the
    loop's metrics rows come from these, so logging often costs no extra chunk."""
    finite = jnp.isfinite(metrics["loss"])
    summary = {name: jnp.sum(jnp.where(finite, values, 0.0)) / jnp.maximum(jnp.sum(finite), 1)
               for name, values in metrics.items()}
    summary["nonfinite_step"] = jnp.where(jnp.all(finite), -1, steps[jnp.argmin(finite)])
    summary["nonfinite_steps"] = jnp.sum(~finite)
    summary["per_step"] = metrics
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
    (compile_evaluation runs the same parts one batch per call.)
    """
    predict = functools.partial(predict_logits, state, mean=mean, std=std, pad_mode=pad_mode)
    if tta_images is None and tta != "none":
        return jax.lax.map(functools.partial(predict, tta=tta), x_batches)
    plain = jax.lax.map(functools.partial(predict, tta="none"), x_batches)
    if tta == "none" or not tta_images:
        return plain
    picked = least_confident(plain, valid_batches, tta_images)
    tta_logits = jax.lax.map(functools.partial(predict, tta=tta), gather_batches(x_batches, picked))
    return with_tta_logits(plain, picked, tta_logits, tta_images)


def least_confident(plain, valid_batches, tta_images: int):
    """The flat indices of the tta_images least confident valid images of `plain`
    (B, batch, classes), and after them the next least confident up to whole batches
    (computed, not used): padding is never picked."""
    num_batches, batch = valid_batches.shape
    flat = plain.reshape(num_batches * batch, plain.shape[-1])
    confidence = jnp.max(jax.nn.softmax(flat, axis=-1), axis=-1)
    confidence = jnp.where(valid_batches.reshape(-1) > 0, confidence, jnp.inf)
    whole = -(-tta_images // batch) * batch
    return jax.lax.top_k(-confidence, whole)[1]


def gather_batches(x_batches, picked):
    """The images at flat indices `picked` of (B, batch, ...) batches, as whole batches."""
    batch = x_batches.shape[1]
    images = x_batches.reshape(-1, *x_batches.shape[2:])[picked]
    return images.reshape(picked.shape[0] // batch, batch, *x_batches.shape[2:])


def with_tta_logits(plain, picked, tta_logits, tta_images: int):
    """`plain` with the TTA logits of its first tta_images picked images in their place."""
    flat = plain.reshape(-1, plain.shape[-1])
    tta_logits = tta_logits.reshape(-1, plain.shape[-1])[:tta_images]
    return flat.at[picked[:tta_images]].set(tta_logits).reshape(plain.shape)


def logits_metrics(logits, y_batches, valid_batches):
    """Mean loss and accuracy of padded batches' logits (padding masked out)."""
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, y_batches)
    correct = jnp.argmax(logits, -1) == y_batches
    count = jnp.sum(valid_batches)
    return {"loss": jnp.sum(jnp.sum(losses * valid_batches, axis=1)) / count,
            "accuracy": jnp.sum(jnp.sum(correct * valid_batches, axis=1)) / count}


def evaluate(state, x_batches, y_batches, valid_batches, **logits_kwargs):
    """Mean loss and accuracy over padded test batches (padding masked out), as one
    program; logits_kwargs: those of eval_logits."""
    logits = eval_logits(state, x_batches, valid_batches, **logits_kwargs)
    return logits_metrics(logits, y_batches, valid_batches)


class EvaluationStopped(Exception):
    """should_stop() said so between two batches of an evaluation."""


def compile_evaluation(state, x_batches, y_batches, valid_batches, *, mean, std, tta,
                       pad_mode, tta_images=None, replicas: bool = False, out_sharding=None):
    """evaluate() as a host loop over the test batches, one compiled call per batch, so
    that it can stop between any two (a signal) and show how far it is: returns
    evaluate_batches(state, x_batches, y_batches, valid_batches, should_stop=None,
    progress=None) -> metrics. It computes what evaluate() does, part by part: each
    batch's logits (with TTA, or plain and then TTA on the least confident images), then
    the metrics of them all. should_stop() is asked after every batch and raises
    EvaluationStopped; progress(n) is told each batch done. With `replicas`, the state
    has a leading replica axis and every program maps over it (one replica's activations
    at a time: vmapped convolutions become grouped ones, far slower on XLA:CPU)."""
    predict = functools.partial(predict_logits, mean=mean, std=std, pad_mode=pad_mode)
    partial_tta = tta != "none" and tta_images is not None and tta_images > 0
    first_tta = "none" if (tta == "none" or tta_images is not None) else tta

    def over_replicas(fn, replica_args):
        """fn(state, *args) for every replica: args flagged True carry a replica axis."""
        if not replicas:
            return fn
        def mapped(state, *args):
            shared = {i: a for i, (a, r) in enumerate(zip(args, replica_args)) if not r}
            own = tuple(a for a, r in zip(args, replica_args) if r)

            def one(item):
                s, rest = item[0], list(item[1:])
                full = [shared[i] if i in shared else rest.pop(0) for i in range(len(args))]
                return fn(s, *full)
            return jax.lax.map(one, (state, *own))
        return mapped

    def compiled(fn, *args):
        """(fn compiled for args, the shapes it returns)."""
        lowered = jax.jit(fn, out_shardings=out_sharding).lower(*args)
        return lowered.compile(), lowered.out_info

    batch_fn, plain_shape = compiled(
        over_replicas(functools.partial(predict, tta=first_tta), (False,)), state, x_batches[0])
    axis = 1 if replicas else 0  # where the batches stack
    stack = lambda parts: jnp.stack(parts, axis=axis)
    plain_spec = jax.ShapeDtypeStruct(  # every batch's, stacked
        plain_shape.shape[:axis] + (x_batches.shape[0],) + plain_shape.shape[axis:],
        plain_shape.dtype, sharding=out_sharding)
    metrics_fn, _ = compiled(
        jax.vmap(logits_metrics, in_axes=(0, None, None)) if replicas else logits_metrics,
        plain_spec, y_batches, valid_batches)
    if partial_tta:
        pick = functools.partial(least_confident, tta_images=tta_images)
        pick_fn, picked_spec = compiled(jax.vmap(pick, in_axes=(0, None)) if replicas
                                        else pick, plain_spec, valid_batches)
        gather_fn, images = compiled(jax.vmap(gather_batches, in_axes=(None, 0)) if replicas
                                     else gather_batches, x_batches, picked_spec)
        one_image_batch = jax.ShapeDtypeStruct(images.shape[:axis] + images.shape[axis + 1:],
                                               images.dtype, sharding=out_sharding)
        tta_fn, tta_shape = compiled(
            over_replicas(functools.partial(predict, tta=tta), (True,)), state, one_image_batch)
        tta_spec = jax.ShapeDtypeStruct(
            tta_shape.shape[:axis] + (images.shape[axis],) + tta_shape.shape[axis:],
            tta_shape.dtype, sharding=out_sharding)
        merge = functools.partial(with_tta_logits, tta_images=tta_images)
        merge_fn, _ = compiled(jax.vmap(merge) if replicas else merge, plain_spec,
                               picked_spec, tta_spec)

    def evaluate_batches(state, x_batches, y_batches, valid_batches, should_stop=None,
                         progress=None):
        def done_one():
            if progress is not None:
                progress(1)
            if should_stop is not None and should_stop():
                raise EvaluationStopped()
        parts = []
        for i in range(x_batches.shape[0]):
            parts.append(batch_fn(state, x_batches[i]))
            done_one()
        logits = stack(parts)
        if partial_tta:
            picked = pick_fn(logits, valid_batches)
            images = gather_fn(x_batches, picked)
            parts = []
            for j in range(images.shape[axis]):
                parts.append(tta_fn(state, images[:, j] if replicas else images[j]))
                done_one()
            logits = merge_fn(logits, picked, stack(parts))
        return metrics_fn(logits, y_batches, valid_batches)
    evaluate_batches.batches = x_batches.shape[0] + (  # the calls progress() counts
        images.shape[axis] if partial_tta else 0)
    return evaluate_batches


def resolve_loop(loop: str, xla_convolutions: bool) -> str:
    """train.loop 'auto': one lax.scan per chunk, except on the CPU for models whose
    convolutions are XLA's own (models.xla_convolutions).

    XLA:CPU runs convolution weight gradients inside a while loop on a slow
    generic path (measured here: the weight gradient of one 3x3 conv, 64 to 64
    channels, batch 256 at 16x16, took 7.9 s per iteration inside lax.scan and
    0.35 s outside), so there each step is its own compiled call instead. Dense
    models scan on the CPU too (the MLP recipe: 3.6 s against 5.3 s for 1,404 steps),
    and so do convolutional ones through oneDNN (model.conv_impl; 300 steps of
    configs/fashion_mnist_cnn.py: 10.4 s scanned against 19.0 s step by step).
    """
    if loop == "auto":
        return "python" if xla_convolutions and jax.default_backend() == "cpu" else "scan"
    return loop


def epoch_order_fn(num_examples: int, step_kwargs: dict, out_sharding=None,
                   replicas: bool = False):
    """epoch_order for a training split of num_examples images and this run's
    augmentation, jitted (the Python loop calls it once per epoch); with `replicas`,
    one order per key of a leading axis of keys."""
    order = functools.partial(epoch_order, num_examples=num_examples,
                              alternate_flip=alternates_flip(step_kwargs["augment_kwargs"]))
    return jax.jit(jax.vmap(order, in_axes=(0, None)) if replicas else order,
                   out_shardings=out_sharding)


def compile_chunks(loop, state, x_train, y_train, data_key, lengths, step_kwargs,
                   out_sharding=None, replicas: bool = False):
    """Ahead-of-time compiles the training steps; returns
    run_chunk(state, data_key, epoch, first_step, num_steps, should_stop) -> (state, summary).

    A scanned chunk is one train_epoch_chunk program, run to its end. The Python
    loop computes the epoch's order once per epoch and calls one compiled
    train_step_at per step; it can stop after any step when should_stop(metrics) says
    so. `out_sharding` places the new state and the metrics (replicated, for
    data parallelism), or is a pair (the state's, the metrics'). With `replicas`,
    the state and data_key carry a leading axis of independent runs, trained
    together by jax.vmap inside each program (each its own order and augmentation
    from its key; the data is shared), and every summary array gains that axis too.
    """
    batched = (lambda fn, axes: jax.vmap(fn, in_axes=axes)) if replicas else (lambda fn, _: fn)
    if loop == "scan":
        chunk_fns = {}
        for length in sorted(lengths):
            chunk = functools.partial(train_epoch_chunk, num_steps=length, **step_kwargs)
            fn = jax.jit(batched(chunk, (0, None, None, 0, None, None)),
                         donate_argnums=0, out_shardings=out_sharding)
            chunk_fns[length] = fn.lower(state, x_train, y_train, data_key, np.int32(0),
                                         np.int32(0)).compile()

        def run_chunk(state, data_key, epoch, first_step, num_steps, should_stop=None):
            return chunk_fns[num_steps](state, x_train, y_train, data_key, np.int32(epoch),
                                        np.int32(first_step))
        run_chunk.programs = list(chunk_fns.values())  # for memory.py's analysis
        return run_chunk

    # the epoch's order: laid out as the metrics are (replicated), or for replicas as
    # their state's leading axis
    order_sharding = out_sharding[int(not replicas)] if isinstance(out_sharding, tuple) \
        else out_sharding
    order_fn = epoch_order_fn(x_train.shape[0], step_kwargs, order_sharding, replicas)
    order_fn = order_fn.lower(data_key, np.int32(0)).compile()
    first_order = order_fn(data_key, np.int32(0))
    order_axes = (0, 0, None if first_order[2] is None else 0)  # (order, augment key, flips)
    step_fn = jax.jit(batched(functools.partial(train_step_at, **step_kwargs),
                              (0, None, None, None, *order_axes)),
                      donate_argnums=0, out_shardings=out_sharding)
    step_fn = step_fn.lower(state, np.int32(0), x_train, y_train, *first_order).compile()
    current = {}  # the last epoch's key, number and order: one order_fn call per epoch

    def run_chunk(state, data_key, epoch, first_step, num_steps, should_stop=None):
        if current.get("key") is not data_key or current.get("epoch") != epoch:
            current.update(key=data_key, epoch=epoch, order=order_fn(data_key, np.int32(epoch)))
        return step_by_step(
            lambda state, step: step_fn(state, np.int32(step), x_train, y_train,
                                        *current["order"]),
            state, first_step, num_steps, should_stop, replicas)
    run_chunk.programs = [step_fn]  # for memory.py's analysis
    return run_chunk


def step_by_step(take_step, state, first_step: int, num_steps: int, should_stop=None,
                 replicas: bool = False):
    """A chunk as one compiled call per step: take_step(state, step) -> (state, metrics)
    for each step (stopping after any step should_stop(its metrics) asks to; they may
    still be computing: dispatch runs ahead); (state, summary), a summary per replica
    (leading axis) with `replicas`."""
    metrics = []
    for step in range(first_step, first_step + num_steps):
        state, step_metrics = take_step(state, step)
        metrics.append(step_metrics)
        if should_stop is not None and should_stop(step_metrics):
            break
    stacked = jax.tree.map(lambda *values: jnp.stack(values), *metrics)
    steps = jnp.arange(first_step, first_step + len(metrics), dtype=jnp.int32)
    if replicas:  # stacked: (steps, replicas)
        return state, jax.vmap(summarize_chunk, in_axes=(None, 1))(steps, stacked)
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
    run_chunk.programs = [step_fn]  # for memory.py's analysis
    return run_chunk


def phased_chunks(plan, steps_per_epoch: int, cuts: dict, compile_phase):
    """One run_chunk for a plan cut at `cuts` (finished_groups): the chunks of each phase
    (the same parameters held constant, constant_at) compiled by compile_phase(those
    paths, {the phase's chunk lengths}) -> run_chunk, and each chunk run by its phase's.
    Only phases the plan reaches are compiled (a run resumed after a cut compiles the
    programs after it alone); with one phase, its run_chunk itself."""
    def phase(epoch, first_step, num_steps=1):
        step = epoch * steps_per_epoch + first_step
        constant = constant_at(cuts, step)
        if constant != constant_at(cuts, step + num_steps - 1):
            raise ValueError(f"the chunk of steps {step + 1}-{step + num_steps} crosses a cut "
                             f"of {sorted(cuts)}: plan_chunks' breaks must include the cuts")
        return constant

    lengths = {}
    for epoch, first_step, length in plan:
        lengths.setdefault(phase(epoch, first_step, length), set()).add(length)
    phases = {constant: compile_phase(constant, chunk_lengths)
              for constant, chunk_lengths in lengths.items()}
    if len(phases) == 1:
        return next(iter(phases.values()))

    def run_chunk(state, data_key, epoch, first_step, num_steps, should_stop=None):
        return phases[phase(epoch, first_step, num_steps)](state, data_key, epoch, first_step,
                                                           num_steps, should_stop)
    run_chunk.programs = [program for one in phases.values() for program in one.programs]
    return run_chunk


def timed(fn, *args):
    """Calls fn and waits for its results; returns (results on host, seconds)."""
    start = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    return out, time.perf_counter() - start

