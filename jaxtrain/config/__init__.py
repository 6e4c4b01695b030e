"""What a run is asked to do: every config key with its default (defaults.py), the checks
that run once, where a run or a command starts (checks.py), and the recipes by name from
Python (recipes.py: jaxtrain.config.load)."""
from jaxtrain.config.recipes import load, names

__all__ = ["load", "names"]
