"""train.xla_flags: XLA's own flags for a run's compilations, set from the config.

XLA reads the XLA_FLAGS variable once per process, when JAX starts its backend
(the first device query, computation or compile), and aborts the whole process
on a flag it does not know. So the commands that read a config (main.py /
`python -m jaxtrain`, `jaxtrain.bench`, `jaxtrain.compare`) add the config's
flags to XLA_FLAGS as soon as the config is parsed (jaxtrain/cli.py), before
anything asks for a device, and their children (bench --whole_process, the
processes of a multi-process run) inherit them. Each flag's name is first looked
up in the binaries of jaxlib and its plugins (milliseconds); a name not found
there is handed to XLA's own parser in a child process, whose verdict becomes a
one-line usage error rather than an abort of the run. A known flag with a value
XLA cannot read is still XLA's own error when it starts ("Couldn't interpret
value V for flag F"), which names the flag.

GPU flags parse on any backend (the CPU ignores them), so a CPU run checks a
GPU config's flags too. From Python, call apply(config.train.xla_flags) before
the first use of JAX, or set XLA_FLAGS yourself.
"""
import functools
import glob
import importlib
import mmap
import os
import re
import subprocess
import sys

from jaxtrain.errors import ConfigError

VARIABLE = "XLA_FLAGS"
KEY = "train.xla_flags"
# One flag: --xla_NAME or --xla_NAME=VALUE, no spaces (XLA splits the variable on them).
FLAG = re.compile(r"--(xla_[a-z0-9_]+)(?:=(\S*))?")
XLA_ERROR = re.compile(r"(Unknown flag in XLA_FLAGS: \S+|Couldn't interpret value .*)")


def parse(text: str) -> list[tuple[str, str]]:
    """'--xla_a=1 --xla_b' -> [('xla_a', '--xla_a=1'), ('xla_b', '--xla_b')]; a token that
    is not one flag raises ValueError naming it."""
    flags = []
    for token in text.split():
        match = FLAG.fullmatch(token)
        if match is None:
            raise ValueError(f"{token!r} is not an XLA flag (--xla_NAME=VALUE, separated by "
                             "spaces)")
        flags.append((match.group(1), token))
    return flags


def well_formed(text) -> bool:
    """checks.py's test of the value: a string of flags, or '' (none)."""
    if not isinstance(text, str):
        return False
    try:
        parse(text)
    except ValueError:
        return False
    return True


def merged(current: str, text: str) -> str:
    """XLA_FLAGS `current` with the flags in `text` added after it; a flag `current`
    already sets is replaced, so each name appears once and the config's value is the
    one XLA reads. Adding the same flags twice changes nothing."""
    names = {name for name, _ in parse(text)}
    kept = [token for token in current.split()
            if not (FLAG.fullmatch(token) and FLAG.fullmatch(token).group(1) in names)]
    return " ".join(kept + [token for _, token in parse(text)])


@functools.cache
def _binaries() -> tuple[str, ...]:
    """jaxlib's shared libraries, largest first (XLA and its flag table are in the
    largest: libjax_common.so in jaxlib 0.10), then the PJRT plugins' (jax_plugins:
    the CUDA plugin holds an XLA of its own, reading the same variable)."""
    folders = []
    for package in ("jaxlib", "jax_plugins"):
        try:
            module = importlib.import_module(package)
        except ImportError:
            continue
        folders += list(getattr(module, "__path__", []))
    paths = []
    for folder in folders:
        found = glob.glob(os.path.join(folder, "**", "*.so"), recursive=True)
        paths += sorted(found, key=os.path.getsize, reverse=True)
    return tuple(paths)


def _contains_name(data, name: bytes) -> bool:
    """`name` as a whole C string: NUL after it and no identifier character before it
    (a linker may store a string as the tail of a longer one: '--xla_x' holds 'xla_x',
    'xla_gpu_x' must not count as 'gpu_x')."""
    at = data.find(name + b"\0")
    while at != -1:
        if at == 0 or not (chr(data[at - 1]).isalnum() or data[at - 1] == ord("_")):
            return True
        at = data.find(name + b"\0", at + 1)
    return False


def unknown_names(names) -> list[str] | None:
    """The names in `names` not found in the binaries of this jaxlib and its plugins (a
    known name is found in the first few MB: milliseconds; an unknown one costs a read
    of them all, a second or two); None when they cannot be read."""
    missing = list(dict.fromkeys(names))
    readable = False
    for path in _binaries():
        if not missing:
            break
        try:
            with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
                readable = True
                missing = [n for n in missing if not _contains_name(data, n.encode())]
        except (OSError, ValueError):  # unreadable, or empty (mmap of 0 bytes)
            continue
    return missing if readable else None


def xla_refuses(tokens) -> str | None:
    """XLA's own verdict on these flags, from a child process that only parses them
    (JAX_PLATFORMS=cpu, no device touched; seconds, so only for names the binaries did
    not show): its error line ('Unknown flag in XLA_FLAGS: ...', "Couldn't interpret
    value ..."), or None when XLA takes them."""
    env = dict(os.environ, XLA_FLAGS=" ".join(tokens), JAX_PLATFORMS="cpu")
    code = "from jax._src.lib import xla_client; xla_client.CompileOptions()"
    try:
        child = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                               text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"its check could not run ({error})"
    if child.returncode == 0:
        return None
    lines = [line.strip() for line in child.stderr.splitlines() if line.strip()]
    found = [m.group(1) for line in lines for m in [XLA_ERROR.search(line)] if m]
    return found[0] if found else (lines[0] if lines else f"exit {child.returncode}")


def backend_started() -> bool:
    """Whether JAX has started a backend in this process (XLA has read its flags)."""
    try:
        from jax._src import xla_bridge
        return bool(xla_bridge.backends_are_initialized())
    except (ImportError, AttributeError):  # another jax: assume the worst
        return True


def apply(text: str, key: str = KEY) -> str:
    """Adds `text`'s flags to XLA_FLAGS for XLA to read when JAX starts; returns the
    variable as XLA will see it. A malformed or unknown flag, or flags that come after
    JAX has started in this process (too late to take effect), raise ConfigError naming
    `key`. '' changes nothing."""
    current = os.environ.get(VARIABLE, "")
    if not isinstance(text, str):
        raise ConfigError(f"config.{key}={text!r}: must be a string of XLA flags")
    if not text.strip():
        return current
    try:
        names = [name for name, _ in parse(text)]
    except ValueError as error:
        raise ConfigError(f"config.{key}={text!r}: {error}") from None
    unknown = unknown_names(names)
    if unknown is None or unknown:  # not seen in the binaries: XLA's own parser decides
        tokens = [token for name, token in parse(text) if unknown is None or name in unknown]
        refused = xla_refuses(tokens)
        if refused:
            import jaxlib
            raise ConfigError(f"config.{key}={text!r}: XLA (jaxlib {jaxlib.__version__}) "
                              f"would abort: {refused}")
    value = merged(current, text)
    if value != current and backend_started():
        raise ConfigError(f"config.{key}={text!r}: JAX has started in this process already, "
                          "and XLA reads its flags only then: apply them before the first "
                          "use of JAX (the command line does), or set XLA_FLAGS")
    os.environ[VARIABLE] = value
    return value


def in_effect() -> str:
    """XLA_FLAGS as this process has it (summary.json, bench's JSON, compare.json)."""
    return os.environ.get(VARIABLE, "")
