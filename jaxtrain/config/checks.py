"""Config checks: every key known, every value possible, before anything is written.

prepare.setup (and so every entry point) calls check_config first; main.py
turns its ConfigError into one line, `error: config.KEY=VALUE: what is wrong
(what would work)`.
"""
import difflib

import jax
import jax.numpy as jnp
import ml_collections

from jaxtrain import data, models
from jaxtrain.config import defaults
from jaxtrain.errors import ConfigError
from jaxtrain.models import cnn, resnet, user, whitening
from jaxtrain.models.ops import batchnorm, onednn, pooling
from jaxtrain.runtime import xla_flags
from jaxtrain.training import augment, batches, losses, optim, replicas

PRECISIONS = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}
PRECISION_CHOICES = ("auto", *PRECISIONS)  # train.precision


def resolve_precision(precision: str) -> str:
    """train.precision as the run computes it: 'auto' is bfloat16 where the default
    device computes it fast (GPUs, TPUs) and float32 on a CPU."""
    if precision != "auto":
        return precision
    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


def compute_dtype(precision: str):
    """The models' compute dtype for train.precision (resolve_precision's)."""
    return PRECISIONS[resolve_precision(precision)]


KWARGS = ("model.kwargs", "optimizer.kwargs")  # dicts of a class's or function's arguments: one value


def flat_keys(config, prefix: str = "") -> list[str]:
    """The dotted names of a config's values ('train.batch_size', ...); a group of
    optimizer.groups counts as its own keys, a non-dict group as one value."""
    keys = []
    for name, value in config.items():
        key = f"{prefix}{name}"
        if isinstance(value, (dict, ml_collections.ConfigDict)) and key not in KWARGS:
            keys += flat_keys(value, key + ".") or [key]
        else:
            keys.append(key)
    return keys


def known_keys() -> set[str]:
    return set(flat_keys(defaults.get_config()))


SIMILAR = 0.7  # difflib's ratio below which a spelling counts as another word


def nearest_name(name: str, names) -> str | None:
    """The known name `name` most likely meant: one whose initials it is ('lr':
    learning_rate), which starts with or contains it ('epochs': num_epochs), else the
    closest spelling (at least SIMILAR alike); None when nothing is that close."""
    names = sorted(names)
    for match in (lambda n: "".join(w[0] for w in n.split("_") if w) == name,
                  lambda n: n.startswith(name), lambda n: len(name) > 2 and name in n):
        found = [n for n in names if len(name) > 1 and match(n)]
        if found:  # the most alike of them
            return max(found, key=lambda n: difflib.SequenceMatcher(None, name, n).ratio())
    close = difflib.get_close_matches(name, names, n=1, cutoff=SIMILAR)
    return close[0] if close else None


def nearest_key(key: str, known) -> str | None:
    """The known key `key` most likely meant: the nearest name in its block (in the
    nearest block, if its own is not one), else the same or a near name in another block
    ('train.learning_rate': optimizer.learning_rate); None when none is near."""
    block, _, name = key.rpartition(".")
    blocks = {k.rpartition(".")[0] for k in known}
    if block not in blocks:
        near_block = nearest_name(block, blocks - {""}) if block else None
        return nearest_key(f"{near_block}.{name}", known) if near_block else None
    siblings = {k.rpartition(".")[2] for k in known if k.rpartition(".")[0] == block}
    nearest = nearest_name(name, siblings)
    if nearest:
        return f"{block}.{nearest}" if block else nearest
    elsewhere = {k.rpartition(".")[2]: k for k in sorted(known, reverse=True)
                 if k.rpartition(".")[0] != block}
    close = difflib.get_close_matches(name, sorted(elsewhere), n=1, cutoff=SIMILAR)
    return elsewhere[close[0]] if close else None


def unknown_key_error(key: str, known) -> ConfigError:
    """`unknown config key 'KEY' (did you mean 'NEAREST'?)` (nearest_key); with nothing
    near, the block's keys instead of a guess. A sweep of a key that cannot be swept
    says so."""
    not_sweepable = replicas.not_sweepable_error(key, known)
    if not_sweepable is not None:
        return not_sweepable
    guess = nearest_key(key, known)
    if guess is not None:
        return ConfigError(f"unknown config key {key!r} (did you mean {guess!r}?)")
    block = key.rpartition(".")[0]
    siblings = sorted(k.rpartition(".")[2] for k in known if k.rpartition(".")[0] == block)
    if block and siblings:
        return ConfigError(f"unknown config key {key!r}: {block} has no such key; its keys "
                           f"are {', '.join(siblings)}")
    top = sorted({k.partition(".")[0] for k in known})
    return ConfigError(f"unknown config key {key!r}: the config's top-level names are "
                       f"{', '.join(top)} (jaxtrain/config/defaults.py lists every key)")


