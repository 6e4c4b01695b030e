"""JAX's persistent compilation cache: a program compiled once is read from disk by
every later process that compiles the same program (a rerun, a resume, restore's
predict), which turns seconds of XLA compilation into a file read.

Training and restore turn it on by default (train.compilation_cache, '' = off).
JAX reads these settings when it first compiles, so they must be set before
that; a cache folder set already (JAX_COMPILATION_CACHE_DIR, an earlier run in
the same process, bench --compilation_cache) is kept.

The folder is kept under MAX_BYTES once a process, when the cache is turned on (trim),
rather than by JAX's own size limit, whose eviction reads every entry's size and last
use before each program it writes: a cost that grows with the folder, paid on every
compile.
"""
import os

import jax

from jaxtrain.errors import ConfigError

DEFAULT = "~/.cache/jaxtrain/xla"
MAX_BYTES = 4 * 2**30  # the least recently used programs beyond this go (trim); < 0: no limit
CACHE_SUFFIX, ATIME_SUFFIX = "-cache", "-atime"  # JAX's names for a program, its last use


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
    trim(path, MAX_BYTES)
    jax.config.update("jax_compilation_cache_dir", path)
    # JAX's defaults skip programs that compile in under a second; a quick start needs all.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path


def trim(path: str, limit: int) -> None:
    """Removes the least recently used programs of the folder (JAX's `*-cache` files, with
    the `*-atime` file JAX's own eviction kept beside each) until they hold at most
    `limit` bytes (< 0: no limit); no other file there is counted or touched. Last use:
    the file's access time where the filesystem keeps it (Linux's relatime: to the day),
    else when it was written. A file another process removed first is passed over; JAX
    reads a program it cannot find as not cached."""
    if limit < 0:
        return
    entries = []
    with os.scandir(path) as found:
        for entry in found:
            try:
                if entry.name.endswith(CACHE_SUFFIX) and entry.is_file(follow_symlinks=False):
                    stat = entry.stat(follow_symlinks=False)
                    entries.append((max(stat.st_atime, stat.st_mtime), stat.st_size, entry.path))
            except FileNotFoundError:
                continue
    total = sum(size for _, size, _ in entries)
    for _, size, file in sorted(entries):
        if total <= limit:
            break
        for gone in (file, file.removesuffix(CACHE_SUFFIX) + ATIME_SUFFIX):
            try:
                os.remove(gone)
            except FileNotFoundError:
                pass
        total -= size


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
