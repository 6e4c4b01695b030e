"""Python commands the tests start (`python main.py ...`, `python -m jaxtrain.predict ...`),
forked from one process per test worker that has imported JAX, Flax, Orbax and jaxtrain
already: a command then starts in milliseconds instead of the 2.5 s of CPU its imports
take, and is still a process of its own, with its own pid, signals, exit status, stdout
and stderr, environment and working directory.

`Popen` and `run` take the arguments of subprocess.Popen and subprocess.run that the tests
use. What a fork cannot give falls back to a real subprocess: another program than this
Python, JAX_* variables (JAX reads them when it is imported), or a PYTHONPATH that holds
another jaxtrain. JAX starts no backend in the server, so XLA_FLAGS (device counts) are
read by each command as a fresh process reads them.

Run as a script, this file is the server: it reads requests on the socket it is given.
"""
import atexit
import gc
import io
import json
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import threading
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PRELOAD = ("absl.app", "absl.flags", "numpy", "jax", "jax.numpy", "flax", "flax.linen",
           "flax.nnx", "optax", "orbax.checkpoint", "ml_collections", "PIL.Image",
           "matplotlib.pyplot", "jaxtrain", "jaxtrain.evaluate",
           "jaxtrain.cli", "jaxtrain.run.loop", "jaxtrain.predict", "jaxtrain.perf.benchmark")


# ---- the server ----------------------------------------------------------------------------

def _serve(control: socket.socket) -> None:
    for name in PRELOAD:
        __import__(name)
    from jaxtrain.runtime import report
    report.import_tensorboardx()  # as a run imports it: without torch
    gc.collect()
    gc.freeze()  # the children's copies of these objects stay shared pages
    base_path = [p for p in sys.path[1:] if p not in _pythonpath(os.environ)]
    replies = {}  # child pid: the socket its exit status goes to
    control.sendall(b"ready\n")
    while True:
        readable, _, _ = select.select([control], [], [], 0.05 if replies else None)
        if readable:
            message, fds, _, _ = socket.recv_fds(control, 1 << 20, 4)
            if not message:
                return  # the worker has gone: so does the server
            request = json.loads(message)
            reply = socket.socket(fileno=fds[3])
            pid = os.fork()
            if pid == 0:
                control.close()
                for other in replies.values():
                    other.close()
                _child(request, fds[:3], reply, base_path)
            for fd in fds[:3]:
                os.close(fd)
            reply.sendall(f"{pid}\n".encode())
            replies[pid] = reply
        while replies:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            reply = replies.pop(pid)
            try:
                reply.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
            except OSError:
                pass  # nobody waits for it any more
            reply.close()


def _pythonpath(env) -> list:
    return [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]


def _child(request, fds, reply, base_path) -> None:
    """In the forked child: become the command as `python ARGS` would start it; never returns."""
    code = 1
    try:
        reply.close()
        if request["new_session"]:
            os.setsid()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in map(int, os.listdir("/proc/self/fd")):
            if fd > 2:
                try:
                    os.close(fd)
                except OSError:
                    pass
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
        sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8")
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8",
                                      line_buffering=os.isatty(1), write_through=unbuffered)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8",
                                      errors="backslashreplace", line_buffering=True)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        benchmark = sys.modules["jaxtrain.perf.benchmark"]  # its whole-process clock starts
        benchmark.PROCESS_START = benchmark.process_start_time()  # at import: this process's
        args = request["args"]
        first = "" if args[0] in ("-m", "-c") else os.path.dirname(os.path.abspath(args[0]))
        sys.path[:] = [first, *_pythonpath(os.environ), *base_path]
        sys.orig_argv = [sys.executable, *args]  # what a command re-running itself reads
        try:
            if args[0] == "-m":
                sys.argv = ["-m", *args[2:]]
                module = sys.modules.get(args[1])  # preloaded: its __main__ runs afresh
                sys.modules.pop(args[1] if module is None or not hasattr(module, "__path__")
                                else args[1] + ".__main__", None)
                runpy.run_module(args[1], run_name="__main__", alter_sys=True)
            elif args[0] == "-c":
                sys.argv = ["-c", *args[2:]]
                exec(compile(args[1], "<string>", "exec"), {"__name__": "__main__"})
            else:
                sys.argv = list(args)
                runpy.run_path(args[0], run_name="__main__")
            code = 0
        except SystemExit as stop:
            if stop.code is None or isinstance(stop.code, int):
                code = stop.code or 0
            else:
                print(stop.code, file=sys.stderr)
                code = 1
        except KeyboardInterrupt:
            _print_uncaught()
            code = -signal.SIGINT
        except BaseException:
            _print_uncaught()
            code = 1
        threading._shutdown()  # as the interpreter does at exit: threads, then atexit
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
    except BaseException:
        traceback.print_exc()
    finally:
        if code == -signal.SIGINT:  # as Python ends on an uncaught KeyboardInterrupt
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        os._exit(code if 0 <= code < 256 else 1)


def _print_uncaught() -> None:
    """The traceback Python prints for an uncaught exception, from the command's own frames."""
    kind, error, frames = sys.exc_info()
    while frames is not None and frames.tb_frame.f_code.co_filename in (__file__, runpy.__file__):
        frames = frames.tb_next
    sys.excepthook(kind, error, frames)


# ---- the client: one server per test worker ------------------------------------------------

_server = {}


