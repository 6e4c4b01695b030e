"""Your own model: a Flax Linen or NNX module, named in the config or passed in.

    config.model.name = "mypackage.models:MyNet"   # imported; built with model.kwargs
    jaxtrain.train_and_evaluate(config, workdir, model=MyNet(...))   # or an instance

The module takes `(x, train)` (x: normalised float images, N, H, W, C) and
returns logits. A Linen class is built as `Class(num_classes=..., **model.kwargs)`,
plus `dtype=` (the compute dtype of train.precision) when it has such a field.
An NNX class is built the same way inside Flax's Linen bridge
(`flax.nnx.bridge.to_linen`), which supplies its `rngs`; its BatchNorm
statistics land in the 'batch_stats' collection, so the rest of jaxtrain
(the compiled step, checkpoints, inference) treats both alike. Since the name
is saved in the run's config, `jaxtrain.restore` imports the class again in a
fresh process (it must be importable there: installed, or on sys.path).
"""
import dataclasses
import importlib
import inspect

import flax.linen as nn
import jax.numpy as jnp

# flax.nnx is imported where a user's model needs it: it imports IPython where installed
# (to ask whether it runs in a notebook), a large part of every process's start.

# model.name recorded for a run trained on a module instance (train_and_evaluate(model=...)):
# not importable, since its constructor arguments are not known; restore needs it again.
INSTANCE_PREFIX = "instance:"


def is_user_model(name: str) -> bool:
    """'package.module:ClassName' names a model to import."""
    return ":" in name


def instance_name(module) -> str:
    """The model.name a run on a module instance records: 'instance:module:Class'."""
    cls = type(module)
    return f"{INSTANCE_PREFIX}{cls.__module__}:{cls.__qualname__}"


def instance_kwargs(module) -> dict:
    """What a Linen instance was built with, as far as JSON holds it (its dataclass fields
    but num_classes, dtype and Flax's own): recorded as model.kwargs, so that its class,
    when importable, is built the same again (an NNX instance keeps no such record)."""
    if not (isinstance(module, nn.Module) and dataclasses.is_dataclass(module)):
        return {}
    plain = (bool, int, float, str, type(None))
    kwargs = {}
    for field in dataclasses.fields(module):
        value = getattr(module, field.name, None)
        if (field.init and field.name not in ("parent", "name", "num_classes", "dtype")
                and (isinstance(value, plain) or isinstance(value, (tuple, list))
                     and all(isinstance(v, plain) for v in value))):
            kwargs[field.name] = value
    return kwargs


PASS_IT_AGAIN = ("pass it again: jaxtrain.restore(workdir, model=...), or on the command "
                 "line --model=package.module:ClassName")


def import_model_class(spec: str):
    """The class 'package.module:ClassName' names (also 'instance:...', the class of an
    instance a run was given); a ValueError says what is wrong."""
    if spec.startswith(INSTANCE_PREFIX):
        try:
            return import_model_class(spec[len(INSTANCE_PREFIX):])
        except ValueError as error:
            raise ValueError(f"this run trained a model passed from Python "
                             f"({spec[len(INSTANCE_PREFIX):]}), whose class cannot be "
                             f"imported here ({error}): {PASS_IT_AGAIN}") from None
    module_name, _, class_name = spec.partition(":")
    if not module_name or not class_name:
        raise ValueError(f"model.name={spec!r}: expected 'package.module:ClassName'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"model.name={spec!r}: cannot import {module_name!r} ({error}); it "
                         "must be installed or on sys.path (e.g. PYTHONPATH)") from None
    cls = getattr(module, class_name, None)
    if cls is None:
        raise ValueError(f"model.name={spec!r}: module {module_name!r} has no {class_name!r}")
    from flax import nnx
    if not (inspect.isclass(cls) and issubclass(cls, (nn.Module, nnx.Module))):
        raise ValueError(f"model.name={spec!r}: {class_name} is not a Flax Linen or NNX module "
                         "class")
    return cls


