"""model.init_from: a run's starting weights from elsewhere, read once at step 0.

Three kinds of source, one result (the model's params and BatchNorm statistics):
- a jaxtrain workdir, or one of its checkpoint step folders: parameters and
  statistics by their Flax paths (not the optimiser state, not the step);
- a PyTorch `state_dict` (.pth/.pt, read with torch.load(weights_only=True), so
  no pickled code ever runs) or a .safetensors file, from torchvision or timm,
  mapped by name onto jaxtrain's ResNets and ViTs (OIHW -> HWIO, linear weights
  transposed, BatchNorm's running statistics into batch_stats);
- a name ('torchvision:resnet50'), downloaded once by jaxtrain.pretrained.

Shapes decide what is kept: the head (the model's last layer) is re-initialised
when its shape differs (another number of classes), a ViT's position table is
resampled for another image size; any other missing, unexpected or misshapen
tensor is a WeightsError naming it and both shapes, before training starts.
"""
import dataclasses
import os
import re

import jax
import numpy as np

from jaxtrain.errors import ConfigError
from jaxtrain.training.optim import param_path

IMAGENET_MEAN = (0.485, 0.456, 0.406)  # what torchvision's and most timm ResNets were trained on
IMAGENET_STD = (0.229, 0.224, 0.225)
TORCH_SUFFIXES = (".pth", ".pt", ".bin")
SAFETENSORS_SUFFIX = ".safetensors"
SHOWN = 4  # tensors an error names before "and N more"


class WeightsError(ConfigError):
    """model.init_from names weights that cannot start this model; one line."""


@dataclasses.dataclass(frozen=True)
class Source:
    """What model.init_from names, before any tensor is read."""
    label: str         # model.init_from as given
    kind: str          # 'jaxtrain' | 'torch' | 'safetensors'
    path: str          # a step folder (jaxtrain) or a file; '' for a name not downloaded yet
    mean: tuple | None  # the normalisation the weights were trained with, when known
    std: tuple | None
    name: str = ""     # a jaxtrain.pretrained name


@dataclasses.dataclass
class Report:
    """What init_from did, for the console and summary.json["init_from"]."""
    source: str
    path: str
    loaded: int = 0                                    # tensors of the source used
    reinitialised: list = dataclasses.field(default_factory=list)  # (path, theirs, ours)
    resampled: list = dataclasses.field(default_factory=list)      # (path, theirs, ours)
    head: str = ""                                     # the model's last layer

    def line(self) -> str:
        parts = [f"initialised from {self.source}: {self.loaded} tensors loaded"]
        parts += [f"re-initialised {'head ' if path == self.head else ''}{path} "
                  f"({_shape(theirs)} -> {_shape(ours)})"
                  for path, theirs, ours in self.reinitialised]
        parts += [f"resampled {path} ({_shape(theirs)} -> {_shape(ours)})"
                  for path, theirs, ours in self.resampled]
        return "; ".join(parts)

    def to_json(self) -> dict:
        def entries(items):
            return [{"tensor": path, "weights": list(theirs), "model": list(ours)}
                    for path, theirs, ours in items]
        return {"source": self.source, "path": self.path, "tensors_loaded": self.loaded,
                "reinitialised": entries(self.reinitialised),
                "resampled": entries(self.resampled)}


def _shape(shape) -> str:
    return "x".join(map(str, shape)) or "scalar"


# ---------------------------------------------------------------- what init_from names

def source(init_from: str) -> Source:
    """The source model.init_from names, checked for existence; reads no tensors and
    downloads nothing (a name's file is fetched by `read`)."""
    from jaxtrain.weights import pretrained
    if pretrained.is_name(init_from):
        entry = pretrained.entry(init_from)
        return Source(init_from, entry.format if entry.format == "safetensors" else "torch", "",
                      tuple(entry.mean), tuple(entry.std), name=init_from)
    path = os.path.expanduser(init_from)
    if os.path.isdir(path):
        step_dir = jaxtrain_step_dir(path, init_from)
        meta = _read_json(os.path.join(step_dir, "meta", "metadata")) or {}
        mean, std = meta.get("mean"), meta.get("std")
        return Source(init_from, "jaxtrain", step_dir, tuple(mean) if mean else None,
                      tuple(std) if std else None)
    if not os.path.isfile(path):
        raise WeightsError(f"config.model.init_from={init_from!r}: no such file or directory "
                           "(a jaxtrain workdir or checkpoint step folder, a .pth/.pt/"
                           ".safetensors file, or a name such as 'torchvision:resnet50')")
    if path.endswith(SAFETENSORS_SUFFIX):
        return Source(init_from, "safetensors", path, IMAGENET_MEAN, IMAGENET_STD)
    if path.endswith(TORCH_SUFFIXES):
        return Source(init_from, "torch", path, IMAGENET_MEAN, IMAGENET_STD)
    raise WeightsError(f"config.model.init_from={init_from!r}: not a weights file jaxtrain "
                       "reads (.pth, .pt, .bin: a PyTorch state_dict; .safetensors) nor a "
                       "jaxtrain workdir")


