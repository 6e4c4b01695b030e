"""Where a run's wall time goes: every second of the process belongs to one phase.

A Clock hands the time since its last lap to the phase named now, so the parts
cannot overlap or leave gaps: they add up to the process's total. Phases that
recur (train, eval, checkpoint) accumulate. A phase may print its line when it
ends, so the console says what the run is doing from its first seconds.
"""
import time

# The phases of summary.json's phase_seconds, in the order a run meets them.
NAMES = ("imports", "load", "statistics", "build", "restore", "compile", "warmup", "train",
         "eval", "checkpoint", "write")


class Clock:
    def __init__(self, start_time: float | None = None, say=None):
        """start_time: time.time() when the process started (main.py's clock), else now.
        say: prints a line (None: silent, e.g. every process of a run but the first)."""
        self.start = time.time() if start_time is None else start_time
        self.last = self.start
        self.say = say
        self.seconds = dict.fromkeys(NAMES, 0.0)

    def lap(self, name: str, line: str | None = None) -> float:
        """Charges the time since the last lap to phase `name`; prints `line` with those
        seconds (`line` may hold {seconds}); returns them."""
        now = time.time()
        seconds, self.last = now - self.last, now
        self.seconds[name] += seconds
        if line is not None and self.say is not None:
            self.say(line.format(seconds=seconds) if "{seconds" in line
                     else f"{line} in {seconds:.1f} s")
        return seconds

    def total(self) -> float:
        return time.time() - self.start

    def breakdown(self) -> str:
        """One line: every phase that took time, and the total."""
        parts = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in self.seconds.items()
                          if seconds >= 0.05)
        return f"time: {parts}; total {self.total():.1f} s"
