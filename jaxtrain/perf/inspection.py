"""What XLA made of one training step (`python -m jaxtrain.bench --inspect`).

It compiles one training step of any config and reads what
XLA made of it: kernels launched (fusions, library calls, copies, collectives),
FLOPs and bytes from XLA's cost analysis, then times the step to give achieved
TFLOP/s and the fraction of the device's bfloat16 peak. FLOPs are counted on the
lowered program (before XLA's passes): on a GPU the compiled program's convolutions
and matrix products are cuDNN/cuBLAS custom calls that XLA's cost analysis counts as
nothing. The step time is the fastest of several timings of a short chunk (first-run
costs and noise kept out). --profile=DIR adds a
jax.profiler trace of those steps, the ten XLA ops and the 60 kernels (by name) that
took the most time; the step's optimised HLO text is written beside it
(train_step.hlo.txt.gz; --hlo=FILE names another place, --json=FILE.json puts it
beside that), so a kernel's op can be looked up."""
import functools
import gzip
import math
import os
import sys
import time

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np

from jaxtrain import models
from jaxtrain.config import checks
from jaxtrain.models.ops import onednn
from jaxtrain.perf import benchmark, hlo, profile
from jaxtrain.runtime import mesh as mesh_lib
from jaxtrain.runtime import processes
from jaxtrain.training import chunks, placement, prepare, step

# Dense bfloat16 tensor-core peaks (TFLOP/s, no sparsity) from the vendors' data sheets,
# matched against jax's device_kind; the first match wins.
TOP_KERNELS = 60  # --inspect --profile: rows of the table by kernel name
PEAK_BF16_TFLOPS = (("H200", 989.4), ("H100 PCIe", 756.0), ("H100", 989.4), ("A100", 312.0),
                    ("L40S", 362.1), ("L4", 121.0))


def peak_tflops(device_kind: str):
    return next((peak for name, peak in PEAK_BF16_TFLOPS if name in device_kind), None)


def cost(program) -> dict:
    """XLA's cost analysis of a lowered or compiled program (per device), as a plain dict."""
    analysis = program.cost_analysis()
    if isinstance(analysis, (list, tuple)):  # older jax: one dict per program
        analysis = analysis[0] if analysis else {}
    return dict(analysis or {})


def matmul_flops(jaxpr) -> float:
    """FLOPs of the matrix products and convolutions in a (closed) jaxpr, 2 per
    multiply-add (every kernel tap, padding included), sub-programs included (a scan's
    body times its length; a while loop's body once, its trip count being unknown; a
    cond's costliest branch). Counted from
    shapes, so the same on every backend: XLA's own cost analysis is empty on some GPU
    builds and blind to library calls (oneDNN's convolutions on a CPU)."""
    total = 0.0
    for eqn in _live_equations(getattr(jaxpr, "jaxpr", jaxpr)):
        name = eqn.primitive.name
        shapes = [tuple(v.aval.shape) for v in eqn.invars if hasattr(v.aval, "shape")]
        outs = [tuple(v.aval.shape) for v in eqn.outvars]
        if name == "dot_general":
            (contracting, _), _ = eqn.params["dimension_numbers"]
            total += 2 * math.prod(outs[0]) * math.prod(shapes[0][d] for d in contracting)
        elif name == "conv_general_dilated":
            rhs, rhs_spec = shapes[1], eqn.params["dimension_numbers"].rhs_spec
            total += 2 * math.prod(outs[0]) * math.prod(rhs) / rhs[rhs_spec[0]]
        elif name == "ffi_call":
            total += onednn.call_flops(eqn.params.get("target_name", ""), shapes, outs) or 0
        else:
            subs = [matmul_flops(v) for v in eqn.params.values() if _is_jaxpr(v)]
            branches = [matmul_flops(b) for b in eqn.params.get("branches", ())]
            total += (eqn.params["length"] if name == "scan" else 1) * sum(subs)
            total += max(branches, default=0.0)
    return total


def _live_equations(jaxpr) -> list:
    """The equations whose results reach the jaxpr's outputs (or that have effects): a
    traced gradient keeps work XLA will drop, such as a forward pass whose value no
    output needs."""
    live = {v for v in jaxpr.outvars if not isinstance(v, jax.extend.core.Literal)}
    kept = []
    for eqn in reversed(jaxpr.eqns):
        if eqn.effects or any(v in live for v in eqn.outvars):
            kept.append(eqn)
            live.update(v for v in eqn.invars if not isinstance(v, jax.extend.core.Literal))
    return kept[::-1]