def check_fits(init_from: str, model_name: str) -> None:
    """Named weights are for one model: say so before anything is downloaded."""
    from jaxtrain.weights import pretrained
    if pretrained.is_name(init_from):
        entry = pretrained.entry(init_from)
        if entry.model != model_name:
            raise WeightsError(f"config.model.init_from={init_from!r} are weights for "
                               f"model.name={entry.model!r}, not {model_name!r}: add "
                               f"--config.model.name={entry.model}")


def jaxtrain_step_dir(path: str, label: str) -> str:
    """A workdir's newest checkpoint step folder, or `path` itself if it is one."""
    if os.path.isdir(os.path.join(path, "state")):
        return path
    checkpoints = os.path.join(path, "checkpoints")
    steps = sorted((int(n) for n in os.listdir(checkpoints) if n.isdigit()
                    and os.path.isdir(os.path.join(checkpoints, n, "state")))
                   if os.path.isdir(checkpoints) else [])
    if not steps:
        raise WeightsError(f"config.model.init_from={label!r}: a folder, but neither a jaxtrain "
                           "workdir with checkpoints nor a checkpoint step folder (no "
                           "checkpoints/<step>/state inside)")
    return os.path.join(checkpoints, str(steps[-1]))


def _read_json(path: str):
    import json
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


# ---------------------------------------------------------------- readers

def read(src: Source, cache_dir: str = "~/.cache/jaxtrain") -> tuple[dict, str]:
    """The source's tensors as float32/int NumPy arrays, and their layout: 'flax'
    (keys 'params/Conv_0/kernel') or 'torch' (keys 'conv1.weight')."""
    path = src.path
    if src.name:
        from jaxtrain.weights import pretrained
        path, _ = pretrained.resolve(src.name, cache_dir=cache_dir)
    if src.kind == "jaxtrain":
        return read_jaxtrain(path, src.label), "flax"
    if src.kind == "safetensors":
        return read_safetensors(path, src.label), "torch"
    return read_torch(path, src.label), "torch"


def read_torch(path: str, label: str) -> dict:
    """A torch.save'd state_dict, read with weights_only=True: a file holding anything but
    tensors (and the containers and numbers state_dicts use) is refused unread."""
    try:
        import torch
    except ImportError:
        raise WeightsError(f"config.model.init_from={label!r}: reading a PyTorch file needs "
                           "torch (pip install 'jaxtrain[compare]'), or give a .safetensors "
                           "copy") from None
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # UnpicklingError for code, RuntimeError/EOFError for damage
        reason = str(error).strip().splitlines()[0] if str(error).strip() else ""
        if "weights_only" in str(error) or "Unsupported global" in str(error):
            raise WeightsError(f"config.model.init_from={label!r}: refused, it holds pickled "
                               "objects other than tensors (read with weights_only=True, so "
                               "nothing in it ran)") from None
        raise WeightsError(f"config.model.init_from={label!r}: not a readable PyTorch file "
                           f"({type(error).__name__}: {reason[:200]})") from None
    state_dict = _unwrap(loaded)
    if not isinstance(state_dict, dict) or not state_dict or not all(
            isinstance(v, torch.Tensor) for v in state_dict.values()):
        raise WeightsError(f"config.model.init_from={label!r}: holds a "
                           f"{type(loaded).__name__}, not a state_dict of tensors")
    return {_strip(k): v.detach().float().numpy() if v.is_floating_point() else v.numpy()
            for k, v in state_dict.items()}


def _unwrap(loaded):
    """The state_dict inside the usual training-script wrappers ({'state_dict': ...},
    {'model': ...})."""
    for key in ("state_dict", "model", "model_state_dict"):
        if isinstance(loaded, dict) and isinstance(loaded.get(key), dict):
            return loaded[key]
    return loaded


