"""SIGINT and SIGTERM: one line naming what the run was doing; during training, a
checkpoint first (StopRequest), then the exit status 128 + N."""
import os
import signal
import threading

from jaxtrain.errors import TrainingError


class Interrupted(TrainingError):
    """SIGTERM or SIGINT stopped the run: during training after a checkpoint of `step` was
    saved (in `phase`, if given: e.g. while evaluating it), or in a phase before anything
    could be saved (loading data, compiling, ...)."""

    def __init__(self, signum: int, step: int | None = None, directory: str | None = None,
                 phase: str | None = None):
        self.signum, self.step = signum, step
        name = signal.Signals(signum).name
        if step is not None:
            where = f"while {phase}" if phase else f"at step {step}"
            message = (f"interrupted by {name} {where}; checkpoint saved in {directory}/{step}."
                       " Run the same command again to resume")
        else:
            message = f"interrupted by {name} while {phase or 'starting'}"
        super().__init__(message)


# What the run is doing (for a signal's message), and whether a signal may end the
# process at once: true while nothing could be saved (see raise_on_signals).
PHASE = {"doing": "starting", "stop_at_once": True}


def enter_phase(doing: str, stop_at_once: bool = True) -> None:
    PHASE.update(doing=doing, stop_at_once=stop_at_once)


def raise_on_signals() -> None:
    """From now on SIGINT and SIGTERM stop the run with one line naming the phase.

    Python runs a signal handler only between bytecodes, so a handler alone would wait
    for a long XLA compile (or a stalled download) to return. The interpreter also
    writes each signal to a wakeup pipe the moment it arrives; a watcher thread reads
    it and, while nothing could be saved (loading, compiling), prints the line and exits
    at once (status 128 + N). Otherwise the handler raises Interrupted in the main
    thread, so `finally` blocks run; training itself stops between steps after a
    checkpoint (StopRequest)."""
    def handler(signum, frame):
        # While nothing could be saved, the watcher ends the process; raising here too
        # could land in a finalizer, where Python prints "Exception ignored" instead.
        if not PHASE["stop_at_once"]:
            raise Interrupted(signum, phase=PHASE["doing"])
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handler)
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    threading.Thread(target=_stop_at_once_on_signals, args=(read_end,), daemon=True,
                     name="jaxtrain-signals").start()


def _stop_at_once_on_signals(read_end: int) -> None:
    while True:
        for signum in os.read(read_end, 64):
            if signum in (signal.SIGINT, signal.SIGTERM) and PHASE["stop_at_once"]:
                os.write(2, f"stopped: {Interrupted(signum, phase=PHASE['doing'])}\n".encode())
                os._exit(128 + signum)


class StopRequest:
    """Turns SIGTERM/SIGINT into a request to stop after the current step."""

    def __init__(self):
        self.signal = None

    def __call__(self) -> bool:
        return self.signal is not None

    def __enter__(self):
        def handler(signum, frame):
            self.signal = signum
        self._previous = {}
        if threading.current_thread() is threading.main_thread():  # signals need the main thread
            self._previous = {sig: signal.signal(sig, handler)
                              for sig in (signal.SIGTERM, signal.SIGINT)}
        return self

    def __exit__(self, *exc):
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)

