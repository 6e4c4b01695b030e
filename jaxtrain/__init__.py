"""jaxtrain: fast, ordinary training of Flax models on GPUs."""
from jaxtrain.data import DataError, Dataset, load
from jaxtrain.train import ConfigError, TrainingError, train_and_evaluate

__all__ = ["ConfigError", "DataError", "Dataset", "TrainingError", "load", "train_and_evaluate"]
