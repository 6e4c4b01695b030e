"""The defaults every recipe here starts from: jaxtrain/config/defaults.py, which lists every key
with a comment. They live in the package so that an installed jaxtrain has them too."""
from jaxtrain.config.defaults import callback, get_config, param_group  # noqa: F401