def _connection() -> socket.socket:
    if "socket" not in _server:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), *_pythonpath(env)])
        process = subprocess.Popen([sys.executable, __file__, str(theirs.fileno())],
                                   pass_fds=[theirs.fileno()], env=env, cwd=REPO,
                                   stdin=subprocess.DEVNULL)
        theirs.close()
        ready = ours.recv(16)
        if ready != b"ready\n":
            raise RuntimeError(f"the fork server did not start (exit {process.wait()})")
        _server.update(socket=ours, process=process)
        atexit.register(_stop)
    return _server["socket"]


def _stop() -> None:
    _server["socket"].close()
    try:
        _server["process"].wait(timeout=10)
    except subprocess.TimeoutExpired:
        _server["process"].kill()


def _forkable(args, env) -> bool:
    if not args or args[0] != sys.executable or len(args) < 2:
        return False
    if args[1].startswith("-") and args[1] not in ("-m", "-c"):
        return False
    if any(k.startswith("JAX_") for k in env):
        return False
    return not any((Path(p) / "jaxtrain").is_dir() and Path(p).resolve() != REPO
                   for p in _pythonpath(env))


class ForkedProcess:
    """subprocess.Popen's interface for a command forked by the server."""

    def __init__(self, args, *, cwd, env, stdin, stdout, stderr, text, start_new_session):
        self.args, self.returncode = args, None
        self.stdin = self.stdout = self.stderr = None
        ends, close = [], []
        for name, choice, mode in (("stdin", stdin, "w"), ("stdout", stdout, "r"),
                                   ("stderr", stderr, "r")):
            if choice == subprocess.PIPE:
                read, write = os.pipe()
                ours, theirs = (write, read) if mode == "w" else (read, write)
                file = os.fdopen(ours, mode if text else mode + "b")
                setattr(self, name, file)
                ends.append(theirs)
                close.append(theirs)
            elif choice == subprocess.STDOUT:
                ends.append(ends[1])
            elif choice == subprocess.DEVNULL or (choice is None and name == "stdin"):
                fd = os.open(os.devnull, os.O_RDWR)
                ends.append(fd)
                close.append(fd)
            elif choice is None:
                ends.append(name == "stdout" and 1 or 2)
            else:
                ends.append(choice if isinstance(choice, int) else choice.fileno())
        self._status, theirs = socket.socketpair()
        request = {"args": [str(a) for a in args[1:]], "cwd": str(cwd), "env": dict(env),
                   "new_session": bool(start_new_session)}
        socket.send_fds(_connection(), [json.dumps(request).encode()], [*ends, theirs.fileno()])
        theirs.close()
        for fd in close:
            os.close(fd)
        self._reply = self._status.makefile("r")
        self.pid = int(self._reply.readline())

    def poll(self):
        if self.returncode is None and select.select([self._status], [], [], 0)[0]:
            self._read_status()
        return self.returncode

    def wait(self, timeout=None):
        if self.returncode is None:
            if not select.select([self._status], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._read_status()
        return self.returncode

    def _read_status(self):
        line = self._reply.readline()
        if not line:
            raise RuntimeError(f"the fork server stopped before command {self.pid} ended")
        self.returncode = int(line)
        self._status.close()

    def communicate(self, input=None, timeout=None):
        if self.stdin is not None:
            if input:
                self.stdin.write(input)
            self.stdin.close()
        outputs = {}

        def read(name):
            stream = getattr(self, name)
            outputs[name] = stream.read() if stream is not None else None

        readers = [threading.Thread(target=read, args=(name,), daemon=True)
                   for name in ("stdout", "stderr")]
        for reader in readers:
            reader.start()
        self.wait(timeout)
        for reader in readers:
            reader.join()
        for stream in (self.stdout, self.stderr):
            if stream is not None:
                stream.close()
        return outputs["stdout"], outputs["stderr"]

    def send_signal(self, signum):
        if self.poll() is None:
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass  # it ended, and the server reaped it, since the poll

    def terminate(self):
        self.send_signal(signal.SIGTERM)

    def kill(self):
        self.send_signal(signal.SIGKILL)


def Popen(args, *, cwd=None, env=None, stdin=None, stdout=None, stderr=None, text=False,
          start_new_session=False):
    """subprocess.Popen(args, ...), forked from the server where it can be."""
    env = dict(os.environ if env is None else env)
    cwd = os.getcwd() if cwd is None else cwd
    if not _forkable(args, env):
        return subprocess.Popen(args, cwd=cwd, env=env, stdin=stdin, stdout=stdout,
                                stderr=stderr, text=text, start_new_session=start_new_session)
    return ForkedProcess(args, cwd=cwd, env=env, stdin=stdin, stdout=stdout, stderr=stderr,
                         text=text, start_new_session=start_new_session)


def run(args, *, cwd=None, env=None, capture_output=False, text=False, timeout=None,
        input=None, stdout=None, stderr=None, check=False):
    """subprocess.run(args, ...), forked from the server where it can be."""
    if capture_output:
        stdout = stderr = subprocess.PIPE
    process = Popen(args, cwd=cwd, env=env, stdin=subprocess.PIPE if input else None,
                    stdout=stdout, stderr=stderr, text=text)
    try:
        out, err = process.communicate(input, timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        raise
    result = subprocess.CompletedProcess(args, process.returncode, out, err)
    if check:
        result.check_returncode()
    return result


if __name__ == "__main__":
    _serve(socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET, fileno=int(sys.argv[1])))