def _strip(key: str) -> str:
    """DistributedDataParallel's and torch.compile's prefixes off a key."""
    for prefix in ("module.", "_orig_mod."):
        if key.startswith(prefix):
            key = key[len(prefix):]
    return key


def read_safetensors(path: str, label: str) -> dict:
    try:
        from safetensors import SafetensorError
        from safetensors.numpy import load_file
    except ImportError:
        raise WeightsError(f"config.model.init_from={label!r}: reading .safetensors needs "
                           "the safetensors package (pip install 'jaxtrain[weights]')") from None
    try:
        tensors = load_file(path)
    except (SafetensorError, OSError, ValueError, TypeError) as error:
        if "bf16" in str(error).lower() or "bfloat16" in str(error).lower():
            return _read_safetensors_torch(path, label)
        raise WeightsError(f"config.model.init_from={label!r}: not a readable .safetensors "
                           f"file ({error})") from None
    return {_strip(k): v.astype(np.float32) if v.dtype.kind == "f" else v
            for k, v in tensors.items()}


def _read_safetensors_torch(path: str, label: str) -> dict:
    """bfloat16 tensors (which NumPy has no type for) through torch."""
    from safetensors.torch import load_file
    return {_strip(k): v.float().numpy() for k, v in load_file(path).items()}


def read_jaxtrain(step_dir: str, label: str) -> dict:
    """params and batch_stats of a jaxtrain checkpoint step folder, by '/'-joined path."""
    import orbax.checkpoint as ocp

    from jaxtrain.training import checkpoint
    quiet = checkpoint.QuietAbandonedReads()
    try:
        tree = ocp.StandardCheckpointer().restore(os.path.abspath(os.path.join(step_dir, "state")))
    except Exception as error:  # re-raised below unless it is damage (damage())
        cause = checkpoint.damage(error)
        if cause is None:
            raise
        raise WeightsError(f"config.model.init_from={label!r}: checkpoint {step_dir} cannot be "
                           f"read ({type(cause).__name__}: {checkpoint.first_line(cause)[:200]})"
                           ) from None
    quiet.remove()
    tensors = {}
    for collection in ("params", "batch_stats"):
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree.get(collection) or {}):
            tensors[f"{collection}/{param_path(path)}"] = np.asarray(leaf)
    return tensors


# ---------------------------------------------------------------- torch names -> Flax paths

BN_LEAVES = {"weight": ("params", "scale"), "bias": ("params", "bias"),
             "running_mean": ("batch_stats", "mean"), "running_var": ("batch_stats", "var")}
IGNORED_TORCH_KEYS = ("num_batches_tracked",)


def torch_paths(model_name: str, params) -> dict:
    """{torch state_dict key: 'collection/flax/path'} for model_name's built-in model,
    whose params tree (shapes suffice) is `params`."""
    from jaxtrain.models import resnet
    if model_name in resnet.RESNETS:
        return resnet_torch_paths(params)
    if model_name.startswith("vit_"):
        from jaxtrain.models import vit
        return {key: "params/" + "/".join(path) for key, path in vit.torch_paths(params).items()}
    raise WeightsError(f"config.model.init_from: PyTorch weights map onto the ResNets and "
                       f"ViTs (torchvision's and timm's names), not model.name={model_name!r}; "
                       "start it from a jaxtrain workdir instead")


def resnet_torch_paths(params) -> dict:
    """torchvision's (and timm's) ResNet names: conv1/bn1, layer{stage}.{block}.conv{i}/bn{i}
    and downsample.0/1, fc -> jaxtrain's ResNet: Conv_0/BatchNorm_0, its blocks in order,
    each branch's Conv_i/BatchNorm_i then the projection's, Dense_0."""
    blocks = sorted((name for name in params if "ResNetBlock_" in name),
                    key=lambda name: int(name.rsplit("_", 1)[1]))
    stage_sizes = _stage_sizes(params, blocks)
    modules = {"conv1": ("conv", "Conv_0"), "bn1": ("bn", "BatchNorm_0"), "fc": ("dense", "Dense_0")}
    index = 0
    for stage, size in enumerate(stage_sizes):
        for block in range(size):
            name = blocks[index]
            index += 1
            branch = 3 if name.startswith("Bottleneck") else 2
            prefix = f"layer{stage + 1}.{block}."
            for i in range(branch):
                modules[f"{prefix}conv{i + 1}"] = ("conv", f"{name}/Conv_{i}")
                modules[f"{prefix}bn{i + 1}"] = ("bn", f"{name}/BatchNorm_{i}")
            if f"Conv_{branch}" in params[name]:
                modules[f"{prefix}downsample.0"] = ("conv", f"{name}/Conv_{branch}")
                modules[f"{prefix}downsample.1"] = ("bn", f"{name}/BatchNorm_{branch}")
    paths = {}
    for module, (kind, flax) in modules.items():
        if kind == "bn":
            for leaf, (collection, name) in BN_LEAVES.items():
                paths[f"{module}.{leaf}"] = f"{collection}/{flax}/{name}"
        else:
            paths[f"{module}.weight"] = f"params/{flax}/kernel"
            if kind == "dense":
                paths[f"{module}.bias"] = f"params/{flax}/bias"
    return paths


