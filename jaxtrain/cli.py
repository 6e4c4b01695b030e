"""Command-line glue shared by main.py, `python -m jaxtrain.compare` and `jaxtrain.bench`."""
import importlib.util
import os
import sys

from absl import flags


def parse_flags(argv):
    """absl flag parsing (for app.run's flags_parser), with one-line errors: a bad value
    names its flag, an unknown --config key is named with the nearest known one."""
    try:
        return flags.FLAGS(argv)
    except flags.Error as error:
        sys.exit(f"error: {error}")
    except (AttributeError, KeyError) as error:  # ml_collections: no such key
        sys.exit(f"error: {unknown_override(argv, error)}")


def unknown_override(argv, error) -> str:
    """The message for an override of a key the config file lacks."""
    from jaxtrain import checks
    config = load_config_file(argv)
    overrides = [arg[len("--config."):].split("=")[0] for arg in argv
                 if arg.startswith("--config.")]
    if config is not None:
        known = checks.flat_keys(config)
        for key in overrides:
            if not has_key(config, key):
                return str(checks.unknown_key_error(key, known))
    missing = str(error).strip("\"'")
    return f"unknown config key {missing!r} (jaxtrain/defaults.py lists every key)"


def load_config_file(argv):
    """The config that --config names (its get_config()), or None if it cannot be had."""
    path = None
    for i, arg in enumerate(argv):
        if arg.startswith("--config="):
            path = arg.split("=", 1)[1]
        elif arg == "--config" and i + 1 < len(argv):
            path = argv[i + 1]
    if not path:
        return None
    path, _, config_arg = path.partition(":")
    if not os.path.isfile(path):
        return None
    try:
        spec = importlib.util.spec_from_file_location("_jaxtrain_config_file", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module.get_config(config_arg) if config_arg else module.get_config()
    except Exception:  # the flag parser reports a broken file itself
        return None


def has_key(config, key: str) -> bool:
    node = config
    for part in key.split("."):
        try:
            if part not in node:
                return False
            node = node[part]
        except TypeError:  # a value, not a block
            return False
    return True
