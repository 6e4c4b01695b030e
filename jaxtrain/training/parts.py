"""The parts of a run a user brings besides the config's numbers: the model, the
optimiser, the loss and the augmentation, each passed from Python
(train_and_evaluate(model=, optimizer=, loss=, augment=)) or named in the config
(model.name, optimizer.name, train.loss, augment.fn). They enter where a run starts as
one object, Parts; prepare.setup resolves them once, and from there the optimiser is in
the state, the loss and the augmentation in the compiled step and the evaluation.

A part passed from Python is recorded in the run's config as 'python:module:qualname'
(it cannot be rebuilt from a name in another process): resuming such a run needs it
passed again; inference (jaxtrain.restore) needs none of them."""
import dataclasses
import importlib
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxtrain.errors import ConfigError
from jaxtrain.training import losses, replicas

PYTHON = "python:"


@dataclasses.dataclass(frozen=True)
class Parts:
    """What a user passed from Python; None: the config's choice."""
    model: Any = None  # a Flax Linen or NNX module instance
    optimizer: Any = None  # an optax.GradientTransformation, or fn(learning_rate) -> one
    loss: Any = None  # fn(logits, targets) -> (N,) losses
    augment: Any = None  # fn(images, key) -> images: float32 (N, H, W, C) in [0, 1]

    def __post_init__(self):
        if self.optimizer is not None and not (
                isinstance(self.optimizer, optax.GradientTransformation)
                or callable(self.optimizer)):
            raise TypeError(f"optimizer={self.optimizer!r}: expected an "
                            "optax.GradientTransformation or a function of the learning rate "
                            "returning one")
        for name in ("loss", "augment"):
            value = getattr(self, name)
            if value is not None and not callable(value):
                raise TypeError(f"{name}={value!r}: expected a function")


def python_name(part) -> str:
    """'python:module:qualname' of a function (or of a transformation's init function)."""
    if isinstance(part, optax.GradientTransformation):
        part = part.init
    module = getattr(part, "__module__", None) or type(part).__module__
    name = getattr(part, "__qualname__", None) or type(part).__qualname__
    return f"{PYTHON}{module}:{name}"


def record(config, parts: Parts) -> None:
    """Names the parts passed from Python in `config` (the run's copy), so that the run's
    saved config says what it trained with and a resume can tell when they differ."""
    with config.unlocked():
        if parts.optimizer is not None:
            config.optimizer.name = python_name(parts.optimizer)
        if parts.loss is not None:
            config.train.loss = python_name(parts.loss)
        if parts.augment is not None:
            config.augment.fn = python_name(parts.augment)


def is_function_name(name: str) -> bool:
    """'package.module:function' (not a recorded 'python:...' name)."""
    return ":" in name and not name.startswith(PYTHON)


def import_function(key: str, spec: str):
    """The function 'package.module:function' names; a ConfigError naming `key` says
    what is wrong."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ConfigError(f"config.{key}={spec!r}: expected 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ConfigError(f"config.{key}={spec!r}: cannot import {module_name!r} ({error}); it "
                          "must be installed or on sys.path (e.g. PYTHONPATH)") from None
    function = getattr(module, attribute, None)
    if not callable(function):
        raise ConfigError(f"config.{key}={spec!r}: module {module_name!r} has no function "
                          f"{attribute!r}")
    return function


def pass_it_again(key: str, name: str, argument: str) -> ConfigError:
    return ConfigError(f"config.{key}={name!r}: this run was given its {argument} from Python; "
                       f"pass it again (train_and_evaluate(..., {argument}=...)) to resume or "
                       "evaluate it, or name one in the config")


# What a sweep may vary of an optimiser passed from Python: the schedule it is given.
SWEEPS_OF_A_PASSED_OPTIMIZER = ("optimizer.learning_rate", "train.label_smoothing")


def optimizer(config, parts: Parts):
    """The optimiser passed from Python, or None when optimizer.name names one. The
    config's settings of the built-in optimisers do not reach one passed in: a weight
    decay, or a sweep of any of them, would be silently lost, so they stop here."""
    opt = config.optimizer
    if parts.optimizer is None:
        if opt.name.startswith(PYTHON):
            raise pass_it_again("optimizer.name", opt.name, "optimizer")
        return None
    if opt.weight_decay:
        raise ConfigError(f"config.optimizer.weight_decay={opt.weight_decay!r}: an optimiser "
                          "passed from Python brings its own weight decay (its weight_decay "
                          "argument, or optax.add_decayed_weights); set it to 0")
    swept = [key for key in replicas.sweep_values(config)
             if key not in SWEEPS_OF_A_PASSED_OPTIMIZER]
    if swept:
        raise ConfigError(f"config.sweep.{swept[0]}: an optimiser passed from Python takes "
                          "only the learning rate from the config; sweep "
                          + " or ".join(SWEEPS_OF_A_PASSED_OPTIMIZER))
    return parts.optimizer


def loss(train_config, parts: Parts, num_classes: int):
    """The run's loss, fn(logits, targets) -> (N,), checked on a batch's shapes."""
    name = train_config.get("loss", "softmax_xent")
    if parts.loss is not None:
        fn, what = parts.loss, "loss"
    elif name.startswith(PYTHON):
        raise pass_it_again("train.loss", name, "loss")
    elif is_function_name(name):
        fn, what = import_function("train.loss", name), f"config.train.loss={name!r}"
    else:
        return losses.built_in(name, train_config.get("focal_gamma", 2.0))
    losses.check(fn, num_classes, what)
    return fn


def augmentation(augment_config, parts: Parts, image_shape):
    """The user's augmentation, fn(images, key) -> images, checked on a batch's shapes;
    None when there is none."""
    name = augment_config.get("fn", "")
    if parts.augment is not None:
        fn, what = parts.augment, "augment"
    elif name.startswith(PYTHON):
        raise pass_it_again("augment.fn", name, "augment")
    elif name:
        fn, what = import_function("augment.fn", name), f"config.augment.fn={name!r}"
    else:
        return None
    images = jax.ShapeDtypeStruct((2, *image_shape), jnp.float32)
    try:
        out = jax.eval_shape(fn, images, jax.eval_shape(lambda: jax.random.key(0)))
    except TypeError as error:  # its arguments, or a value it cannot trace (JAX's TypeErrors)
        raise ConfigError(f"{what}: cannot be traced on float32 images of shape "
                          f"{images.shape} and a key: {type(error).__name__}: "
                          f"{str(error).splitlines()[0] if str(error) else ''}") from None
    if getattr(out, "shape", None) != images.shape or getattr(out, "dtype", None) != jnp.float32:
        got = (f"{out.dtype} {out.shape}" if hasattr(out, "shape") else type(out).__name__)
        raise ConfigError(f"{what}: returned {got} for float32 images of shape "
                          f"{images.shape}; expected the same shape and dtype (float32 "
                          "(N, H, W, C) in [0, 1])")
    return fn
