"""jaxtrain: fast, ordinary training of Flax models on GPUs."""
from jaxtrain.checkpoint import CheckpointError
from jaxtrain.data import DataError, Dataset, load
from jaxtrain.inference import Classifier, restore
from jaxtrain.train import (ConfigError, Interrupted, TrainingError, evaluate_checkpoint,
                            train_and_evaluate)

__all__ = ["CheckpointError", "Classifier", "ConfigError", "DataError", "Dataset",
           "Interrupted", "TrainingError", "evaluate_checkpoint", "load", "restore",
           "train_and_evaluate"]