def _is_jaxpr(value) -> bool:
    return hasattr(value, "eqns") or hasattr(getattr(value, "jaxpr", None), "eqns")


HLO_FILE = "train_step.hlo.txt.gz"  # --inspect --profile=DIR: the step's optimised HLO, in DIR


def hlo_path(hlo_flag: str | None, profile_dir: str | None, json_path: str | None):
    """Where --inspect writes the step's optimised HLO text: --hlo, else in the --profile
    folder, else beside --json (FILE.json -> FILE.hlo.txt.gz); None: not written."""
    if hlo_flag:
        return hlo_flag
    if profile_dir:
        return os.path.join(profile_dir, HLO_FILE)
    if json_path:
        return os.path.splitext(json_path)[0] + ".hlo.txt.gz"
    return None


def write_hlo(path: str, text: str) -> None:
    """`text` gzipped into `path` (its folder made), through a temporary file."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    partial = path + ".partial"
    with gzip.open(partial, "wt", encoding="utf-8") as f:
        f.write(text)
    os.replace(partial, path)


def inspect(config, steps: int = 10, profile_dir: str | None = None, repeats: int = 5,
            hlo_file: str | None = None) -> dict:
    """Compiles one train step of `config`, reports its kernels, FLOPs and speed; with
    `profile_dir`, also traces one more chunk of `steps` steps there and lists the XLA ops
    and the kernels (by name) that took the most time. The step time is the fastest of
    `repeats` timed chunks. The step's optimised HLO text is written (gzip) to
    `hlo_file`, else into `profile_dir` (HLO_FILE), so a trace's op names can be looked
    up in it."""
    mesh = placement.create_mesh(config.parallel.fsdp)
    placement.check_batch_split(config.train.batch_size, mesh, config.train.accumulate_steps)
    run = benchmark.device_resident(prepare.setup(config, mesh), "--inspect")
    x_train, y_train = placement.put_train_data(run)
    spec = prepare.step_spec(config, run)
    replicated = mesh_lib.replicated(run.mesh)
    out_sharding = (placement.state_sharding(run), replicated)
    order = chunks.epoch_order_fn(len(x_train), spec, replicated)(run.data_key, np.int32(0))

    start = time.perf_counter()
    step_fn = jax.jit(functools.partial(step.train_step_at, spec=spec), donate_argnums=0,
                      out_shardings=out_sharding)
    traced = step_fn.trace(run.state, np.int32(0), x_train, y_train, *order)
    lowered = traced.lower()
    compiled = lowered.compile()
    compile_seconds = time.perf_counter() - start
    text = compiled.as_text()
    hlo_file = hlo_path(hlo_file, profile_dir, None)
    if hlo_file and processes.is_main_process():
        write_hlo(hlo_file, text)
    analysis, compiled_analysis = cost(lowered), cost(compiled)
    step_matmul_flops = matmul_flops(traced.jaxpr)  # the program just lowered, traced once

    # Time the loop training would use: a lax.scan chunk, or one call per step.
    loop = chunks.resolve_loop(config.train.loop, run.xla_convolutions)
    steps = max(1, min(steps, run.steps_per_epoch))
    run_chunk = chunks.compile_chunks(loop, run.state, x_train, y_train, run.data_key,
                                      {steps}, spec, out_sharding)
    state = jax.tree.map(jnp.copy, run.state)  # the step donates its input
    state, _ = jax.block_until_ready(run_chunk(state, run.data_key, 0, 0, steps))  # warm-up
    timings = []
    for _ in range(max(repeats, 1)):
        start = time.perf_counter()
        state, _ = jax.block_until_ready(run_chunk(state, run.data_key, 0, 0, steps))
        timings.append((time.perf_counter() - start) / steps)
    step_seconds = min(timings)
    ops = None
    if profile_dir:
        path, _ = profile.trace(
            lambda: jax.block_until_ready(run_chunk(state, run.data_key, 0, 0, steps)),
            profile_dir)
        ops = profile.op_table(path, steps, step_seconds=step_seconds)
        ops["kernels"] = profile.kernel_table(path, steps, top=TOP_KERNELS,
                                              step_seconds=step_seconds)

    devices = run.mesh.size
    # Per device. XLA's count of the lowered program (elementwise work included) where it
    # gives one; where it gives none (jax 0.11.2 on the H200), the jaxpr's matrix work.
    flops = float(analysis.get("flops", 0.0))
    source = "lowered program"
    if flops <= 0:
        flops, source = step_matmul_flops / devices, "jaxpr (matrix products and convolutions)"
    device_kind = jax.devices()[0].device_kind
    peak = peak_tflops(device_kind)
    achieved = flops / step_seconds / 1e12
    kernels = hlo.kernel_counts(text)
    return {
        "model": config.model.name, "batch_size": config.train.batch_size,
        "precision": checks.resolve_precision(config.train.precision), "device_kind": device_kind, "devices": devices,
        "param_count": models.count_params(run.state.params),
        "compile_seconds": compile_seconds,
        "kernels_per_step": sum(kernels.values()), "kernels": dict(kernels.most_common()),
        "flops_per_step": flops * devices, "flops_source": source,
        "matmul_flops_per_step": step_matmul_flops,
        # XLA's count on the compiled program: equal on a CPU, 0 or less on a GPU where
        # convolutions and matrix products became library calls.
        "compiled_flops_per_step": float(compiled_analysis.get("flops", 0.0)) * devices,
        "flops_per_image": flops * devices / config.train.batch_size,
        "bytes_accessed_per_step": float(analysis.get("bytes accessed", 0.0)) * devices,
        "loop": loop, "timed_steps": steps, "step_seconds": step_seconds,
        "step_seconds_timings": timings,
        "images_per_second": config.train.batch_size / step_seconds,
        "achieved_tflops_per_device": achieved,
        "peak_bf16_tflops_per_device": peak,
        "fraction_of_peak": achieved / peak if peak else None,
        "collectives_per_step": {kind: {"ops": count, "bytes": size} for kind, (count, size)
                                 in hlo.collective_traffic(text).items()},
        "profile": ops,
        "hlo_file": hlo_file,
    }


def print_inspection(info: dict, config_name: str, stream=sys.stdout) -> None:
    def line(text):
        print(text, file=stream)

    line(f"{config_name}: {info['model']} ({info['param_count']:,} parameters), batch "
         f"{info['batch_size']}, {info['precision']}, {info['devices']} x {info['device_kind']}")
    line(f"  compile (one train step):  {info['compile_seconds']:.2f} s")
    kinds = ", ".join(f"{kind} {count}" for kind, count in info["kernels"].items())
    line(f"  XLA kernels per step:      {info['kernels_per_step']} ({kinds})")
    line(f"  FLOPs per step:            {info['flops_per_step'] / 1e9:,.4g} G "
         f"({info['flops_per_image'] / 1e9:.4g} G per image; {info['flops_source']})")
    line(f"  bytes accessed per step:   {info['bytes_accessed_per_step'] / 1e9:,.4g} GB")
    peak = (f", {info['fraction_of_peak']:.1%} of the {info['peak_bf16_tflops_per_device']:g} "
            "TFLOP/s bf16 peak" if info["fraction_of_peak"] is not None
            else " (no bf16 peak known for this device)")
    line(f"  step time:                 {info['step_seconds'] * 1e3:.2f} ms "
         f"(fastest of {len(info['step_seconds_timings'])} chunks of {info['timed_steps']}, "
         f"{info['loop']} loop), "
         f"{info['images_per_second']:,.0f} images/s")
    line(f"  achieved:                  {info['achieved_tflops_per_device']:.3f} TFLOP/s per "
         f"device{peak}")
    for kind, traffic in info["collectives_per_step"].items():
        line(f"  {kind + ' per step:':<27}{traffic['ops']} ops, "
             f"{traffic['bytes'] / 1e6:.2f} MB per device")
    if info.get("hlo_file"):
        line(f"  optimised HLO of the step: {info['hlo_file']}")
    if info.get("profile"):
        line(f"  profile:                   {os.path.dirname(info['profile']['trace'])}")
        line(profile.format_op_table(info["profile"]))
        if info["profile"].get("kernels"):
            line(profile.format_kernel_table(info["profile"]["kernels"]))
