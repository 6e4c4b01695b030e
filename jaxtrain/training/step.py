"""One training step as a pure function: normalise, augment, forward, backward, update.

Also what a step needs around it: gradient accumulation over micro-batches, parameter
groups held constant once their training ends, and the data order of an epoch, which
derives from (seed, epoch) alone so that a resumed run takes the same steps."""
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxtrain.training import augment, batches, losses, optim, train_state


def _frozen(values) -> tuple:
    """A mapping as sorted (name, value) pairs: hashable, so a StepSpec is a static argument."""
    return tuple(sorted(dict(values or {}).items()))


@dataclasses.dataclass(frozen=True)
class StepSpec:
    """What a training step computes, read from the config once where a run starts
    (prepare.step_spec): a static argument of every compiled step, chunk and benchmark.
    `augment` and `mix` may be given as mappings; they are kept as sorted pairs."""
    mean: tuple  # per-channel normalisation of pixel values in [0, 1]
    std: tuple
    num_classes: int
    batch_size: int = 0  # train_step_at's gather (a streamed batch arrives whole)
    batch_sharding: Any = None  # how a gathered batch is split over the devices; None: not
    augment: tuple = ()  # augment.augment_batch's arguments (augment.device_kwargs)
    mix: tuple = ()  # augment.mix_batch's (augment.mix_kwargs); (): no MixUp or CutMix
    label_smoothing: float = 0.0
    skip_nonfinite: bool = False  # a step whose loss is not finite leaves the state as it was
    ema_decay: float | None = None  # train.ema_decay
    freeze_batch_stats: bool = False  # model.freeze_batch_stats
    accumulate_steps: int = 1
    constant_params: frozenset = frozenset()  # '/'-joined paths with no gradient computed
    loss: Any = losses.softmax_xent  # fn(logits, targets) -> per-example losses (losses.py)
    augment_fn: Any = None  # the user's fn(images, key) -> images (parts.py), or None

    def __post_init__(self):
        object.__setattr__(self, "augment", _frozen(self.augment))
        object.__setattr__(self, "mix", _frozen(self.mix))
        object.__setattr__(self, "mean", tuple(self.mean))
        object.__setattr__(self, "std", tuple(self.std))

    def replace(self, **changes) -> "StepSpec":
        return dataclasses.replace(self, **changes)


def normalize(images, mean, std):
    """uint8 images -> float32, per-channel (x / 255 - mean) / std."""
    return standardize(images.astype(jnp.float32) / 255.0, mean, std)


def standardize(x, mean, std):
    """float32 images in [0, 1] -> per-channel (x - mean) / std."""
    return (x - jnp.asarray(mean, jnp.float32)) / jnp.asarray(std, jnp.float32)


def train_step(state, images, labels, key, mirror=None, *, spec: StepSpec):
    """One SGD step on a uint8 batch: augment, normalise, forward, backward, update, as
    `spec` says.

    `mirror`: the batch's alternating-flip bits (augment.alternate_flip), else None.
    `spec.mix` (augment.mix_kwargs): MixUp/CutMix of the normalised batch and its
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
    `spec.augment_fn` (the user's): after the built-ins, on float32 images in [0, 1],
    keyed by fold_in(key, augment.USER_STREAM), so the other keys stay those of a run
    without it. `spec.loss`: per example; the step takes the mean.
    """
    augment_key, dropout_key = jax.random.split(key)
    images = augment.augment_batch(images, augment_key, mirror=mirror, **dict(spec.augment))
    if spec.augment_fn is None:
        inputs = normalize(images, spec.mean, spec.std)
    else:
        inputs = standardize(spec.augment_fn(images.astype(jnp.float32) / 255.0,
                                             jax.random.fold_in(key, augment.USER_STREAM)),
                             spec.mean, spec.std)
    targets = optax.smooth_labels(
        jax.nn.one_hot(labels, spec.num_classes),
        train_state.hyperparam(state, "label_smoothing", spec.label_smoothing))
    if spec.mix:
        inputs, targets = augment.mix_batch(
            inputs, targets, jax.random.fold_in(key, augment.MIX_STREAM), **dict(spec.mix))
    if spec.accumulate_steps == 1:
        loss, logits, batch_stats, grads = gradients(state, state.batch_stats, inputs, targets,
                                                     dropout_key, spec.constant_params,
                                                     spec.loss)
    else:
        loss, logits, batch_stats, grads = accumulated_gradients(
            state, inputs, targets, dropout_key, spec.accumulate_steps, spec.constant_params,
            spec.loss)
    if spec.freeze_batch_stats:
        batch_stats = state.batch_stats
    new_state = state.apply_gradients(grads=grads, batch_stats=batch_stats)
    decay = spec.ema_decay
    if decay is not None and state.ema is not None:
        new_state = new_state.replace(ema=jax.tree.map(
            lambda average, new: decay * average + (1.0 - decay) * new, state.ema,
            {"params": new_state.params, "batch_stats": new_state.batch_stats}))
    if spec.skip_nonfinite:
        keep = jnp.isfinite(loss)
        skipped = state.replace(step=state.step + 1,
                                opt_state=advance_schedules(state.opt_state))
        new_state = jax.tree.map(lambda new, old: jnp.where(keep, new, old), new_state, skipped)
    accuracy = jnp.mean(jnp.argmax(logits, -1) == labels)
    return new_state, {"loss": loss, "accuracy": accuracy}


