"""The run's callbacks assembled, as a trainer assembles them: config.callbacks' entries,
the trackers config.logging names, then those passed from Python. The run knows all
three; jaxtrain.callbacks holds only the callbacks themselves."""
import importlib
import inspect

from jaxtrain.callbacks.trackers import mlflow as mlflow_tracker
from jaxtrain.callbacks.trackers import wandb as wandb_tracker
from jaxtrain.errors import ConfigError

BUILT_IN = "jaxtrain.callbacks"  # where a callback named without a module is found


def import_callback_class(spec: str):
    """'package.module:Class', or a built-in's name ('EarlyStopping')."""
    module_name, _, class_name = spec.rpartition(":") if ":" in spec else (
        BUILT_IN, None, spec)
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"cannot import {module_name!r} ({error}); it must be installed or "
                         "on sys.path (e.g. PYTHONPATH)") from None
    cls = getattr(module, class_name, None)
    if not inspect.isclass(cls):
        raise ValueError(f"module {module_name!r} has no class {class_name!r}")
    return cls


def create(name: str, spec: str, kwargs: dict):
    """config.callbacks.NAME made: the class `spec` names, built with `kwargs`."""
    try:
        cls = import_callback_class(spec)
        return cls(**kwargs)
    except (ValueError, TypeError) as error:
        raise ConfigError(f"config.callbacks.{name}.name={spec!r}: {error}") from None


def from_config(config, given=()) -> list:
    """The run's callbacks: config.callbacks' entries in the order of their names, the
    trackers config.logging names, then those passed from Python."""
    made = []
    for name in config.get("callbacks", {}).keys():
        made.append(create(name, config.callbacks[name].name,
                           callback_kwargs(config.callbacks[name])))
    return made + trackers(config.get("logging", {})) + list(given)


def callback_kwargs(entry) -> dict:
    """A config.callbacks entry's arguments: its keys beside `name`, and (configs saved
    before they were keys of their own) those under `kwargs`."""
    entry = entry.to_dict() if hasattr(entry, "to_dict") else dict(entry)
    return {**entry.pop("kwargs", {}), **{k: v for k, v in entry.items() if k != "name"}}


def describe(callback) -> str:
    return type(callback).__qualname__


def trackers(logging_config) -> list:
    """The trackers config.logging asks for (none: neither tracker's package imported)."""
    made = []
    if logging_config.get("mlflow"):
        made.append(mlflow_tracker.MLflowTracker(logging_config.mlflow,
                                                 logging_config.mlflow_experiment))
    if logging_config.get("wandb"):
        made.append(wandb_tracker.WandbTracker(logging_config.wandb, logging_config.wandb_mode))
    return made
