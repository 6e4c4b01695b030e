"""Callbacks: your own behaviour in a run (the interface, base.py), the built-in
EarlyStopping, and the experiment trackers (trackers/). The names below are what a
callback subclasses, raises or is given; a config names a built-in by its bare name."""
from jaxtrain.callbacks.base import Callback, CallbackError, RunInfo, StopTraining
from jaxtrain.callbacks.early_stopping import EarlyStopping

__all__ = ["Callback", "CallbackError", "EarlyStopping", "RunInfo", "StopTraining"]
