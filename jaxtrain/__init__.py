"""jaxtrain: fast, ordinary training of Flax models on GPUs.

The names below are imported on first use: a Grain worker process that only
reads data (jaxtrain.input) then never imports Flax, optax or the models.
"""
import importlib
import importlib.util

_EXPORTS = {
    "Callback": "jaxtrain.callbacks", "CallbackError": "jaxtrain.callbacks",
    "CheckpointError": "jaxtrain.checkpoint", "Classifier": "jaxtrain.inference",
    "ConfigError": "jaxtrain.errors", "DataError": "jaxtrain.data", "Dataset": "jaxtrain.data",
    "DistributedError": "jaxtrain.parallel", "EarlyStopping": "jaxtrain.callbacks",
    "Interrupted": "jaxtrain.signals", "RunInfo": "jaxtrain.callbacks",
    "StopTraining": "jaxtrain.callbacks",
    "TrainingError": "jaxtrain.errors", "evaluate_checkpoint": "jaxtrain.evaluation",
    "load": "jaxtrain.data", "restore": "jaxtrain.inference",
    "train_and_evaluate": "jaxtrain.loop",
}
__all__ = sorted([*_EXPORTS, "parallel"])


def __getattr__(name):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    elif importlib.util.find_spec(f"jaxtrain.{name}") is not None:  # jaxtrain.train, ...
        value = importlib.import_module(f"jaxtrain.{name}")
    else:
        raise AttributeError(f"module 'jaxtrain' has no attribute {name!r}")
    globals()[name] = value
    return value