def gradients(state, batch_stats, inputs, targets, dropout_key, constant_params=frozenset(),
              loss=losses.softmax_xent):
    """The batch's mean `loss` (per example, losses.py), its logits, the BatchNorm
    statistics after it and the loss's gradient with respect to state.params (zero for
    `constant_params`)."""
    def loss_fn(params):
        params = hold_constant(params, constant_params)
        logits, updates = state.apply_fn({"params": params, "batch_stats": batch_stats},
                                         inputs, train=True, mutable=["batch_stats"],
                                         rngs={"dropout": dropout_key})
        return loss(logits, targets).mean(), (logits, updates.get("batch_stats", batch_stats))

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
                          constant_params=frozenset(), loss=losses.softmax_xent):
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
        value, logits, batch_stats, grads = gradients(
            state, batch_stats, inputs, targets, jax.random.fold_in(dropout_key, i),
            constant_params, loss)
        return (jax.tree.map(jnp.add, grad_sum, grads), batch_stats, loss_sum + value), logits

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


def alternates_flip(spec: StepSpec) -> bool:
    """Whether the step's augmentation asks for alternating (per-epoch, per-image) flips."""
    augment_kwargs = dict(spec.augment)
    return bool(augment_kwargs.get("flip") and augment_kwargs.get("alternate_flip"))


def epoch_order(key, epoch, num_examples: int, alternate_flip: bool = False):
    """(order, augment_key, flips) of an epoch, derived from (key, epoch) alone, so any
    step of any epoch can be rerun or resumed exactly. flips: which images to mirror
    (augment.alternating_flips) with alternate_flip, else None."""
    order_key, augment_key = batches.epoch_keys(key, epoch)
    flips = augment.alternating_flips(key, epoch, num_examples) if alternate_flip else None
    return jax.random.permutation(order_key, num_examples), augment_key, flips


def train_step_at(state, step, x_train, y_train, order, augment_key, flips=None, *,
                  spec: StepSpec):
    """Step `step` of an epoch: gathers its batch of spec.batch_size (and its flip bits)
    from the device-resident data.

    With spec.batch_sharding, each device gathers only its slice of the batch from
    its replica of the data, and XLA partitions the step over the batch.
    """
    indices = jax.lax.dynamic_slice_in_dim(order, step * spec.batch_size, spec.batch_size)
    if spec.batch_sharding is not None:
        indices = jax.lax.with_sharding_constraint(indices, spec.batch_sharding)
    mirror = None if flips is None else flips[indices]
    return train_step(state, x_train[indices], y_train[indices],
                      jax.random.fold_in(augment_key, step), mirror, spec=spec)


def train_step_streamed(state, images, labels, indices, data_key, epoch, step, *,
                        num_examples: int, spec: StepSpec):
    """Step `step` of `epoch` on a streamed batch (batches.Stream; it arrives whole and
    already laid out): the key and the flip bits are those train_step_at derives, so both
    paths take the same step. `indices`: the batch's training-image indices."""
    _, augment_key = batches.epoch_keys(data_key, epoch)
    mirror = None
    if alternates_flip(spec):
        mirror = augment.alternating_flips(data_key, epoch, num_examples)[indices]
    return train_step(state, images, labels, jax.random.fold_in(augment_key, step), mirror,
                      spec=spec)
