"""Experiment trackers as callbacks, one per file: MLflow (mlflow.py) and Weights & Biases
(wandb.py), each imported only when its config.logging key is set."""
