"""jaxtrain: fast, ordinary training of Flax models on GPUs.

The names below are imported on first use: a Grain worker process that only
reads data (jaxtrain.training.batches) then never imports Flax, optax or the models.
"""
import importlib
import importlib.util

_EXPORTS = {
    "Callback": "jaxtrain.callbacks", "CallbackError": "jaxtrain.callbacks",
    "CheckpointError": "jaxtrain.training.checkpoint",
    "Classifier": "jaxtrain.inference.classifier",
    "ConfigError": "jaxtrain.errors", "DataError": "jaxtrain.data", "Dataset": "jaxtrain.data",
    "DistributedError": "jaxtrain.runtime.processes", "EarlyStopping": "jaxtrain.callbacks",
    "Interrupted": "jaxtrain.runtime.signals", "RunInfo": "jaxtrain.callbacks",
    "StopTraining": "jaxtrain.callbacks",
    "TrainingError": "jaxtrain.errors", "evaluate_checkpoint": "jaxtrain.evaluate",
    "history": "jaxtrain.runtime.report", "load": "jaxtrain.data",
    "restore": "jaxtrain.inference.classifier", "train_and_evaluate": "jaxtrain.run.loop",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    elif importlib.util.find_spec(f"jaxtrain.{name}") is not None:  # jaxtrain.training, ...
        value = importlib.import_module(f"jaxtrain.{name}")
    else:
        raise AttributeError(f"module 'jaxtrain' has no attribute {name!r}")
    globals()[name] = value
    return value
