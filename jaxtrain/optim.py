"""The `optimizer` config block -> an optax learning-rate schedule and transformation.

One optimiser for every parameter, or parameter groups (optimizer.groups): each
group names its parameters by a regular expression on their '/'-joined path and
gets its own optimiser, learning-rate multiplier and weight decay, combined with
optax.partition. The record CIFAR-10 recipes need this: Muon for the conv
filters, Nesterov SGD at very different rates for the biases and the head.
"""
import math
import re

import jax
import jax.numpy as jnp
import ml_collections
import optax
from optax.contrib import MuonDimensionNumbers

from jaxtrain.errors import ConfigError

SCHEDULES = ("constant", "linear", "onecycle", "warmup_cosine")
OPTIMIZERS = ("sgd", "adam", "adamw", "muon")
GROUP_ONLY_KEYS = ("params", "lr_scale", "train_steps", "freeze")
# The schedule's shape is shared by all groups; a group scales it with lr_scale.
SHARED_KEYS = ("groups", "learning_rate", "schedule", "warmup_fraction", "start_lr_fraction",
               "end_lr_fraction", "lookahead_steps", "lookahead_alpha")
RESERVED_LABELS = ("default", "frozen")


def create_schedule(opt, total_steps: int) -> optax.Schedule:
    """Learning rate as a function of the step, over a run of `total_steps` steps.

    'constant'; 'linear': decay from the peak to peak * end_lr_fraction;
    'onecycle': linear warm-up from peak * start_lr_fraction to the peak over
    warmup_fraction of the run, then linear decay to peak * end_lr_fraction;
    'warmup_cosine': linear warm-up from 0, then cosine decay.
    """
    peak = opt.learning_rate
    end = peak * opt.end_lr_fraction
    warmup = int(round(opt.warmup_fraction * total_steps))
    if opt.schedule == "constant":
        return optax.constant_schedule(peak)
    if opt.schedule == "linear":
        return optax.linear_schedule(peak, end, max(total_steps, 1))
    if opt.schedule == "onecycle":
        return optax.join_schedules(
            [optax.linear_schedule(peak * opt.start_lr_fraction, peak, max(warmup, 1)),
             optax.linear_schedule(peak, end, max(total_steps - warmup, 1))],
            boundaries=[warmup])
    if opt.schedule == "warmup_cosine":
        return optax.warmup_cosine_decay_schedule(0.0, peak, warmup, max(total_steps, warmup + 1), end)
    raise ValueError(f"unknown optimizer.schedule {opt.schedule!r}; choose one of: "
                     + ", ".join(SCHEDULES))


# ---------------------------------------------------------------- parameter groups

def param_path(path) -> str:
    """A parameter's '/'-joined path, e.g. 'ConvBlock_0/Conv_1/kernel'."""
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def group_settings(opt, name: str) -> ml_collections.ConfigDict:
    """The top-level optimizer settings with group `name`'s overrides applied."""
    group = opt.groups[name]
    allowed = set(opt.keys()) - set(SHARED_KEYS) | set(GROUP_ONLY_KEYS)
    unknown = sorted(set(group.keys()) - allowed)
    if unknown:
        raise ConfigError(f"config.optimizer.groups.{name}: unknown key(s) {', '.join(unknown)}; "
                          "a group may set " + ", ".join(sorted(allowed)))
    if "params" not in group:
        raise ConfigError(f"config.optimizer.groups.{name}: needs `params`, a regular expression "
                          "for the '/'-joined parameter paths (optimizer.groups uses "
                          "configs.default.param_group)")
    settings = {k: v for k, v in opt.items() if k not in ("groups",)}
    settings.update({"lr_scale": 1.0, "train_steps": 0, "freeze": False})
    settings.update(group.to_dict() if hasattr(group, "to_dict") else dict(group))
    return ml_collections.ConfigDict(settings)


def param_labels(opt, params, frozen: tuple = ()):
    """Each parameter's group name: 'frozen', a group of optimizer.groups, or 'default'.

    Fails with a ConfigError naming them when a group matches no parameter or a
    parameter matches two groups; the message lists the parameter paths.
    """
    patterns = {}
    for name in opt.groups.keys():
        if name in RESERVED_LABELS:
            raise ConfigError(f"config.optimizer.groups.{name}: '{name}' is reserved; "
                              "name the group something else")
        try:
            patterns[name] = re.compile(group_settings(opt, name).params)
        except re.error as error:
            raise ConfigError(f"config.optimizer.groups.{name}.params="
                              f"{opt.groups[name].params!r} is not a regular expression: "
                              f"{error}") from None
    matched = {name: [] for name in patterns}

    def label(path, _):
        key = param_path(path)
        if key in frozen:
            return "frozen"
        names = [name for name, pattern in patterns.items() if pattern.fullmatch(key)]
        if len(names) > 1:
            raise ConfigError(f"parameter {key} is in two optimizer groups: "
                              + " and ".join(names))
        for name in names:
            matched[name].append(key)
        return names[0] if names else "default"

    labels = jax.tree_util.tree_map_with_path(label, params)
    paths = [param_path(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)]
    for name, keys in matched.items():
        if not keys:
            raise ConfigError(f"config.optimizer.groups.{name}.params={opt.groups[name].params!r} "
                              "matches no parameter (trainable: "
                              + ", ".join(p for p in paths if p not in frozen) + ")")
    return labels