def _stage_sizes(params, blocks) -> list:
    """Blocks per stage, read off the tree: a stage starts at each block with a
    projection shortcut after the first stage's start (ResNets' stride-2 blocks)."""
    from jaxtrain.models import resnet
    for stage_sizes, block_cls in resnet.RESNETS.values():
        if sum(stage_sizes) == len(blocks) and blocks[0].startswith(block_cls.__name__ + "_"):
            return list(stage_sizes)
    return [len(blocks)]


def torch_value(array: np.ndarray, flax_path: str) -> np.ndarray:
    """A torch tensor in Flax's layout: conv kernels OIHW -> HWIO, dense kernels
    (out, in) -> (in, out); everything else as it is."""
    if flax_path.endswith("/kernel"):
        if array.ndim == 4:
            return np.transpose(array, (2, 3, 1, 0))
        if array.ndim == 2:
            return array.T
    return array


# ---------------------------------------------------------------- onto the model

def head_name(model, image_shape) -> str:
    """The top-level layer the model calls last: its head. (The params tree cannot
    tell: jax sorts a dict's keys, so 'pos_embed' would follow a ViT's 'head'.)"""
    import flax.linen as nn

    from jaxtrain import models
    order = []

    def record(next_fun, args, kwargs, context):
        path = getattr(context.module, "path", ())
        if context.method_name == "__call__" and len(path) >= 1:
            order.append(path[0])
        return next_fun(*args, **kwargs)

    with nn.intercept_methods(record):
        jax.eval_shape(lambda: models.init_variables(model, jax.random.key(0), image_shape))
    return order[-1] if order else ""


def apply(tensors: dict, layout: str, variables: dict, model_name: str, label: str,
          path: str = "", image_shape=None, head: str = "", exclude: str = "") -> tuple[dict, Report]:
    """What of the source's tensors goes where: {'collection/flax/path': array} for every
    leaf of `variables` ({'params', 'batch_stats'} of the model; shapes suffice) that the
    weights fill, and the Report. The head (the top-level layer named `head`, see
    head_name) keeps its fresh init where its shape differs, and so does every leaf whose
    path ('Dense_0/kernel', 'BatchNorm_3/mean') the regular expression `exclude`
    (model.init_from_exclude) matches; anything else that does not fit raises
    WeightsError."""
    params = variables["params"]
    ours = {f"{collection}/{param_path(p)}": leaf for collection in ("params", "batch_stats")
            for p, leaf in jax.tree_util.tree_leaves_with_path(variables.get(collection) or {})}
    if layout == "torch":
        names = torch_paths(model_name, params)
        tensors = {k: v for k, v in tensors.items() if not k.endswith(IGNORED_TORCH_KEYS)}
        unexpected = sorted((k for k in tensors if k not in names), key=_natural)
        converted = {names[k]: (k, torch_value(v, names[k])) for k, v in tensors.items()
                     if k in names}
    else:
        unexpected = sorted((k for k in tensors if k not in ours), key=_natural)
        converted = {k: (k, v) for k, v in tensors.items() if k in ours}
    in_head = lambda key: key.startswith("params/") and key.split("/")[1] == head
    pattern = re.compile(exclude) if exclude else None
    excluded = lambda key: pattern is not None and pattern.fullmatch(key.split("/", 1)[1])
    if pattern is not None and not any(excluded(k) for k in ours):
        raise WeightsError(f"config.model.init_from_exclude={exclude!r} matches no parameter "
                           f"or statistic of model.name={model_name!r} (e.g. "
                           + ", ".join(k.split("/", 1)[1] for k in list(ours)[-2:]) + ")")
    missing = sorted((k for k in ours if k not in converted and not excluded(k)), key=_natural)
    report = Report(label, path, head=head)
    overrides, wrong = {}, []
    for key, leaf in ours.items():
        if key not in converted:
            continue
        theirs_key, value = converted[key]
        shape = tuple(leaf.shape)
        if excluded(key):
            report.reinitialised.append((key.split("/", 1)[1], tuple(value.shape), shape))
        elif tuple(value.shape) == shape:
            overrides[key] = value.astype(leaf.dtype)
            report.loaded += 1
        elif key.endswith("/pos_embed") and value.ndim == 3 and value.shape[-1] == shape[-1]:
            from jaxtrain.models import vit
            overrides[key] = vit.resample_pos_embed(
                value, _grid(shape[1] - 1, image_shape)).astype(leaf.dtype)
            report.loaded += 1
            report.resampled.append((key.split("/", 1)[1], tuple(value.shape), shape))
        elif in_head(key):
            report.reinitialised.append((key.split("/", 1)[1], tuple(value.shape), shape))
        else:
            wrong.append(f"{theirs_key} is {_shape(tensors[theirs_key].shape)} there, {key} "
                         f"is {_shape(shape)} here")
    problems = []
    if wrong:
        problems.append("shapes differ: " + _listed(wrong))
    if missing and not all(in_head(k) for k in missing):
        problems.append("missing in the weights: " + _listed(
            [f"{k} ({_shape(ours[k].shape)})" for k in missing]))
    if unexpected:
        problems.append("not in the model: " + _listed(
            [f"{k} ({_shape(tensors[k].shape)})" for k in unexpected]))
    if problems:
        raise WeightsError(f"config.model.init_from={label!r} does not fit model.name="
                           f"{model_name!r}: " + "; ".join(problems))
    report.reinitialised = by_layer(report.reinitialised + [
        (k.split("/", 1)[1], (), tuple(ours[k].shape)) for k in missing])  # the head's only
    return overrides, report


