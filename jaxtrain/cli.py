"""Command-line glue shared by main.py and `python -m jaxtrain.compare`."""
import sys

from absl import flags


def parse_flags(argv):
    """absl flag parsing (for app.run's flags_parser), with one-line errors: a bad value
    names its flag, an unknown --config key names the override that used it."""
    try:
        return flags.FLAGS(argv)
    except flags.Error as error:
        sys.exit(f"error: {error}")
    except (AttributeError, KeyError) as error:  # ml_collections: no such key
        missing = str(error).strip("\"'")
        overrides = [arg.split("=")[0] for arg in argv if arg.startswith("--config.")]
        named = [arg for arg in overrides if missing in arg[len("--config."):].split(".")]
        flag = named[0] if named else f"--config.{missing}"
        sys.exit(f"error: unknown config key in {flag}: there is no {missing!r} there "
                 "(configs/default.py lists every key)")