def check_groups(opt, params, frozen: tuple = ()) -> None:
    """Every group's settings and parameters can work: call before training starts.

    `params` may be abstract (jax.eval_shape): only paths and shapes are read.
    """
    labels = param_labels(opt, params, frozen)
    for name in list(opt.groups.keys()) + ["default"]:
        settings = group_settings(opt, name) if name != "default" else opt
        prefix = f"config.optimizer.groups.{name}" if name != "default" else "config.optimizer"
        if name != "default" and not isinstance(settings.freeze, bool):
            raise ConfigError(f"{prefix}.freeze={settings.freeze!r}: must be True or False")
        if name != "default" and settings.freeze:
            continue  # never stepped: its optimiser settings do not matter
        if settings.name not in OPTIMIZERS:
            raise ConfigError(f"{prefix}.name={settings.name!r}: must be one of "
                              + ", ".join(OPTIMIZERS))
        leaves = [(param_path(path), p) for (path, p), lab in zip(
            jax.tree_util.tree_leaves_with_path(params), jax.tree_util.tree_leaves(labels))
            if lab == name]
        if settings.name == "muon" or settings.get("renormalize", False):
            flat = [key for key, p in leaves if len(p.shape) < 2]
            if flat:
                what = "muon" if settings.name == "muon" else "renormalize"
                raise ConfigError(f"{prefix}: {what} needs parameters of 2 or more dimensions, "
                                  "not " + ", ".join(flat) + "; put them in another group")
        if settings.name == "muon":
            coeffs = tuple(settings.ns_coeffs)
            if len(coeffs) != 3 or settings.ns_steps < 1:
                raise ConfigError(f"{prefix}: muon needs ns_steps >= 1 and three ns_coeffs, got "
                                  f"ns_steps={settings.ns_steps}, ns_coeffs={coeffs}")
        if name != "default":
            if settings.lr_scale < 0 or settings.train_steps < 0:
                raise ConfigError(f"{prefix}: lr_scale and train_steps must be >= 0, got "
                                  f"{settings.lr_scale} and {settings.train_steps}")


# ---------------------------------------------------------------- transformations

def kernel_dimension_numbers(params):
    """Muon's view of every parameter: all axes but the last are reduced, the last is
    the output, so a Flax HWIO conv kernel is a (H*W*C_in) x C_out matrix."""
    return jax.tree.map(lambda p: MuonDimensionNumbers(tuple(range(p.ndim - 1)), p.ndim - 1),
                        params)


def renormalize() -> optax.GradientTransformation:
    """After the step, scales each tensor to Frobenius norm sqrt(its last dimension).

    For a conv kernel that is sqrt(output channels), as the airbench94_muon record
    does to its filters (it normalises before each step; this does it after, so
    the weights the model uses are always normalised). Scale-invariant layers
    (conv then BatchNorm) keep their function; the norm no longer drifts, so the
    learning rate keeps its meaning over the run.
    """
    def update_fn(updates, state, params):
        def one(u, p):
            new = p + u
            target = math.sqrt(p.shape[-1])
            return new * (target / jnp.maximum(jnp.linalg.norm(new), 1e-12)) - p
        return jax.tree.map(one, updates, params), state
    return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


def lookahead(sync_steps: int, alpha: float) -> optax.GradientTransformation:
    """Lookahead (Zhang et al. 2019) as a step after the optimiser: every `sync_steps`
    steps the slow weights move `alpha` of the way to the fast ones and the fast
    weights restart from them.

    optax.lookahead keeps fast and slow weights in one LookaheadParams object that
    the model would have to unwrap at every apply; here the slow copy lives in the
    optimiser state, so the params stay a plain Flax tree.
    """
    def init_fn(params):
        return {"count": jnp.zeros([], jnp.int32), "slow": jax.tree.map(jnp.copy, params)}

    def update_fn(updates, state, params):
        count = state["count"] + 1
        sync = count % sync_steps == 0

        slow = jax.tree.map(lambda u, p, s: jnp.where(sync, s + alpha * (p + u - s), s),
                            updates, params, state["slow"])
        new_updates = jax.tree.map(lambda u, p, s: jnp.where(sync, s - p, u),
                                   updates, params, slow)
        return new_updates, {"count": count, "slow": slow}
    return optax.GradientTransformation(init_fn, update_fn)