def by_layer(entries: list) -> list:
    """One (layer, theirs, ours) entry per re-initialised layer: its kernel's shapes (else
    its first leaf's) stand for it, as 'Dense_0 (2048x1000 -> 2048x5)' does."""
    layers = {}
    for path, theirs, ours in entries:
        layer, leaf = path.rsplit("/", 1) if "/" in path else (path, "")
        if layer not in layers or leaf == "kernel":
            layers[layer] = (layer, theirs, ours)
    return sorted(layers.values(), key=lambda entry: _natural("params/" + entry[0]))


def _grid(tokens: int, image_shape=None, patch: int = 16) -> tuple[int, int]:
    """A ViT's patch grid: from the image's size, else taken to be square."""
    if image_shape is not None:
        return (image_shape[0] // patch, image_shape[1] // patch)
    side = int(round(tokens ** 0.5))
    return (side, tokens // side)


def _natural(key: str):
    """Parameters before statistics, then layers in the model's order (Block_2 before
    Block_10)."""
    return (not key.startswith("params/"),
            [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", key)])


def _listed(items: list) -> str:
    shown = ", ".join(items[:SHOWN])
    return shown + (f" and {len(items) - SHOWN} more" if len(items) > SHOWN else "")


def initialise(init_from: str, model, variables: dict, model_name: str, image_shape,
               exclude: str = "", cache_dir: str = "~/.cache/jaxtrain") -> tuple[dict, Report]:
    """read + apply: model.init_from's tensors by the Flax path they fill, and the Report.
    `variables`: the model's (abstract) init; `image_shape`: (H, W, C) of its input;
    `exclude`: model.init_from_exclude."""
    src = source(init_from)
    tensors, layout = read(src, cache_dir)
    return apply(tensors, layout, variables, model_name, init_from, src.path or src.name,
                 image_shape, head_name(model, image_shape), exclude)


def preprocessing(init_from: str):
    """(mean, std) the weights were trained with, or None: never raises and reads no
    tensor, so a resumed run (which reads no weights) normalises as its first start did."""
    from jaxtrain.weights import pretrained
    try:
        if pretrained.is_name(init_from):
            entry = pretrained.entry(init_from)
            return tuple(entry.mean), tuple(entry.std)
        if init_from.endswith(TORCH_SUFFIXES + (SAFETENSORS_SUFFIX,)):
            return IMAGENET_MEAN, IMAGENET_STD
        src = source(init_from)
    except ConfigError:
        return None
    return (src.mean, src.std) if src.mean and src.std else None
