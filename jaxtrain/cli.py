"""Command-line glue shared by main.py, `python -m jaxtrain.compare` and `jaxtrain.bench`."""
import importlib.util
import os
import sys

from absl import flags


USAGE_ERROR = 2  # a command or config that cannot work (a failed run exits 1)


def usage_error(message: str):
    """Prints `error: MESSAGE` and exits with the usage status, 2."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(USAGE_ERROR)


def parse_flags(argv):
    """absl flag parsing (for app.run's flags_parser), with one-line errors: a bad value
    names its flag, an unknown --config key is named with the nearest known one."""
    check_config_flag(argv)
    try:
        return flags.FLAGS(argv)
    except flags.Error as error:
        usage_error(str(error).splitlines()[0])
    except (AttributeError, KeyError) as error:  # ml_collections: no such key
        usage_error(unknown_override(argv, error))
    except Exception as error:  # the config file itself failed (raised in get_config)
        usage_error(f"--config: {config_path(argv)} failed: {type(error).__name__}: {error}")


def config_path(argv) -> str | None:
    path = None
    for i, arg in enumerate(argv):
        if arg.startswith("--config="):
            path = arg.split("=", 1)[1]
        elif arg == "--config" and i + 1 < len(argv):
            path = argv[i + 1]
    return path


def check_config_flag(argv) -> None:
    """--config given, and naming a file that exists; else a one-line usage error."""
    if "config" not in flags.FLAGS:
        return
    path = config_path(argv)
    overrides = [arg.split("=")[0] for arg in argv if arg.startswith("--config.")]
    if path is None:
        if overrides:
            usage_error(f"{overrides[0]} overrides a config, but no --config=FILE names one "
                        "(e.g. --config=configs/cifar.py)")
        return  # absl says --config is required
    file = path.partition(":")[0]
    if not os.path.isfile(file):
        folder = os.path.dirname(file) or "."
        recipes = sorted(n for n in os.listdir(folder) if n.endswith(".py")
                         and not n.startswith("_")) if os.path.isdir(folder) else []
        from jaxtrain.checks import nearest_name
        nearest = nearest_name(os.path.basename(file), recipes)
        hint = (f" (did you mean {os.path.join(folder, nearest)}?)" if nearest
                else f" (in {folder}: {', '.join(recipes)})" if recipes else "")
        usage_error(f"--config={path}: no such file{hint}")


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
    path = config_path(argv)
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
