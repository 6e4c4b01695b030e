"""The recipes from Python: a config by a recipe's name (the files of configs/, shipped in
the package as jaxtrain.recipes) or by a config file's path, as `--config=` loads it."""
import importlib.util
import os

import ml_collections

from jaxtrain.errors import ConfigError

RECIPES_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                           "recipes")  # configs/, in an installed package as in a checkout


def names() -> list[str]:
    """The recipes' names: load() takes each."""
    return sorted(name[:-3] for name in os.listdir(RECIPES_DIR)
                  if name.endswith(".py") and not name.startswith("_"))


def load(recipe: str) -> ml_collections.ConfigDict:
    """The config of `recipe`: a recipe's name ('fashion_mnist_mlp'; names()) or the path
    of a file with get_config(). Change its keys as attributes, then pass it to
    jaxtrain.train_and_evaluate."""
    path = recipe if recipe.endswith(".py") else os.path.join(RECIPES_DIR, f"{recipe}.py")
    if not os.path.isfile(path):
        if recipe.endswith(".py"):
            raise ConfigError(f"no config file {os.path.abspath(path)}")
        raise ConfigError(f"no recipe named {recipe!r}: jaxtrain's recipes are "
                          f"{', '.join(names())} (or give a config file's path)")
    spec = importlib.util.spec_from_file_location(
        f"jaxtrain_config_{os.path.basename(path)[:-3]}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not callable(getattr(module, "get_config", None)):
        raise ConfigError(f"{path}: a config file defines get_config(), this one does not")
    return module.get_config()
