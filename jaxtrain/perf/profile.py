"""Where a step's time goes: a jax.profiler trace and the XLA ops that cost the most.

`trace` records a few executions of a compiled program into a folder that
TensorBoard's profile plugin and Perfetto open; `op_table` reads the trace
back (jax.profiler.ProfileData, no TensorBoard needed) and sums the time of
every XLA op (a fusion, a library call such as a convolution, a copy, a
collective) over the traced steps.

On a GPU the times are the device's own: the "XLA Ops" line of the GPU plane
(each op's kernels, as the GPU ran them), or, in a trace without that line, the
kernels on the plane's stream lines grouped by the HLO op each names. Only a
trace with no device plane at all (a CPU run) falls back to the host threads'
thunk times, which may overlap each other: a GPU run never reports host launch
times as op times. The table says which source it read. Shares are of the
summed op time, and of the step's wall time where the caller gives it.

`kernel_table` sums the same trace by kernel name instead: on a GPU every kernel on
the device plane's stream lines (cuDNN's and cuBLAS's own names, XLA's fusion
kernels), whichever HLO op launched it, so one library kernel used by many
convolutions shows as one row; on a CPU the host thunks, by name.
"""
import collections
import glob
import os

import jax

DEVICE_PLANE_PREFIX = "/device:"
HOST_PLANE = "/host:CPU"
OPS_LINE = "XLA Ops"
STREAM_LINE_PREFIX = "Stream #"


def trace(run, logdir: str, steps: int = 1):
    """Calls `run()` (which must block until its device work is done) `steps` times under
    jax.profiler; returns the newest .xplane.pb written into logdir and run()'s last result."""
    os.makedirs(logdir, exist_ok=True)
    result = None
    with jax.profiler.trace(logdir):
        for index in range(steps):
            with jax.profiler.StepTraceAnnotation("step", step_num=index):
                result = run()
    return newest_trace(logdir), result


def newest_trace(logdir: str) -> str:
    paths = glob.glob(os.path.join(logdir, "plugins", "profile", "*", "*.xplane.pb"))
    if not paths:
        raise FileNotFoundError(f"no profiler trace (*.xplane.pb) under {logdir}")
    return max(paths, key=os.path.getmtime)


def _stats(event) -> dict:
    return dict(event.stats)


def op_events(profile) -> tuple[str, list]:
    """(where the times come from, [(op name, kernel or thunk name, seconds)]).

    In order: the first device plane's "XLA Ops" line; else that plane's stream lines
    (each kernel under the HLO op it names); else, with no device plane with events,
    the host's thunk events that name their HLO op (a CPU run). A device trace that
    names no op gives no events, never the host's."""
    devices = [plane for plane in profile.planes if plane.name.startswith(DEVICE_PLANE_PREFIX)]
    for plane in devices:
        for line in plane.lines:
            if line.name == OPS_LINE:
                events = [(e.name, e.name, e.duration_ns * 1e-9) for e in line.events]
                if events:
                    return f"{plane.name} {OPS_LINE}", events
    for plane in devices:
        events = [(str(op), event.name, event.duration_ns * 1e-9)
                  for line in plane.lines if line.name.startswith(STREAM_LINE_PREFIX)
                  for event, op in ((e, _stats(e).get("hlo_op")) for e in line.events) if op]
        if events:
            return f"{plane.name} stream kernels by HLO op", events
    if devices and any(line.events for plane in devices for line in plane.lines):
        return f"{devices[0].name}: no XLA op named (no table from host launch times)", []
    events = []
    for plane in profile.planes:
        if plane.name != HOST_PLANE:
            continue
        for line in plane.lines:
            for event in line.events:
                op = _stats(event).get("hlo_op")
                if op and not event.name.startswith("end:"):
                    events.append((str(op), event.name, event.duration_ns * 1e-9))
    return f"{HOST_PLANE} thunks", events


def op_table(xplane_path: str, steps: int, top: int = 10, step_seconds: float | None = None):
    """The `top` XLA ops by total time over the traced `steps`, each with its seconds per
    step, its share of all op time and (given the step's wall time) of the step."""
    profile = jax.profiler.ProfileData.from_file(xplane_path)
    source, events = op_events(profile)
    seconds, counts = collections.Counter(), collections.Counter()
    for op, _, duration in events:
        seconds[op] += duration
        counts[op] += 1
    total = sum(seconds.values())
    ops = []
    for op, op_seconds in seconds.most_common(top):
        row = {"op": op, "seconds_per_step": op_seconds / steps,
               "calls_per_step": counts[op] / steps,
               "share_of_op_time": op_seconds / total if total else 0.0}
        if step_seconds:
            row["share_of_step"] = op_seconds / steps / step_seconds
        ops.append(row)
    return {"trace": xplane_path, "source": source, "traced_steps": steps,
            "distinct_ops": len(seconds), "op_seconds_per_step": total / steps,
            "step_seconds": step_seconds, "top_ops": ops}