def group_schedule(settings, schedule: optax.Schedule) -> optax.Schedule:
    """The group's learning rate: lr_scale x the shared schedule; with train_steps > 0
    the shared schedule's shape is compressed into the first train_steps steps and
    the rate is 0 after them (the record recipes' stem bias)."""
    scale, steps = settings.lr_scale, settings.train_steps
    if steps > 0:
        compressed = create_schedule(settings, steps)
        return lambda step: scale * compressed(step) * (step < steps)
    if scale == 1.0:
        return schedule
    return lambda step: scale * schedule(step)


def _optimizer(opt, schedule):
    if opt.name == "sgd":
        # 0 means plain SGD; a swept (traced, replicas.py) momentum always keeps a trace
        momentum = opt.momentum
        if isinstance(momentum, (int, float)) and not momentum:
            momentum = None
        return optax.chain(optax.add_decayed_weights(opt.weight_decay),
                           optax.sgd(schedule, momentum=momentum, nesterov=opt.nesterov))
    if opt.name == "adam":
        return optax.chain(optax.add_decayed_weights(opt.weight_decay),
                           optax.adam(schedule, b1=opt.b1, b2=opt.b2, eps=opt.eps))
    if opt.name == "adamw":
        return optax.adamw(schedule, b1=opt.b1, b2=opt.b2, eps=opt.eps,
                           weight_decay=opt.weight_decay)
    if opt.name == "muon":
        # optax's momentum is an average, mu = b mu + (1 - b) g with bias correction,
        # where torch-style Muon sums, buf = m buf + g; the Newton-Schulz step
        # normalises the update, so both give the same direction once the bias
        # correction has faded (a few steps). Its weight decay is decoupled (x lr).
        return optax.contrib.muon(
            schedule, ns_coeffs=tuple(float(c) for c in opt.ns_coeffs), ns_steps=opt.ns_steps,
            beta=opt.momentum, weight_decay=opt.weight_decay, nesterov=opt.nesterov,
            muon_weight_dimension_numbers=kernel_dimension_numbers)
    raise ValueError(f"unknown optimizer.name {opt.name!r}; choose one of: " + ", ".join(OPTIMIZERS))


def keep_unchanged() -> optax.GradientTransformation:
    """The update of a frozen parameter: -0.0 everywhere, with no state.

    p + (-0.0) is p bit for bit for every p (+0.0 and -0.0 included), where p + 0.0
    would turn a -0.0 weight into +0.0; and the gradient it ignores is dead code
    that XLA removes, so a frozen backbone costs no weight gradients.
    """
    def update_fn(updates, state, params=None):
        return jax.tree.map(lambda u: jnp.full_like(u, -0.0), updates), state
    return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


def _with_renormalize(settings, tx):
    return optax.chain(tx, renormalize()) if settings.get("renormalize", False) else tx


def create_optimizer(opt, schedule: optax.Schedule,
                     frozen: tuple = ()) -> optax.GradientTransformation:
    """optax SGD (momentum, Nesterov), Adam, AdamW or Muon, per parameter group.

    SGD and Adam add weight_decay * params to the gradient (coupled L2, as
    torch.optim does); AdamW and Muon decay the weights directly, scaled by the
    learning rate (as torch.optim.AdamW does). Parameters whose '/'-joined path
    is in `frozen`, or in a group with freeze=True, are never updated (no step, no
    decay, no optimiser state). Parameters of no group use the top-level settings.
    """
    groups = list(opt.groups.keys()) if "groups" in opt else []
    default = _with_renormalize(opt, _optimizer(opt, schedule))
    if not groups and not frozen:
        tx = default
    else:
        transforms = {"default": default, "frozen": keep_unchanged()}
        for name in groups:
            settings = group_settings(opt, name)
            transforms[name] = keep_unchanged() if settings.freeze else _with_renormalize(
                settings, _optimizer(settings, group_schedule(settings, schedule)))
        tx = optax.partition(transforms, lambda params: param_labels(opt, params, frozen))
    if opt.get("lookahead_steps", 0) > 0:
        tx = optax.chain(tx, lookahead(opt.lookahead_steps, opt.lookahead_alpha))
    return tx
