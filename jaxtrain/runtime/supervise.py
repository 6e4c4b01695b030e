"""A multi-process run's trainer in a child process, watched by a small parent.

A process whose peer dies in the middle of a collective can end inside JAX's runtime (gloo
throws in one of its C++ threads: `terminate called after throwing an instance of
'gloo::EnforceNotMet'`, then `Fatal Python error: Aborted`, a page of thread dumps, exit
134) before its heartbeat watch (processes.watch_peers) sees the peer gone. Nothing in that
process outlives it; this parent does. It forks the command's trainer as its child (run),
passes stdout and stderr through (but for gloo's connection lines, which go to a log file in
the workdir instead of the console table), and when the child ends natively it keeps the
native report in a file and says what happened in one line with exit status 75 (rerun every
process), as a lost peer's heartbeat does. Signals sent to it reach the child, and a parent
that is killed takes its child with it (Linux: PR_SET_PDEATHSIG).

The fork comes before JAX starts a backend: nothing here imports JAX but tell().
"""
import io
import json
import os
import re
import signal
import sys

ENV = "JAXTRAIN_SUPERVISED"  # in the child: the file in which it says who it is
PEER_LOST = 75  # exit status: another process of the run was lost (EX_TEMPFAIL: rerun all)
NATIVE_SIGNALS = (signal.SIGABRT, signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE)
# Where a native end starts in stderr: C++'s terminate, Python's fatal-error handler,
# absl/XLA check failures ("F1203 12:00:00.000 ..." or "*** Check failure").
NATIVE_START = re.compile(rb"^(terminate called|Fatal Python error|\*\*\* |F\d{4} \d)", re.M)
# Schedulers whose task count > 1 makes a multi-process run (JAX auto-detects the rest).
CLUSTER_SIZE_VARIABLES = ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE")
# What gloo prints (C++, to stdout) as each collective's processes connect.
GLOO_LINE = b"[Gloo] "


def flag_value(argv, name: str):
    """The value of --name=V or --name V in argv (the last one), else None."""
    value = None
    for i, arg in enumerate(argv):
        if arg.startswith(f"--{name}="):
            value = arg.split("=", 1)[1]
        elif arg == f"--{name}" and i + 1 < len(argv):
            value = argv[i + 1]
    return value


def wanted(argv, environ=None) -> bool:
    """Whether this command is a process of a multi-process run with the peer watch on
    (--peer_timeout > 0), and not already the supervised child."""
    environ = os.environ if environ is None else environ
    if ENV in environ or any(arg in ("--help", "--helpfull", "-h") for arg in argv):
        return False
    try:
        if float(flag_value(argv, "peer_timeout") or 30) <= 0:
            return False
        processes = int(flag_value(argv, "num_processes") or environ.get("JAX_NUM_PROCESSES")
                        or 0)
        cluster = max(int(environ.get(name) or 1) for name in CLUSTER_SIZE_VARIABLES)
    except ValueError:
        return False  # the command line reports its bad value itself
    return processes > 1 or cluster > 1


def tell(workdir: str, checkpoints: str) -> None:
    """In the supervised child: which process this is and where its run writes (the
    parent names them if this process ends natively)."""
    path = os.environ.get(ENV)
    if not path:
        return
    import jax
    info = {"process": jax.process_index(), "count": jax.process_count(),
            "workdir": os.path.abspath(workdir), "checkpoints": checkpoints}
    with open(path, "w") as f:
        json.dump(info, f)


def run() -> int | None:
    """Forks this command's trainer: returns None in the child, which goes on as the
    command, and in the parent the status to exit with once the child has ended. A fork
    (this process has imported JAX, and started no backend yet) spares the child a
    second interpreter's imports."""
    import tempfile
    handle, info_file = tempfile.mkstemp(prefix="jaxtrain-process-", suffix=".json")
    os.close(handle)
    (out_read, out_write), (err_read, err_write) = os.pipe(), os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    child = os.fork()
    if child == 0:
        os.close(out_read)
        os.close(err_read)
        _become_the_trainer(out_write, err_write, info_file)
        return None
    os.close(out_write)
    os.close(err_write)
    import threading
    stdout = threading.Thread(target=relay_stdout, args=(out_read, info_file))
    stdout.start()
    ended = []

    def forward(signum, frame):
        if not ended:
            try:
                os.kill(child, signum)
            except ProcessLookupError:
                pass  # reaped a moment ago
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, forward)
    native = relay(err_read)
    status = os.waitstatus_to_exitcode(os.waitpid(child, 0)[1])
    ended.append(status)
    stdout.join()
    try:
        with open(info_file) as f:
            info = json.load(f)
    except (OSError, ValueError):
        info = {}
    finally:
        os.unlink(info_file)
    if status < 0 and -status not in NATIVE_SIGNALS:
        return 128 - status  # SIGTERM, SIGKILL, ...: the shell's status for it
    if status >= 0 and (native is None or status == 0):
        return status  # its own ending (one line already, if any)
    report(native or b"", status, info, sys.orig_argv)
    return PEER_LOST