def _accepts(cls, name: str) -> bool:
    if dataclasses.is_dataclass(cls) and name in {f.name for f in dataclasses.fields(cls)}:
        return True
    try:  # __init__'s own: an NNX class's metaclass call takes (*args, **kwargs)
        parameters = inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        return False
    return name in parameters or any(p.kind == p.VAR_KEYWORD for p in parameters.values())


def argument_names(cls) -> tuple[list[str], bool]:
    """(the names a model class is built with, whether it takes any name: **kwargs): a
    Linen class's dataclass fields (not Flax's own parent and name), an NNX class's
    __init__ parameters (not rngs, which the bridge supplies)."""
    if dataclasses.is_dataclass(cls):
        return [f.name for f in dataclasses.fields(cls) if f.init
                and f.name not in ("parent", "name")], False
    try:
        parameters = inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        return [], True
    names = [name for name, p in parameters.items() if name not in ("self", "rngs")
             and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    return names, any(p.kind == p.VAR_KEYWORD for p in parameters.values())


def build(cls, num_classes: int, dtype, kwargs: dict) -> nn.Module:
    """A Linen module from a Linen or NNX class (see the module docstring)."""
    kwargs = dict(kwargs)
    if "num_classes" not in kwargs and _accepts(cls, "num_classes"):
        kwargs["num_classes"] = num_classes
    if "dtype" not in kwargs and _accepts(cls, "dtype"):
        kwargs["dtype"] = dtype
    from flax import nnx
    try:
        if issubclass(cls, nnx.Module):
            return nnx.bridge.to_linen(cls, **kwargs)
        return cls(**kwargs)
    except TypeError as error:
        raise ValueError(f"{cls.__module__}.{cls.__name__}: cannot be built with "
                         f"{sorted(kwargs)} ({error}); set model.kwargs") from None


def from_instance(module) -> nn.Module:
    """A Linen module from a module instance: a Linen one as it is, an NNX one (its
    parameters already initialised) through the bridge, its random streams drawn afresh
    from each call's 'dropout' key (see reseeded_copy)."""
    if isinstance(module, nn.Module):
        return module
    from flax import nnx
    if isinstance(module, nnx.Module):
        graphdef, state = nnx.split(module)
        return nnx.bridge.to_linen(lambda rngs: reseeded_copy(graphdef, state, rngs))
    raise TypeError(f"model={type(module).__name__}: expected a Flax Linen or NNX module")


def reseeded_copy(graphdef, state, rngs):
    """A fresh copy of an NNX instance (the bridge must not mutate the caller's object)
    whose random streams draw from `rngs`' 'dropout' stream, the bridge's for the call.

    The bridge keeps no stream state between calls, so the instance's own streams (its
    nnx.Dropout's, forked from the Rngs it was built with) would give the same mask at
    every step. Each of its streams, whatever its name (nnx.Rngs(0) names them all
    'default'), instead takes the next key of the 'dropout' stream: the step's dropout key,
    as a class built by the bridge gets it, so that two dropout layers still differ. A
    call without a 'dropout' key (evaluation) keeps the instance's streams."""
    from flax import nnx
    module = nnx.merge(graphdef, state, copy=True)
    if "dropout" in rngs:
        for _, stream in nnx.iter_graph(module):
            if isinstance(stream, nnx.RngStream):
                stream.key.set_value(rngs.dropout())
                stream.count.set_value(jnp.zeros((), jnp.uint32))
    return module


def create(model_config, num_classes: int, dtype) -> nn.Module:
    """models.create_model for a 'package.module:ClassName' model.name."""
    kwargs = model_config.get("kwargs", {})
    kwargs = kwargs.to_dict() if hasattr(kwargs, "to_dict") else dict(kwargs)
    return build(import_model_class(model_config.name), num_classes, dtype, kwargs)