def format_op_table(table: dict) -> str:
    lines = [f"  top {len(table['top_ops'])} of {table['distinct_ops']} XLA ops "
             f"({table['source']}, {table['traced_steps']} traced steps, "
             f"{table['op_seconds_per_step'] * 1e3:.3f} ms of op time per step):"]
    for row in table["top_ops"]:
        step = (f"  {row['share_of_step']:6.1%} of the step" if "share_of_step" in row else "")
        lines.append(f"    {row['seconds_per_step'] * 1e3:9.3f} ms  "
                     f"{row['share_of_op_time']:6.1%} of op time{step}  "
                     f"x{row['calls_per_step']:g}  {row['op']}")
    return "\n".join(lines)


def kernel_events(profile) -> tuple[str, list]:
    """(where the times come from, [(kernel name, the HLO op it names or '', seconds)]):
    every kernel on the first device plane's stream lines that has any; else (a CPU
    run, or a device trace without stream lines) op_events' events by their own names."""
    for plane in profile.planes:
        if not plane.name.startswith(DEVICE_PLANE_PREFIX):
            continue
        events = [(event.name, str(_stats(event).get("hlo_op", "")), event.duration_ns * 1e-9)
                  for line in plane.lines if line.name.startswith(STREAM_LINE_PREFIX)
                  for event in line.events]
        if events:
            return f"{plane.name} stream kernels", events
    source, events = op_events(profile)
    return source, [(kernel, op, seconds) for op, kernel, seconds in events]


def kernel_table(xplane_path: str, steps: int, top: int = 60, step_seconds: float | None = None):
    """The `top` kernels by name, by total time over the traced `steps`: each with its
    seconds and launches per step, its share of all kernel time (and of the step, given
    its wall time), how many HLO ops launched it and the one that spent most in it."""
    profile = jax.profiler.ProfileData.from_file(xplane_path)
    source, events = kernel_events(profile)
    seconds, counts = collections.Counter(), collections.Counter()
    by_op = collections.defaultdict(collections.Counter)
    for kernel, op, duration in events:
        seconds[kernel] += duration
        counts[kernel] += 1
        by_op[kernel][op] += duration
    total = sum(seconds.values())
    kernels = []
    for kernel, kernel_seconds in seconds.most_common(top):
        ops = by_op[kernel]
        row = {"kernel": kernel, "seconds_per_step": kernel_seconds / steps,
               "calls_per_step": counts[kernel] / steps,
               "share_of_kernel_time": kernel_seconds / total if total else 0.0,
               "hlo_ops": len([op for op in ops if op]),
               "top_hlo_op": ops.most_common(1)[0][0]}
        if step_seconds:
            row["share_of_step"] = kernel_seconds / steps / step_seconds
        kernels.append(row)
    return {"trace": xplane_path, "source": source, "traced_steps": steps,
            "distinct_kernels": len(seconds), "kernel_seconds_per_step": total / steps,
            "step_seconds": step_seconds, "top_kernels": kernels}


def format_kernel_table(table: dict, width: int = 100) -> str:
    """kernel_table as lines; names longer than `width` are cut (the JSON has them whole)."""
    lines = [f"  top {len(table['top_kernels'])} of {table['distinct_kernels']} kernels by name "
             f"({table['source']}, {table['traced_steps']} traced steps, "
             f"{table['kernel_seconds_per_step'] * 1e3:.3f} ms of kernel time per step):"]
    for row in table["top_kernels"]:
        step = (f"  {row['share_of_step']:6.1%} of the step" if "share_of_step" in row else "")
        name = row["kernel"] if len(row["kernel"]) <= width else row["kernel"][:width - 3] + "..."
        ops = (f"  ({row['top_hlo_op']}" + (f" and {row['hlo_ops'] - 1} more HLO ops" if
                                            row["hlo_ops"] > 1 else "") + ")"
               if row["top_hlo_op"] and row["top_hlo_op"] != row["kernel"] else "")
        lines.append(f"    {row['seconds_per_step'] * 1e3:9.3f} ms  "
                     f"{row['share_of_kernel_time']:6.1%} of kernel time{step}  "
                     f"x{row['calls_per_step']:g}  {name}{ops}")
    return "\n".join(lines)
