"""The `optimizer` config block -> an optax learning-rate schedule and transformation.

optimizer.name: a built-in (sgd, adam, adamw, muon, with their config keys), any
optimiser of optax or optax.contrib by its name ('lion', 'contrib.schedule_free_adamw',
with optimizer.kwargs), or one passed from Python (parts.py); every one of them takes
the schedule below as its learning rate. optimizer.clip_norm clips the gradient's global
norm first, whichever it is.

One optimiser for every parameter, or parameter groups (optimizer.groups): each
group names its parameters by a regular expression on their '/'-joined path and
gets its own optimiser, learning-rate multiplier and weight decay, combined with
optax.partition. The record CIFAR-10 recipes need this: Muon for the conv
filters, Nesterov SGD at very different rates for the biases and the head.
"""
import difflib
import functools
import inspect
import math
import re

import jax
import jax.numpy as jnp
import optax
from optax.contrib import MuonDimensionNumbers

from jaxtrain.errors import ConfigError

SCHEDULES = ("constant", "linear", "onecycle", "warmup_cosine")
OPTIMIZERS = ("sgd", "adam", "adamw", "muon")  # built in, with their own config keys
CONTRIB = "contrib."  # optimizer.name 'contrib.NAME': optax.contrib.NAME
PYTHON = "python:"  # optimizer.name of an optimiser passed from Python (parts.py)
GROUP_ONLY_KEYS = ("params", "lr_scale", "train_steps", "freeze")
# The schedule's shape is shared by all groups; a group scales it with lr_scale.
# So is `flatten`, a choice of how the whole update is computed.
SHARED_KEYS = ("groups", "learning_rate", "schedule", "warmup_fraction", "start_lr_fraction",
               "end_lr_fraction", "lookahead_steps", "lookahead_alpha", "flatten")
# What optax.flatten may run on one concatenated vector: elementwise in every parameter.
ELEMENTWISE = ("sgd", "adam", "adamw")
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
    """A parameter's (any pytree leaf's) '/'-joined path, e.g. 'ConvBlock_0/Conv_1/kernel'."""
    return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))))
                    for k in path)


def group_settings(opt, name: str):
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
    settings = opt.copy_and_resolve_references()  # a copy of the block: opt stays as it is
    with settings.unlocked(), settings.ignore_type():
        del settings["groups"]
        settings.update({"lr_scale": 1.0, "train_steps": 0, "freeze": False})
        settings.update(group.to_dict() if hasattr(group, "to_dict") else dict(group))
    return settings


def path_labeler(opt, frozen: tuple = ()):
    """key -> the group name of the parameter with '/'-joined path `key`: 'frozen', a
    group of optimizer.groups, or 'default'; a ConfigError for a key in two groups."""
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

    def label(key: str) -> str:
        if key in frozen:
            return "frozen"
        names = [name for name, pattern in patterns.items() if pattern.fullmatch(key)]
        if len(names) > 1:
            raise ConfigError(f"parameter {key} is in two optimizer groups: "
                              + " and ".join(names))
        return names[0] if names else "default"
    return label


def param_labels(opt, params, frozen: tuple = ()):
    """Each parameter's group name: 'frozen', a group of optimizer.groups, or 'default'.

    Fails with a ConfigError naming them when a group matches no parameter or a
    parameter matches two groups; the message lists the parameter paths.
    """
    label = path_labeler(opt, frozen)
    labels = jax.tree_util.tree_map_with_path(lambda path, _: label(param_path(path)), params)
    paths = [param_path(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)]
    used = set(jax.tree.leaves(labels))
    for name in opt.groups.keys():
        if name not in used:
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
        if not known_name(settings.name):
            raise unknown_name_error(f"{prefix[len('config.'):]}.name", settings.name)
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


# ---------------------------------------------------------------- optimisers by name