def check_keys(config) -> None:
    """Every key must be one jaxtrain knows: a misspelt key would otherwise be ignored.
    (A parameter group's keys are optim.check_groups's to check, a callback's its own.)"""
    known = known_keys()
    for key in flat_keys(config):
        if key not in known and not key.startswith((*KWARGS, "optimizer.groups.", "callbacks.")):
            raise unknown_key_error(key, known)


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _integer(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _at_least(low, integer=False):
    return lambda v: (_integer(v) if integer else _number(v)) and v >= low


def _above(low):
    return lambda v: _number(v) and v > low


def _within(low, high, open_high=False):
    return lambda v: _number(v) and low <= v and (v < high if open_high else v <= high)


def _regex(v) -> bool:
    import re
    try:
        return isinstance(v, str) and (v == "" or re.compile(v) is not None)
    except re.error:
        return False


def _one_of(*choices):
    return lambda v: v in choices


def _sizes(v) -> bool:  # a non-empty tuple of positive ints
    return isinstance(v, tuple) and len(v) > 0 and all(_integer(w) and w > 0 for w in v)


def _pair(low, high):  # (a, b) with low < a <= b <= high
    return lambda v: (isinstance(v, tuple) and len(v) == 2 and all(_number(x) for x in v)
                      and low < v[0] <= v[1] <= high)


def _channel_values(low, high):  # () or numbers in [low, high]
    return lambda v: isinstance(v, tuple) and all(_number(x) and low <= x <= high for x in v)


# key -> (does the value work?, what would). The values every key may take, as data;
# combinations of keys are checked in check_config below.
RANGES = {
    "data.name": (_one_of(*data.DATASETS), "one of " + ", ".join(data.DATASETS)),
    "data.source": (_one_of(*data.SOURCES), "one of " + ", ".join(data.SOURCES)),
    "data.label": (_one_of(*data.CIFAR100_LABELS), "'fine' (CIFAR-100's 100 classes) or "
                                                   "'coarse' (its 20 superclasses)"),
    "data.image_size": (_at_least(0, True), "an int >= 0 (0: keep the images' own size)"),
    "data.resize": (_one_of(*data.RESIZES), "one of " + ", ".join(data.RESIZES)),
    "data.channels": (_one_of(1, 3), "3 (RGB) or 1 (grey)"),
    "data.workers": (_at_least(0, True), "an int >= 0 (0: one per core)"),
    "data.placement": (_one_of(*batches.PLACEMENTS), "one of " + ", ".join(batches.PLACEMENTS)),
    "data.device_fraction": (lambda v: _number(v) and 0 < v <= 1, "in (0, 1]"),
    "data.mean": (_channel_values(0, 1), "() (computed from the training split) or one "
                                         "number in [0, 1] per channel"),
    "data.std": (_channel_values(1e-12, float("inf")), "() (computed from the training split) "
                                                      "or one number > 0 per channel"),
    "model.stem": (_one_of(*resnet.RESNET_STEMS), "one of " + ", ".join(resnet.RESNET_STEMS)),
    "model.hidden_sizes": (_sizes, "a tuple of positive layer sizes, e.g. (256, 128)"),
    "model.dropout": (_within(0, 1, open_high=True), "in [0, 1)"),
    "model.drop_path": (_within(0, 1, open_high=True), "in [0, 1)"),
    "model.init_from_exclude": (_regex, "'' or a regular expression on the '/'-joined "
                                        "parameter paths, e.g. 'Dense_0/.*'"),
    "model.widths": (_sizes, "a tuple of positive channel counts, e.g. (64, 256, 256)"),
    "model.stem_width": (_at_least(1, True), "an int >= 1"),
    "model.stem_init": (_one_of(*whitening.STEM_INITS),
                        "one of " + ", ".join(whitening.STEM_INITS)),
    "model.bn_momentum": (_within(0, 1, open_high=True), "in [0, 1)"),
    "model.head_scale": (_above(0), "> 0"),
    "model.head_init_std": (_at_least(0), ">= 0 (0: Flax's default init)"),
    "model.activation": (_one_of(*cnn.ACTIVATIONS), "one of " + ", ".join(cnn.ACTIVATIONS)),
    "model.conv_init": (_one_of(*cnn.CONV_INITS), "one of " + ", ".join(cnn.CONV_INITS)),
    "model.bn_epsilon": (_above(0), "> 0"),
    "model.remat": (lambda v: isinstance(v, bool), "True or False"),
    "model.pool_impl": (_one_of(*pooling.POOL_IMPLS), "one of " + ", ".join(pooling.POOL_IMPLS)),
    "model.conv_impl": (_one_of(*onednn.CONV_IMPLS), "one of " + ", ".join(onednn.CONV_IMPLS)),
    "model.bn_impl": (_one_of(*batchnorm.BN_IMPLS), "one of " + ", ".join(batchnorm.BN_IMPLS)),
    "optimizer.kwargs": (lambda v: isinstance(v, (dict, ml_collections.ConfigDict)),
                         "a dict of the optax optimiser's arguments"),
    "optimizer.clip_norm": (_at_least(0), ">= 0 (0: off)"),
    "optimizer.learning_rate": (_above(0), "> 0"),
    "optimizer.momentum": (_within(0, 1, open_high=True), "in [0, 1)"),
    "optimizer.weight_decay": (_at_least(0), ">= 0"),
    "optimizer.b1": (_within(0, 1, open_high=True), "in [0, 1)"),
    "optimizer.b2": (_within(0, 1, open_high=True), "in [0, 1)"),
    "optimizer.eps": (_above(0), "> 0"),
    "optimizer.ns_steps": (_at_least(1, True), "an int >= 1"),
    "optimizer.ns_coeffs": (lambda v: isinstance(v, tuple) and len(v) == 3
                            and all(_number(x) for x in v), "three numbers (a, b, c)"),
    "optimizer.ns_stack": (lambda v: isinstance(v, bool), "True (one batched Newton-Schulz per "
                                                          "kernel shape) or False"),
    "optimizer.flatten": (lambda v: isinstance(v, bool), "True (elementwise optimisers on one "
                                                         "concatenated vector) or False"),
    "optimizer.lookahead_steps": (_at_least(0, True), "an int >= 0 (0: off)"),
    "optimizer.lookahead_alpha": (lambda v: _number(v) and 0 < v <= 1, "in (0, 1]"),
    "optimizer.schedule": (_one_of(*optim.SCHEDULES), "one of " + ", ".join(optim.SCHEDULES)),
    "optimizer.warmup_fraction": (_within(0, 1, open_high=True), "in [0, 1)"),
    "optimizer.start_lr_fraction": (_at_least(0), ">= 0"),
    "optimizer.end_lr_fraction": (_at_least(0), ">= 0"),
    "augment.translate": (_at_least(0, True), "an int >= 0 (pixels)"),
    "augment.pad_mode": (_one_of("reflect", "constant"), "'reflect' or 'constant'"),
    "augment.rotate": (_within(0, 180), "in [0, 180] (degrees)"),
    "augment.cutout": (_at_least(0, True), "an int >= 0 (pixels; 0: off)"),
    "augment.mixup": (_at_least(0), ">= 0 (Beta(alpha, alpha)'s alpha; 0: off)"),
    "augment.cutmix": (_at_least(0), ">= 0 (Beta(alpha, alpha)'s alpha; 0: off)"),
    "augment.mix_prob": (_within(0, 1), "in [0, 1] (the share of batches mixed)"),
    "augment.switch_prob": (_within(0, 1), "in [0, 1] (the share of mixed batches cut)"),
    "augment.fn": (lambda v: isinstance(v, str) and (v == "" or ":" in v),
                   "'' (none) or 'package.module:function'"),
    "augment.crop": (_one_of(*augment.HOST_CROPS), "one of " + ", ".join(augment.HOST_CROPS)),
    "augment.crop_scale": (_pair(0, 1), "(low, high) with 0 < low <= high <= 1"),
    "augment.crop_ratio": (_pair(0, float("inf")), "(low, high) with 0 < low <= high"),
    "train.batch_size": (_at_least(1, True), "an int >= 1"),
    "train.accumulate_steps": (_at_least(1, True), "an int >= 1 (1: off)"),
    "train.num_epochs": (_at_least(0, True), "an int >= 0"),
    "train.num_steps": (_at_least(0, True), "an int >= 0 (0: train.num_epochs decides)"),
    "train.precision": (_one_of(*PRECISION_CHOICES), "one of " + ", ".join(PRECISION_CHOICES)),
    "train.label_smoothing": (_within(0, 1, open_high=True), "in [0, 1)"),
    "train.loss": (lambda v: isinstance(v, str) and (v in losses.BUILT_IN or ":" in v),
                   "one of " + ", ".join(losses.BUILT_IN) + ", or 'package.module:function'"),
    "train.focal_gamma": (_at_least(0), ">= 0"),
    "train.log_every_steps": (_at_least(0, True), "an int >= 0 (0: about 50 rows a run)"),
    "train.loop": (_one_of("auto", "scan", "python"), "'auto', 'scan' or 'python'"),
    "train.drop_finished_groups": (lambda v: isinstance(v, bool), "True or False"),
    "train.chunk_steps": (_at_least(0, True), "an int >= 0 (0: an epoch)"),
    "train.chunk_seconds": (_at_least(0), ">= 0 (seconds; 0: a scanned chunk runs whole)"),
    "train.nonfinite": (_one_of("stop", "skip"), "'stop' or 'skip'"),
    "train.ema_decay": (lambda v: v is None or (_number(v) and 0 <= v < 1),
                        "None (off) or in [0, 1), e.g. 0.999"),
    "train.replicas": (_at_least(1, True), "an int >= 1"),
    "train.compilation_cache": (lambda v: isinstance(v, str), "a folder, or '' (off)"),
    "train.xla_flags": (xla_flags.well_formed, "'' or XLA flags, '--xla_NAME=VALUE ...'"),
    "checkpoint.every_steps": (_at_least(0, True), "an int >= 0 (0: checkpoint.every_epochs)"),
    "checkpoint.every_epochs": (_at_least(0, True), "an int >= 0 (0: only at the end)"),
    "checkpoint.keep": (_at_least(1, True), "an int >= 1"),
    "checkpoint.best_metric": (_one_of("", "test_accuracy", "test_loss", "test_accuracy_ema",
                                       "test_loss_ema"),
                               "'' (off), 'test_accuracy' or 'test_loss' (or their _ema, "
                               "with train.ema_decay)"),
    "checkpoint.best_mode": (_one_of("auto", "max", "min"), "'auto', 'max' or 'min'"),
    "checkpoint.keep_best": (_at_least(1, True), "an int >= 1"),
    "checkpoint.resume_step": (_at_least(0, True), "an int >= 0 (0: the newest checkpoint)"),
    "logging.mlflow": (lambda v: isinstance(v, str), "'' (off) or an MLflow tracking URI"),
    "logging.mlflow_experiment": (lambda v: isinstance(v, str) and v != "",
                                  "an experiment name"),
    "logging.mlflow_registered_model": (lambda v: isinstance(v, str),
                                        "'' (not registered) or a registered model's name"),
    "logging.wandb": (lambda v: isinstance(v, str), "'' (off) or a W&B project name"),
    "logging.wandb_mode": (_one_of("offline", "online"), "'offline' or 'online'"),
    "eval.batch_size": (_at_least(1, True), "an int >= 1"),
    "parallel.fsdp": (_at_least(1, True), "an int >= 1 (1: every device holds every parameter)"),
    "eval.tta": (_one_of("none", "flip", "flip_translate"), "'none', 'flip' or 'flip_translate'"),
    "eval.tta_fraction": (_within(0, 1), "in [0, 1]"),
    "eval.every_epochs": (_at_least(0, True), "an int >= 0 (0: only at the end)"),
    "eval.every_steps": (_at_least(0, True), "an int >= 0 (0: off)"),
}
# A sweep (replicas.py) takes a tuple of its key's values; () = not swept.
RANGES.update({f"sweep.{key}": ((lambda works: lambda v: isinstance(v, tuple) and all(
    works(x) for x in v))(RANGES[key][0]), f"() or a tuple of values each {RANGES[key][1]}")
    for key in replicas.SWEEPABLE})
# A parameter group's own settings take the top-level optimizer key's values.
GROUP_RANGES = {"lr_scale": (_at_least(0), ">= 0"),
                "train_steps": (_at_least(0, True), "an int >= 0 (0: every step)"),
                "params": (lambda v: isinstance(v, str) and v != "", "a regular expression"),
                "freeze": (lambda v: isinstance(v, bool), "True (never updated) or False")}


def divisors(n: int, shown: int = 12) -> str:
    """'1, 2, 4, 8, 16, 32': the divisors of n, the largest last ('...' past `shown`)."""
    found = [k for k in range(1, n + 1) if n % k == 0]
    return ", ".join(map(str, found if len(found) <= shown else
                         [*found[:shown - 1], "...", found[-1]]))


def _value(config, key):
    value = defaults.value_at(config, key)
    return tuple(value) if isinstance(value, list) else value


def check_config(config) -> None:
    """Fails fast, naming the key, on keys jaxtrain does not know and on values that
    would only fail later (or silently): `config.KEY=VALUE: must be WHAT WOULD WORK`."""
    check_keys(config)

    def need(ok, key, value, what):
        if not ok:
            raise ConfigError(f"config.{key}={value!r}: {what}")

    for key, (works, what) in RANGES.items():
        value = _value(config, key)
        need(works(value), key, value, "must be " + what)
    model, opt, dc, aug = config.model, config.optimizer, config.data, config.augment
    if not optim.known_name(opt.name):
        raise optim.unknown_name_error("optimizer.name", opt.name)
    need(model.name in models.MODEL_NAMES or user.is_user_model(model.name),
         "model.name", model.name,
         f"unknown model (did you mean {nearest_name(model.name, models.MODEL_NAMES)!r}? "
         f"one of {', '.join(models.MODEL_NAMES)}, or 'package.module:Class' for your own)"
         if nearest_name(model.name, models.MODEL_NAMES) else
         f"unknown model (one of {', '.join(models.MODEL_NAMES)}, or 'package.module:Class' "
         "for your own)")
    need(config.train.num_steps > 0 or config.train.num_epochs > 0, "train.num_epochs",
         config.train.num_epochs, "must be > 0 when train.num_steps is 0")
    for name in opt.groups.keys():
        group = opt.groups[name]
        need(isinstance(group, (dict, ml_collections.ConfigDict)), f"optimizer.groups.{name}",
             group, "must be a group: jaxtrain.config.defaults.param_group(params_regex, ...)")
        for setting in group.keys():
            rule = GROUP_RANGES.get(setting) or RANGES.get(f"optimizer.{setting}")
            if rule is not None:  # (booleans: any value of the right type works)
                value = _value(group, setting)
                need(rule[0](value), f"optimizer.groups.{name}.{setting}", value,
                     "must be " + rule[1])
    need(not config.checkpoint.best_metric.endswith("_ema")
         or config.train.ema_decay is not None, "checkpoint.best_metric",
         config.checkpoint.best_metric, "needs train.ema_decay (the averaged weights)")
    for name in config.callbacks.keys():
        entry = config.callbacks[name]
        need(isinstance(entry, (dict, ml_collections.ConfigDict)) and isinstance(
            entry.get("name"), str), f"callbacks.{name}", entry,
            "must be jaxtrain.config.defaults.callback('package.module:Class' or a "
            "built-in's name, **kwargs)")
    need(not aug.alternate_flip or aug.flip, "augment.alternate_flip", aug.alternate_flip,
         "needs augment.flip=True")
    if aug.crop != "none":
        need(dc.name == "folder" and dc.placement == "stream", "augment.crop", aug.crop,
             "needs data.name='folder' and data.placement='stream' (it crops the original "
             "files while streaming)")
        need(dc.image_size > 0, "augment.crop", aug.crop, "needs data.image_size > 0")
    need(len(dc.mean) == len(dc.std) or not dc.mean or not dc.std, "data.std", tuple(dc.std),
         f"must have as many values as data.mean={tuple(dc.mean)!r}")
    need(not model.remat or model.name in models.REMAT_MODELS, "model.remat", model.remat,
         f"applies to {', '.join(models.REMAT_MODELS)} (a model of your own can use "
         "flax.linen.remat on its blocks)")
    need(model.bn_impl == "flax" or model.name in models.BN_MODELS, "model.bn_impl",
         model.bn_impl, f"applies to {', '.join(models.BN_MODELS)} (a model of your own "
         "can use jaxtrain.models.ops.batchnorm.BatchNorm)")
    accumulate, batch = config.train.accumulate_steps, config.train.batch_size
    need(batch % accumulate == 0, "train.accumulate_steps", accumulate,
         f"must divide train.batch_size={batch} (each micro-batch is batch_size / "
         f"accumulate_steps images): one of {divisors(batch)}")
    need(config.parallel.fsdp == 1 or replicas.runs(config) is None, "parallel.fsdp",
         config.parallel.fsdp, "cannot be combined with train.replicas or a sweep (each "
         "replica's parameters are already on their own devices)")
    replicas.check_sweep(config)


def with_absolute_paths(config):
    """A copy of `config` with data.dir, and model.init_from when it is a local file or
    folder, as absolute paths: the run's config.json is then read the same from any
    directory (a resume, --mode=eval, restore). Names ('torchvision:resnet50') and
    URLs stay as they are."""
    import copy
    import os

    def absolute(path: str) -> str:
        return os.path.abspath(os.path.expanduser(path))

    config = copy.deepcopy(config)
    with config.unlocked():
        if config.data.dir and "://" not in config.data.dir:
            config.data.dir = absolute(config.data.dir)
        init_from = config.model.get("init_from", "")
        if init_from and "://" not in init_from and os.path.exists(os.path.expanduser(init_from)):
            config.model.init_from = absolute(init_from)
    return config


def moved_data_dir(saved: dict, config) -> str | None:
    """The data.dir a workdir's run read, when it is gone and `config` reads another one
    (the data moved); else None."""
    import os
    before = saved.get("data", {}).get("dir", "")
    after = config.data.dir
    if before and after and before != after and os.path.isabs(before) \
            and not os.path.exists(before) and os.path.exists(after):
        return before
    return None


# Keys whose change leaves the training trajectory as it was (reporting, evaluation,
# checkpoint policy, how the same batches are read): a resumed run may change them
# (checkpoint. includes checkpoint.allow_recipe_change itself).
RESUMABLE_CHANGES = ("train.log_every_steps", "train.loop", "train.chunk_steps",
                     "train.chunk_seconds",
                     "train.drop_finished_groups",
                     "train.compilation_cache", "train.xla_flags", "callbacks.",
                     "logging.",
                     "checkpoint.", "eval.", "data.placement", "data.device_fraction",
                     "data.workers", "model.remat", "model.pool_impl", "model.conv_impl",
                     "parallel.")


# A parameter group's settings that jaxtrain.config.defaults.param_group added after some runs
# were saved, with the value those runs had.
GROUP_DEFAULTS = {"freeze": False}


def recipe_changes(saved: dict, config) -> list[tuple[str, object, object]]:
    """(key, saved value, new value) of every key whose change alters training, between
    a workdir's config.json and `config`. Keys the saved run did not have are skipped."""
    new = config.to_dict() if hasattr(config, "to_dict") else config

    def flat(tree, prefix=""):
        out = {}
        for name, value in tree.items():
            key = f"{prefix}{name}"
            if isinstance(value, dict) and key not in KWARGS:
                out.update(flat(value, key + ".") or {key: {}})
            else:
                out[key] = tuple(value) if isinstance(value, list) else value
        return out

    old, new = flat(saved), flat(new)
    # With a constant learning rate the run's length shapes nothing: training on past the
    # old end is the run that would have had the new length all along.
    constant = old.get("optimizer.schedule") == new.get("optimizer.schedule") == "constant"
    changes = []
    for key in sorted(set(old) | set(new)):
        if key.startswith(RESUMABLE_CHANGES):
            continue
        if constant and key in ("train.num_steps", "train.num_epochs"):
            continue
        if key == "model.kwargs" and str(new.get("model.name", "")).startswith("instance:"):
            continue  # a record of the instance passed in (which the checkpoint must fit)
        if key not in old and not key.startswith("optimizer.groups."):
            continue  # a key newer than the saved run
        if (key not in old and key.startswith("optimizer.groups.")
                and GROUP_DEFAULTS.get(key.rsplit(".", 1)[1], object()) == new[key]):
            continue  # a group setting newer than the saved run, at its default
        before, after = old.get(key, "(not set)"), new.get(key, "(not set)")
        if key == "train.precision" and resolve_precision(before) == resolve_precision(after):
            continue  # 'auto' is what it computes here
        if _normal(before) != _normal(after):
            changes.append((key, before, after))
    return changes


def _normal(value):
    """JSON's lists are tuples, its ints may stand for floats."""
    if isinstance(value, (list, tuple)):
        return tuple(_normal(v) for v in value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return value
    return float(value)