def _become_the_trainer(out_write: int, err_write: int, info_file: str) -> None:
    """In the forked child: stdout and stderr into the parent's pipes, unbuffered (each
    line reaches the console as it would unpiped), told where to say who it is (tell),
    and killed with its parent (Linux: PR_SET_PDEATHSIG)."""
    os.dup2(out_write, 1)
    os.dup2(err_write, 2)
    os.close(out_write)
    os.close(err_write)
    os.environ[ENV] = info_file
    os.environ["PYTHONUNBUFFERED"] = "1"  # and in what it starts, as before
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8",
                                  write_through=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8",
                                  errors="backslashreplace", write_through=True)
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: a killed parent leaves its child to its own peer watch


def relay(fd: int) -> bytes | None:
    """Copies the child's stderr to this process's as it comes, up to the start of a
    native end (NATIVE_START), which it keeps instead; returns that (None: none came)."""
    out = sys.stderr.buffer
    pending, native = b"", None
    while True:
        try:
            data = os.read(fd, 65536)
        except InterruptedError:
            continue
        if not data:
            break
        if native is not None:
            native += data
            continue
        pending += data
        found = NATIVE_START.search(pending)
        if found:
            out.write(pending[:found.start()])
            native, pending = pending[found.start():], b""
        else:  # pass on all but a last partial line, which may begin a marker
            cut = pending.rfind(b"\n") + 1
            keep = pending[cut:] if len(pending) - cut < 200 else b""
            out.write(pending[:len(pending) - len(keep)])
            pending = keep
        out.flush()
    out.write(pending)
    out.flush()
    return native


def relay_stdout(fd: int, info_file: str) -> None:
    """Copies the child's stdout to this process's line by line, but for gloo's lines,
    which go to WORKDIR/gloo-process<N>.log once the child has said where its run
    writes (supervise.tell; until then they wait here, and reach the console after all
    if the child ends without saying)."""
    out, pending, held = sys.stdout.buffer, b"", []
    while True:
        try:
            data = os.read(fd, 65536)
        except InterruptedError:
            continue
        pending += data
        *lines, pending = pending.split(b"\n") if data else (*pending.split(b"\n"), b"")
        for line in lines:
            if line.startswith(GLOO_LINE):
                held.append(line)
            elif line or data:
                out.write(line + b"\n")
        held = log_gloo_lines(held, info_file)
        if not data:
            out.write(b"".join(line + b"\n" for line in held))
            out.flush()
            return
        out.flush()


def log_gloo_lines(lines: list, info_file: str) -> list:
    """Appends `lines` to the workdir's gloo log once the child has named it; returns
    those it could not write yet."""
    if not lines:
        return lines
    try:
        with open(info_file) as f:
            info = json.load(f)
        with open(os.path.join(info["workdir"], f"gloo-process{info['process']}.log"),
                  "ab") as log:
            log.write(b"".join(line + b"\n" for line in lines))
    except (OSError, ValueError, KeyError):
        return lines  # not said yet (or the info file is gone: the child has ended)
    return []


def report(native: bytes, status: int, info: dict, argv) -> None:
    """One line for a child that ended inside the runtime; its report into a file."""
    me = info.get("process", flag_value(argv, "process_id") or "?")
    count = info.get("count", flag_value(argv, "num_processes") or "?")
    first = next((line.strip() for line in native.decode(errors="replace").splitlines()
                  if line.strip()), f"killed by {signal.Signals(-status).name}"
                 if status < 0 else f"exit status {status}")
    saved = ""
    workdir = info.get("workdir")
    if workdir and os.path.isdir(workdir):
        path = os.path.join(workdir, f"native-report-process{me}.txt")
        try:
            with open(path, "wb") as f:
                f.write(native)
            saved = f" (its native report: {path})"
        except OSError:
            pass
    sys.stderr.write(
        f"error: process {me} of {count} stopped inside JAX's runtime ({first[:160]}): in a "
        f"multi-process run, another process lost in the middle of a collective; process "
        f"{me} stops too. {newest_checkpoint(info.get('checkpoints'))} Rerun every process "
        f"to resume.{saved}\n")
    sys.stderr.flush()


def newest_checkpoint(directory: str | None) -> str:
    """`The newest checkpoint is DIR/STEP.` (parallel.newest_checkpoint's words)."""
    steps = []
    if directory and os.path.isdir(directory):
        steps = [int(n) for n in os.listdir(directory) if n.isdigit()]
    if not steps:
        return "No checkpoint was written yet."
    return f"The newest checkpoint is {directory}/{max(steps)}."
