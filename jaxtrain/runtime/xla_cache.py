"""JAX's persistent compilation cache: a program compiled once is read from disk by
every later process that compiles the same program (a rerun, a resume, restore's
predict), which turns seconds of XLA compilation into a file read.

Training and restore turn it on by default (train.compilation_cache, '' = off).
JAX reads these settings when it first compiles, so they must be set before
that; a cache folder set already (JAX_COMPILATION_CACHE_DIR, an earlier run in
the same process, bench --compilation_cache) is kept.
"""
import importlib.util
import os

import jax

from jaxtrain.errors import ConfigError

DEFAULT = "~/.cache/jaxtrain/xla"
MAX_BYTES = 4 * 2**30  # least recently used programs go beyond this (needs filelock)


def enable(directory: str, key: str = "train.compilation_cache") -> str | None:
    """Keeps compiled programs in `directory` ('' leaves the cache as it is); returns
    the folder in use, or None when there is none."""
    current = jax.config.jax_compilation_cache_dir
    if current or not directory:
        return current or None
    path = os.path.abspath(os.path.expanduser(directory))
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as error:
        raise ConfigError(f"config.{key}={directory!r}: cannot create it "
                          f"({error.strerror or error}); set {key}='' to run without the "
                          "compilation cache") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"config.{key}={directory!r}: not writable; set {key}='' to run "
                          "without the compilation cache")
    jax.config.update("jax_compilation_cache_dir", path)
    # JAX's defaults skip programs that compile in under a second; a quick start needs all.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    if importlib.util.find_spec("filelock") is not None:  # JAX's LRU eviction locks with it
        jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
    return path


_COUNTS = {"hits": 0, "misses": 0}
_LISTENING = []


def _count(event: str, **kwargs) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        _COUNTS["hits"] += 1
    elif event == "/jax/compilation_cache/cache_misses":
        _COUNTS["misses"] += 1


def counts() -> dict:
    """This process's compilation-cache hits and misses so far (JAX reports every compile
    that consults the cache through jax.monitoring; counted from the first call on)."""
    if not _LISTENING:
        jax.monitoring.register_event_listener(_count)
        _LISTENING.append(True)
    return dict(_COUNTS)