def optax_function(name: str):
    """The optax (or, for 'contrib.NAME', optax.contrib) function `name` names, if it is
    an optimiser: one that takes a learning_rate; else None."""
    module, attribute = ((optax.contrib, name[len(CONTRIB):]) if name.startswith(CONTRIB)
                         else (optax, name))
    function = getattr(module, attribute, None) if attribute.isidentifier() else None
    if not inspect.isfunction(function):
        return None
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):
        return None
    return function if "learning_rate" in parameters else None


@functools.cache
def optax_names() -> tuple[str, ...]:
    """Every name optimizer.name may give an optax optimiser."""
    names = [n for n in dir(optax) if not n.startswith("_") and optax_function(n)]
    names += [CONTRIB + n for n in dir(optax.contrib)
              if not n.startswith("_") and optax_function(CONTRIB + n)]
    return tuple(sorted(names))


def known_name(name) -> bool:
    """A name optimizer.name (or a group's name) may hold."""
    return isinstance(name, str) and (name in OPTIMIZERS or name.startswith(PYTHON)
                                      or optax_function(name) is not None)


def unknown_name_error(key: str, name) -> ConfigError:
    """`config.KEY=NAME: unknown optimiser` with the nearest names."""
    names = OPTIMIZERS + optax_names()
    near = difflib.get_close_matches(str(name), names, n=3, cutoff=0.6)
    return ConfigError(f"config.{key}={name!r}: unknown optimiser"
                       + (f" (did you mean {' or '.join(map(repr, near))}?)" if near else "")
                       + f"; one of {', '.join(OPTIMIZERS)}, any of optax's by its name "
                       "('lion', 'adafactor', ...; 'contrib.NAME' for optax.contrib) with "
                       "optimizer.kwargs, or one passed from Python")


def named_optimizer(opt, schedule, weight_decay):
    """optax's optimiser `opt.name` with the schedule as its learning rate and
    optimizer.kwargs; optimizer.weight_decay as its own weight_decay where it has one,
    else added to the gradient (coupled, as sgd and adam here) when not 0."""
    function = optax_function(opt.name)
    kwargs = opt.get("kwargs", {})
    kwargs = dict(kwargs.to_dict() if hasattr(kwargs, "to_dict") else kwargs)
    own_decay = "weight_decay" in inspect.signature(function).parameters
    if own_decay and "weight_decay" not in kwargs:
        kwargs["weight_decay"] = weight_decay
    try:
        tx = function(schedule, **kwargs)
    except TypeError as error:
        raise ConfigError(f"config.optimizer.kwargs={kwargs!r}: optax's {opt.name} cannot take "
                          f"them ({error})") from None
    if own_decay or (isinstance(weight_decay, (int, float)) and not weight_decay):
        return tx
    return optax.chain(optax.add_decayed_weights(weight_decay), tx)


def given_optimizer(given, schedule) -> optax.GradientTransformation:
    """An optimiser passed from Python: a transformation as it is, a function of the
    learning rate called with the schedule."""
    if isinstance(given, optax.GradientTransformation):
        return given
    tx = given(schedule)
    if not isinstance(tx, optax.GradientTransformation):
        raise TypeError(f"optimizer: the function passed returned {type(tx).__name__}, not an "
                        "optax.GradientTransformation")
    return tx


def takes_schedule(opt, given) -> bool:
    """Whether the run's optimiser uses jaxtrain's schedule (what the rows log as
    learning_rate): every one but a transformation passed from Python, which brings
    its own."""
    return not (opt.name.startswith(PYTHON) and isinstance(given, optax.GradientTransformation))


# ---------------------------------------------------------------- transformations

def kernel_dimension_numbers(params):
    """Muon's view of every parameter: all axes but the last are reduced, the last is
    the output, so a Flax HWIO conv kernel is a (H*W*C_in) x C_out matrix."""
    return jax.tree.map(lambda p: MuonDimensionNumbers(tuple(range(p.ndim - 1)), p.ndim - 1),
                        params)


