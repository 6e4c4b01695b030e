"""--profile=N: a jax.profiler trace of N steps of the run (plan.profile_window's), and the
ten XLA ops that took the most time, printed and kept in summary.json."""
import os

import jax

from jaxtrain.perf import profile

PROFILE_DIR = "profile"


class Profiler:
    """Starts the trace before the chunk that begins the traced window, stops it after
    the one that ends it (the plan cuts chunks there)."""

    def __init__(self, workdir: str, window, reporter):
        self.workdir, self.window, self.reporter = workdir, window, reporter
        self.tracing, self.seconds, self.table = False, 0.0, None

    def before(self, chunk) -> None:
        if self.window and chunk.previous == self.window[0]:
            jax.profiler.start_trace(os.path.join(self.workdir, PROFILE_DIR),
                                     create_perfetto_trace=True)
            self.tracing = True

    def after(self, chunk) -> None:
        if not self.tracing:
            return
        self.seconds += chunk.seconds
        if chunk.previous + chunk.length == self.window[1]:
            self.tracing = False
            self.table = finish_profile(self.workdir, self.window, self.seconds, self.reporter)

    def close(self) -> None:
        if self.tracing:
            jax.profiler.stop_trace()  # stopped or failed inside the traced steps


def finish_profile(workdir: str, traced, seconds: float, reporter) -> dict:
    """Stops the trace; prints where it is and the ten XLA ops that took the most time."""
    jax.profiler.stop_trace()
    steps, directory = traced[1] - traced[0], os.path.join(workdir, PROFILE_DIR)
    # Shares are of the summed op time: the traced steps' wall time includes the
    # profiler's own overhead, so it is reported beside them, not divided by.
    trace = profile.newest_trace(directory)
    table = profile.op_table(trace, steps)
    table["traced_wall_seconds_per_step"] = seconds / steps
    perfetto = os.path.join(os.path.dirname(trace), "perfetto_trace.json.gz")
    reporter.print_line(f"profile of steps {traced[0] + 1}-{traced[1]} ({seconds / steps * 1e3:.2f}"
                        f" ms a step under the profiler): `tensorboard --logdir {directory}` "
                        f"(profile plugin), or open {perfetto} at ui.perfetto.dev\n"
                        + profile.format_op_table(table))
    return table
