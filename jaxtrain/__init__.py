"""jaxtrain: fast, ordinary training of Flax models on GPUs."""
from jaxtrain import parallel
from jaxtrain.checkpoint import CheckpointError
from jaxtrain.data import DataError, Dataset, load
from jaxtrain.inference import Classifier, restore
from jaxtrain.parallel import DistributedError
from jaxtrain.train import (ConfigError, Interrupted, TrainingError, evaluate_checkpoint,
                            train_and_evaluate)

__all__ = ["CheckpointError", "Classifier", "ConfigError", "DataError", "Dataset",
           "DistributedError", "Interrupted", "TrainingError", "evaluate_checkpoint", "load",
           "parallel", "restore", "train_and_evaluate"]
