"""Command-line glue shared by main.py, `python -m jaxtrain.compare` and `jaxtrain.bench`."""
import importlib.util
import os
import re
import sys

from absl import flags

from jaxtrain.config import defaults

USAGE_ERROR = 2  # a command or config that cannot work (a failed run exits 1)


def usage_error(message: str):
    """Prints `error: MESSAGE` and exits with the usage status, 2."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(USAGE_ERROR)


def parse_flags(argv):
    """absl flag parsing (for app.run's flags_parser), with one-line errors: a bad value
    names its flag, an unknown --config key is named with the nearest known one.
    --config.model.kwargs.NAME=VALUE sets an argument of a model of your own (checked
    against its class), which the config file need not have."""
    check_config_flag(argv)
    argv, model_kwargs = split_model_kwargs(argv)
    if model_kwargs:  # ml_collections reads the overrides from sys.argv itself
        sys.argv = [arg for arg in sys.argv if not arg.startswith(KWARGS_FLAG)
                    or arg in argv]
    try:
        remaining = flags.FLAGS(argv)
        if model_kwargs:
            set_model_kwargs(flags.FLAGS.config, model_kwargs)
    except flags.Error as error:
        usage_error(unknown_flag(str(error)) or str(error).splitlines()[0])
    except (AttributeError, KeyError) as error:  # ml_collections: no such key
        usage_error(unknown_override(argv, error))
    except Exception as error:  # the config file itself failed (raised in get_config)
        usage_error(f"--config: {config_path(argv)} failed: {type(error).__name__}: {error}")
    apply_xla_flags()
    return remaining


def apply_xla_flags() -> None:
    """The config's train.xla_flags into XLA_FLAGS, now: nothing has started JAX yet, and
    XLA reads the variable once, when it starts (jaxtrain/runtime/xla_flags.py)."""
    if "config" not in flags.FLAGS or flags.FLAGS.config is None:
        return
    from jaxtrain.errors import ConfigError
    from jaxtrain.runtime import xla_flags
    train = flags.FLAGS.config.get("train") or {}
    try:
        xla_flags.apply(train.get("xla_flags", ""))
    except ConfigError as error:
        usage_error(str(error))


KWARGS_FLAG = "--config.model.kwargs."


def split_model_kwargs(argv) -> tuple[list, dict]:
    """(argv without the --config.model.kwargs.NAME=VALUE flags the config file does not
    hold, {NAME: VALUE as typed}): ml_collections only overrides keys a config has."""
    config = None
    kept, kwargs = [], {}
    for arg in argv:
        name, has_value, value = arg[len(KWARGS_FLAG):].partition("=")
        if not arg.startswith(KWARGS_FLAG) or not has_value or "." in name:
            kept.append(arg)
            continue
        if config is None:
            config = load_config_file(argv) or {}
        if config and defaults.has_key(config, f"model.kwargs.{name}"):
            kept.append(arg)  # the file sets it: ml_collections parses it by its type
        else:
            kwargs[name] = value
    return kept, kwargs


def set_model_kwargs(config, kwargs: dict) -> None:
    """model.kwargs.NAME = VALUE for a model of your own, after checking that its class
    takes NAME; VALUE is read as a Python literal (32, 0.5, (16, 32), True), else kept
    as text. Anything wrong is a one-line usage error."""
    import ast

    from jaxtrain.config import checks
    from jaxtrain.models import user
    name = config.model.name
    flag = KWARGS_FLAG + next(iter(kwargs))
    if not user.is_user_model(name):
        usage_error(f"{flag}: model.kwargs are the arguments of a model of your own "
                    f"(model.name='package.module:Class'); model.name={name!r} is built in "
                    "and takes model.* keys (jaxtrain/config/defaults.py)")
    try:
        cls = user.import_model_class(name)
    except ValueError as error:
        usage_error(str(error))
    names, any_name = user.argument_names(cls)
    for key in kwargs:
        if not any_name and key not in names:
            nearest = checks.nearest_name(key, names)
            hint = f"did you mean {nearest!r}? " if nearest else ""
            usage_error(f"{KWARGS_FLAG}{key}: {cls.__name__} takes no argument {key!r} "
                        f"({hint}it takes {', '.join(names) or 'none'})")
    parsed = {}
    for key, text in kwargs.items():
        try:
            parsed[key] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            parsed[key] = text
    with config.unlocked():
        if "kwargs" not in config.model:
            config.model.kwargs = {}
        for key, value in parsed.items():
            config.model.kwargs[key] = value


def override_keys(argv) -> list[str]:
    """The KEYs of argv's --config.KEY=VALUE overrides, in order."""
    return [arg[len("--config."):].split("=")[0] for arg in argv if arg.startswith("--config.")]


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
    overrides = override_keys(argv)
    if path is None:
        if overrides:
            usage_error(f"--config.{overrides[0]} overrides a config, but no --config=FILE "
                        "names one (e.g. --config=configs/cifar.py)")
        return  # main() says whether this command needs one
    file = path.partition(":")[0]
    if not os.path.isfile(file):
        folder = os.path.dirname(file) or "."
        recipes = sorted(n for n in os.listdir(folder) if n.endswith(".py")
                         and not n.startswith("_")) if os.path.isdir(folder) else []
        from jaxtrain.config.checks import nearest_name
        nearest = nearest_name(os.path.basename(file), recipes)
        hint = (f" (did you mean {os.path.join(folder, nearest)}?)" if nearest
                else f" (in {folder}: {', '.join(recipes)})" if recipes else "")
        usage_error(f"--config={path}: no such file{hint}")


def unknown_flag(message: str) -> str | None:
    """absl's "Unknown command line flag 'confg.train.batch_size'" with the flag it was
    meant to be (absl suggests none for a dotted name); None for other errors."""
    match = re.match(r"Unknown command line flag '([^']+)'", message)
    if match is None:
        return None
    from jaxtrain.config.checks import nearest_name
    name = match.group(1)
    head, dot, rest = name.partition(".")
    known = [flag for flag in flags.FLAGS if len(flag) > 1]
    nearest = nearest_name(head, known)
    if nearest is None or nearest == head:
        return None
    return f"unknown flag --{name} (did you mean --{nearest}{dot}{rest}?)"


def unknown_override(argv, error) -> str:
    """The message for an override of a key the config file lacks."""
    from jaxtrain.config import checks
    config = load_config_file(argv)
    if config is not None:
        known = checks.flat_keys(config)
        for key in override_keys(argv):
            if not defaults.has_key(config, key):
                return str(checks.unknown_key_error(key, known))
    missing = str(error).strip("\"'")
    return f"unknown config key {missing!r} (jaxtrain/config/defaults.py lists every key)"


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