def stacked_kernel_dimension_numbers(stacks):
    """kernel_dimension_numbers of stacks of kernels (stack_by_shape): the leading axis
    is neither reduced nor the output, so optax's Muon treats it as a batch axis and
    orthogonalises every kernel of a stack on its own, in one batched iteration."""
    return jax.tree.map(lambda p: MuonDimensionNumbers(tuple(range(1, p.ndim - 1)), p.ndim - 1),
                        stacks)


def _stack_name(leaf) -> str:
    return f"{jnp.dtype(leaf.dtype).name}_{'x'.join(str(n) for n in leaf.shape)}"


def stack_by_shape(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """`inner` on stacks of same-shape tensors, {'float32_3x3x256x256': (N, 3, 3, 256, 256)},
    its state kept stacked, its updates unstacked back into the parameter tree.

    A transformation that maps each tensor on its own (Muon's Newton-Schulz with the
    stack axis as a batch axis, a renormalisation per stacked tensor) then runs one
    batched kernel per shape where it ran one per tensor: the speedrun's six filters
    are four shapes. Each stack holds its tensors in the order of the tree's leaves.
    """
    def plan(tree):
        leaves, treedef = jax.tree.flatten(tree)
        stacks = {}
        for index, leaf in enumerate(leaves):
            stacks.setdefault(_stack_name(leaf), []).append(index)
        return leaves, treedef, stacks

    def stack(tree):
        leaves, _, stacks = plan(tree)
        return {name: jnp.stack([leaves[i] for i in indices]) for name, indices in stacks.items()}

    def update_fn(updates, state, params=None):
        leaves, treedef, stacks = plan(updates)
        stacked, state = inner.update(stack(updates), state,
                                      None if params is None else stack(params))
        for name, indices in stacks.items():
            for position, index in enumerate(indices):
                leaves[index] = stacked[name][position]
        return treedef.unflatten(leaves), state
    return optax.GradientTransformation(lambda params: inner.init(stack(params)), update_fn)


def flatten(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """optax.flatten(inner): `inner` on one vector, every parameter's values concatenated,
    so an elementwise optimiser runs a few large kernels instead of a few per tensor. A
    group that gets no parameter (the default, often) keeps `inner` as it is: optax's
    would concatenate nothing."""
    flat = optax.flatten(inner)

    def pick(tree):
        return flat if jax.tree.leaves(tree) else inner
    return optax.GradientTransformation(
        lambda params: pick(params).init(params),
        lambda updates, state, params=None: pick(updates).update(updates, state, params))


def renormalize(stacked: bool = False) -> optax.GradientTransformation:
    """After the step, scales each tensor to Frobenius norm sqrt(its last dimension).

    For a conv kernel that is sqrt(output channels), as the airbench94_muon record
    does to its filters (it normalises before each step; this does it after, so
    the weights the model uses are always normalised). Scale-invariant layers
    (conv then BatchNorm) keep their function; the norm no longer drifts, so the
    learning rate keeps its meaning over the run.
    With `stacked`, each leaf is a stack of tensors (stack_by_shape) and each tensor
    of the stack is scaled to its own norm.
    """
    def norm(new):
        if not stacked:
            return jnp.linalg.norm(new)
        return jnp.sqrt(jnp.sum(jnp.square(new), axis=tuple(range(1, new.ndim)), keepdims=True))

    def update_fn(updates, state, params):
        def one(u, p):
            new = p + u
            target = math.sqrt(p.shape[-1])
            return new * (target / jnp.maximum(norm(new), 1e-12)) - p
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


def _optimizer(opt, schedule, stacked: bool = False, weight_decay=None, given=None):
    """`weight_decay`: instead of opt.weight_decay (elementwise_groups' per-element one).
    `given`: the optimiser passed from Python (opt.name 'python:...')."""
    weight_decay = opt.weight_decay if weight_decay is None else weight_decay
    if opt.name.startswith(PYTHON):
        return given_optimizer(given, schedule)
    if opt.name == "sgd":
        # 0 means plain SGD; a swept (traced, replicas.py) momentum always keeps a trace
        momentum = opt.momentum
        if isinstance(momentum, (int, float)) and not momentum:
            momentum = None
        return optax.chain(optax.add_decayed_weights(weight_decay),
                           optax.sgd(schedule, momentum=momentum, nesterov=opt.nesterov))
    if opt.name == "adam":
        return optax.chain(optax.add_decayed_weights(weight_decay),
                           optax.adam(schedule, b1=opt.b1, b2=opt.b2, eps=opt.eps))
    if opt.name == "adamw":
        return optax.adamw(schedule, b1=opt.b1, b2=opt.b2, eps=opt.eps,
                           weight_decay=weight_decay)
    if opt.name == "muon":
        # optax's momentum is an average, mu = b mu + (1 - b) g with bias correction,
        # where torch-style Muon sums, buf = m buf + g; the Newton-Schulz step
        # normalises the update, so both give the same direction once the bias
        # correction has faded (a few steps). Its weight decay is decoupled (x lr).
        return optax.contrib.muon(
            schedule, ns_coeffs=tuple(float(c) for c in opt.ns_coeffs), ns_steps=opt.ns_steps,
            beta=opt.momentum, weight_decay=weight_decay, nesterov=opt.nesterov,
            muon_weight_dimension_numbers=(stacked_kernel_dimension_numbers if stacked
                                           else kernel_dimension_numbers))
    if optax_function(opt.name) is not None:
        return named_optimizer(opt, schedule, weight_decay)
    raise unknown_name_error("optimizer.name", opt.name)


def keep_unchanged() -> optax.GradientTransformation:
    """The update of a frozen parameter: -0.0 everywhere, with no state.

    p + (-0.0) is p bit for bit for every p (+0.0 and -0.0 included), where p + 0.0
    would turn a -0.0 weight into +0.0; and the gradient it ignores is dead code
    that XLA removes, so a frozen backbone costs no weight gradients.
    """
    def update_fn(updates, state, params=None):
        return jax.tree.map(lambda u: jnp.full_like(u, -0.0), updates), state
    return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


def group_optimizer(settings, schedule, given=None) -> optax.GradientTransformation:
    """One group's (or the default's) optimiser with its renormalisation.

    ns_stack (Muon): the whole group, renormalisation included, runs on stacks of
    same-shape kernels (stack_by_shape). flatten (elementwise optimisers): the
    optimiser runs on one vector, all the group's parameters concatenated
    (optax.flatten); the renormalisation, per tensor, stays outside it.
    """
    stacked = settings.name == "muon" and settings.get("ns_stack", False)
    tx = _optimizer(settings, schedule, stacked, given=given)
    if settings.get("flatten", False) and settings.name in ELEMENTWISE:
        tx = flatten(tx)
    if settings.get("renormalize", False):
        tx = optax.chain(tx, renormalize(stacked))
    return stack_by_shape(tx) if stacked else tx


# What elementwise_groups may share: the optimiser and its moment settings; the learning
# rate and the weight decay may differ per element.
SHARED_MOMENTS = {"sgd": ("momentum", "nesterov"), "adam": ("b1", "b2", "eps"),
                  "adamw": ("b1", "b2", "eps")}


def _same(a, b) -> bool:
    """Equal settings; a swept one (a tracer under optax.inject_hyperparams) equals only itself."""
    plain = (bool, int, float, str)
    return a is b or (isinstance(a, plain) and isinstance(b, plain) and a == b)


def mergeable_groups(members: dict) -> list[list[str]]:
    """The sets of two or more groups that elementwise_groups can update as one vector:
    the same elementwise optimiser and moment settings, no renormalisation.
    `members`: {group name: (settings, schedule)} of the groups that are stepped."""
    sets = []
    for name, (settings, _) in members.items():
        if settings.name not in ELEMENTWISE or settings.get("renormalize", False):
            continue
        for names in sets:
            first = members[names[0]][0]
            if first.name == settings.name and all(
                    _same(first[key], settings[key]) for key in SHARED_MOMENTS[settings.name]):
                names.append(name)
                break
        else:
            sets.append([name])
    return [names for names in sets if len(names) > 1]


def elementwise_groups(members: dict, label) -> optax.GradientTransformation:
    """Several groups of one elementwise optimiser as one optax.flatten'ed update: each
    element gets its group's learning rate and weight decay, so every element takes the
    step its own group would (the same float operations), with one schedule count and
    one kernel per update stage for all of them.

    `members`: {group name: (settings, schedule)} (mergeable_groups); `label`: a
    parameter's group from its '/'-joined path (path_labeler).
    """
    first = next(iter(members.values()))[0]

    def build(tree):
        paths = jax.tree_util.tree_leaves_with_path(tree)
        if not paths:
            return _optimizer(first, next(iter(members.values()))[1])
        owners = [label(param_path(path)) for path, _ in paths]
        sizes = [math.prod(leaf.shape) for _, leaf in paths]

        def per_element(value):
            return jnp.concatenate([jnp.full((size,), value(owner), jnp.float32)
                                    for owner, size in zip(owners, sizes)])
        schedule = lambda count: per_element(lambda owner: members[owner][1](count))
        weight_decay = per_element(lambda owner: members[owner][0].weight_decay)
        return optax.flatten(_optimizer(first, schedule, weight_decay=weight_decay))
    return optax.GradientTransformation(
        lambda params: build(params).init(params),
        lambda updates, state, params=None: build(updates).update(updates, state, params))


def create_optimizer(opt, schedule: optax.Schedule, frozen: tuple = (),
                     given=None) -> optax.GradientTransformation:
    """optax SGD (momentum, Nesterov), Adam, AdamW, Muon, any optax optimiser by name or
    `given` (passed from Python, opt.name 'python:...'), per parameter group.

    SGD and Adam add weight_decay * params to the gradient (coupled L2, as
    torch.optim does); AdamW and Muon decay the weights directly, scaled by the
    learning rate (as torch.optim.AdamW does). Parameters whose '/'-joined path
    is in `frozen`, or in a group with freeze=True, are never updated (no step, no
    decay, no optimiser state). Parameters of no group use the top-level settings.
    With optimizer.flatten, the groups of one elementwise optimiser that differ only in
    learning rate and weight decay are updated together (elementwise_groups), under
    the first one's name in the optimiser state. A group that names no optimiser of its
    own takes the top-level one, `given` too (a function of the learning rate is called
    with the group's schedule). optimizer.clip_norm > 0: the gradient's global norm is
    clipped to it first (over every parameter).
    """
    groups = list(opt.groups.keys()) if "groups" in opt else []
    flat = opt.get("flatten", False)
    if not groups and not frozen:
        tx = group_optimizer(opt, schedule, given)
    else:
        stepped = {"default": (opt, schedule)}
        transforms = {"default": group_optimizer(opt, schedule, given),
                      "frozen": keep_unchanged()}
        for name in groups:
            settings = group_settings(opt, name)
            if settings.freeze:
                transforms[name] = keep_unchanged()
                continue
            stepped[name] = (settings, group_schedule(settings, schedule))
            transforms[name] = group_optimizer(*stepped[name], given)
        merged = {}  # group -> the merged set's label, its first group's name
        for names in mergeable_groups(stepped) if flat else []:
            for name in names:
                merged[name] = names[0]
                del transforms[name]
            transforms[names[0]] = elementwise_groups({n: stepped[n] for n in names},
                                                      path_labeler(opt, frozen))

        def labels(params):
            return jax.tree.map(lambda name: merged.get(name, name),
                                param_labels(opt, params, frozen))
        tx = optax.partition(transforms, labels)
    if opt.get("lookahead_steps", 0) > 0:
        slow = lookahead(opt.lookahead_steps, opt.lookahead_alpha)
        tx = optax.chain(tx, flatten(slow) if flat else slow)
    if opt.get("clip_norm", 0.0) > 0:
        tx = optax.chain(optax.clip_by_global_norm(opt.clip_norm), tx)
    return tx
