"""Speed: the speedrun benchmark and the XLA inspection report.

    python -m jaxtrain.bench --config=configs/cifar_speedrun.py --runs=10 [--json=FILE]
        [--devices=N] [--compilation_cache=DIR] [--whole_process]
    python -m jaxtrain.bench --config=configs/cifar.py --inspect [--profile=DIR] [--json=FILE]
        [--hlo=FILE]
    python -m jaxtrain.bench --config=configs/imagenet_resnet50.py --input-only [--batches=N]
    python -m jaxtrain.bench --config=configs/imagenet_resnet50.py --memory [--json=FILE]

The benchmark times what the public PyTorch speedruns time: from the first
training step to the final test accuracy, data already on the device,
compilation excluded. Each run, with its own seed, is one XLA program (init,
every epoch as a lax.scan of steps, the test-time-augmented evaluation; with
train.drop_finished_groups the scans are split where a parameter group's
train_steps end, and the steps after compute no gradient for it),
compiled once for all runs: the seed is an argument, not a constant.

It runs on one device unless --devices says more: the public records are
single-GPU, so a number from a larger mesh would not compare with them.

What a user waits for is the whole process (start-up, data loading, compiling,
training), and most of that is compilation. --whole_process reports it twice,
by running the benchmark as two child processes sharing a persistent
compilation cache: cold (empty cache), then warm (the cache the cold run
wrote). The cache is a fresh folder every time, never an existing one emptied:
under --compilation_cache=DIR a new subfolder of DIR, kept; otherwise a
temporary folder, removed at the end.

The inspection report compiles one training step of any config and reads what
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
beside that), so a kernel's op can be looked up.

--input-only times the streaming input pipeline alone (data.placement='stream',
whatever the config says): the config's batches read, decoded, augmented on
the host and put on the devices, with no training step, so its images/s is
the most a streamed run could train at. The first batch (worker start-up) is
timed apart.

--memory compiles the config's train step for shapes only and prints what it
needs per device (jaxtrain/memory.py): the effect of train.accumulate_steps,
model.remat and parallel.fsdp, seen before a run is started.
"""
import os
import time


def process_start_time() -> float:
    """When this Python process started (Linux /proc), else now: the whole-process clock."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime"))
        return boot + start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


PROCESS_START = process_start_time()

import functools  # noqa: E402  (after the clock: the imports below are part of the run)
import gzip  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

import jax  # noqa: E402
import jax.extend  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxtrain import (data, hlo, models, onednn, parallel, prepare, profile, report,  # noqa: E402
                      train, xla_flags)
from jaxtrain.errors import ConfigError, TrainingError  # noqa: E402

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


# ---------------------------------------------------------------- inspection

def device_resident(run, what: str):
    """`run`, if its training data is on the devices: what these programs time."""
    if run.placement != "device":
        raise ConfigError(f"{what} times the device-resident data path, but this run "
                                f"streams ({run.placement_reason}); set "
                                "--config.data.placement=device, or time the loader with "
                                "--input-only")
    if run.runs:
        raise ConfigError(f"{what} times one run: train.replicas and sweep are main.py's "
                          "(drop them, or run main.py and read summary.json's "
                          "images_per_second_per_replica)")
    return run


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
    mesh = prepare.create_mesh(config)
    prepare.check_batch_split(config.train.batch_size, mesh, config.train.accumulate_steps)
    run = device_resident(prepare.setup(config, mesh), "--inspect")
    x_train, y_train = prepare.put_train_data(run)
    step_kwargs = prepare.step_arguments(config, run)
    replicated = parallel.replicated(run.mesh)
    out_sharding = (prepare.state_sharding(run), replicated)
    order = train.epoch_order_fn(len(x_train), step_kwargs, replicated)(run.data_key, np.int32(0))

    start = time.perf_counter()
    step_fn = jax.jit(functools.partial(train.train_step_at, **step_kwargs), donate_argnums=0,
                      out_shardings=out_sharding)
    traced = step_fn.trace(run.state, np.int32(0), x_train, y_train, *order)
    lowered = traced.lower()
    compiled = lowered.compile()
    compile_seconds = time.perf_counter() - start
    text = compiled.as_text()
    hlo_file = hlo_path(hlo_file, profile_dir, None)
    if hlo_file and parallel.is_main_process():
        write_hlo(hlo_file, text)
    analysis, compiled_analysis = cost(lowered), cost(compiled)
    step_matmul_flops = matmul_flops(traced.jaxpr)  # the program just lowered, traced once

    # Time the loop training would use: a lax.scan chunk, or one call per step.
    loop = train.resolve_loop(config.train.loop, models.xla_convolutions(config.model))
    steps = max(1, min(steps, run.steps_per_epoch))
    run_chunk = train.compile_chunks(loop, run.state, x_train, y_train, run.data_key,
                                     {steps}, step_kwargs, out_sharding)
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
        "precision": config.train.precision, "device_kind": device_kind, "devices": devices,
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


# ---------------------------------------------------------------- the speedrun

def whole_run(seed, x_train, y_train, eval_arrays, *, model, tx, image_shape, state_sharding,
              whiten, steps_per_epoch, total_steps, step_kwargs, eval_kwargs, cuts=None,
              with_weights=False):
    """One run from its seed to its test metrics: the body of the benchmark's one program.

    Seeds derive keys exactly as prepare.setup does, and a whitened stem's filters
    come from the same function (`whiten`, prepare.whitening_fn, or None) computed
    here, inside the timed program, as the public speedruns count it; so a run
    here is the run `python main.py` makes with the same config and seed.
    `cuts` (train.drop_finished_groups: train.finished_groups): the steps from each cut
    on compute no gradient for the parameters held constant there, as main.py's chunks
    after it do. `with_weights`: also returns the trained {"params", "batch_stats"}.
    """
    init_key, data_key = jax.random.split(jax.random.key(seed))
    stem_kernel = None if whiten is None else whiten(x_train[:models.WHITENING_IMAGES])
    state = train.create_train_state(init_key, model, tx, image_shape, state_sharding,
                                     stem_kernel)
    last_epoch = (total_steps - 1) // steps_per_epoch
    last_losses, nonfinite = [], jnp.zeros((), jnp.int32)  # the last epoch's per-step losses
    for begin, end, constant in phases(total_steps, cuts or {}):
        kwargs = dict(step_kwargs, constant_params=constant) if constant else step_kwargs

        def chunk(state, epoch, first_step=0, num_steps=steps_per_epoch, kwargs=kwargs):
            return train.train_epoch_chunk(state, x_train, y_train, data_key, epoch, first_step,
                                           num_steps=num_steps, **kwargs)

        for epoch, first_step, num_steps, epochs in pieces(begin, end, steps_per_epoch):
            if epochs:  # whole epochs, one lax.scan over them
                state, summary = jax.lax.scan(chunk, state, epoch + jnp.arange(epochs))
                losses = summary["per_step"]["loss"][-1]
                epoch += epochs - 1
            else:
                state, summary = chunk(state, epoch, first_step, num_steps)
                losses = summary["per_step"]["loss"]
            nonfinite += jnp.sum(summary["nonfinite_steps"]).astype(jnp.int32)
            if epoch == last_epoch:
                last_losses.append(losses)
    losses = jnp.concatenate(last_losses) if last_losses else jnp.full((1,), jnp.nan)
    finite = jnp.isfinite(losses)  # the mean over finite steps, as train.summarize_chunk's
    train_loss = jnp.sum(jnp.where(finite, losses, 0.0)) / jnp.maximum(jnp.sum(finite), 1)
    metrics = train.evaluate(state, *eval_arrays, **eval_kwargs)
    result = {"test_accuracy": metrics["accuracy"], "test_loss": metrics["loss"],
              "train_loss": train_loss, "nonfinite_steps": nonfinite}
    if with_weights:
        return result, {"params": state.params, "batch_stats": state.batch_stats}
    return result


def phases(total_steps: int, cuts: dict) -> list:
    """[(first step, end step, parameters held constant)]: the run split at the cuts."""
    bounds = [0, *(cut for cut in sorted(cuts) if 0 < cut < total_steps), total_steps]
    return [(begin, end, train.constant_at(cuts, begin)) for begin, end in zip(bounds, bounds[1:])]


def pieces(begin: int, end: int, steps_per_epoch: int) -> list:
    """Steps begin .. end - 1 as [(epoch, first step in it, steps, whole epochs)]: the rest
    of a started epoch, then the whole epochs (one piece, a scan: `whole epochs` > 0, from
    `epoch`), then the start of the last one."""
    out, step = [], begin
    if step % steps_per_epoch and step < end:
        num_steps = min(steps_per_epoch - step % steps_per_epoch, end - step)
        out.append((step // steps_per_epoch, step % steps_per_epoch, num_steps, 0))
        step += num_steps
    epochs = (end - step) // steps_per_epoch
    if epochs:
        out.append((step // steps_per_epoch, 0, steps_per_epoch, epochs))
        step += epochs * steps_per_epoch
    if step < end:
        out.append((step // steps_per_epoch, 0, end - step, 0))
    return out


class UsageError(ValueError):
    """A flag value this run cannot honour; the message names the flag."""


def select_devices(count: int) -> list:
    """The first `count` devices: a benchmark's device count is part of its result."""
    available = jax.devices()
    if not 1 <= count <= len(available):
        raise UsageError(f"--devices={count}: must be from 1 to {len(available)}, the number of "
                         f"{jax.default_backend()} devices available")
    if jax.process_count() > 1 and count != len(available):
        # A mesh without some process's devices leaves that process nothing to run.
        raise UsageError(f"--devices={count}: a multi-process run uses every device; pass "
                         f"--devices={len(available)} ({jax.process_count()} processes)")
    return available[:count]


def benchmark(config, runs: int, warmup: int = 1, first_seed=None, devices: int = 1,
              stream=sys.stdout, progress=None) -> dict:
    """`runs` timed runs with seeds first_seed, first_seed + 1, ... (default config.seed),
    on the first `devices` devices. progress(summary), if given, is called with the
    summary so far after compiling and after every run (--json writes it each time, so
    a benchmark stopped part-way still reports its compile time and finished runs)."""
    if config.parallel.fsdp > 1:
        raise UsageError("the speedrun benchmark times replicated runs; parallel.fsdp is for "
                         "main.py, --inspect and --memory")
    mesh = parallel.create_mesh(select_devices(devices))
    prepare.check_batch_split(config.train.batch_size, mesh,  # before loading any data
                              config.train.accumulate_steps)
    run = device_resident(prepare.setup(config, mesh, abstract_state=True), "the benchmark")
    x_train, y_train = prepare.put_train_data(run)
    eval_arrays = prepare.put_eval_data(config, run)
    replicated = parallel.replicated(run.mesh)
    program = jax.jit(whole_run_fn(config, run), out_shardings=replicated)
    start = time.perf_counter()
    lowered = program.lower(np.int32(0), x_train, y_train, eval_arrays)
    # Tracing and lowering: the part of compile_seconds a compilation cache cannot skip.
    lower_seconds = time.perf_counter() - start
    program = lowered.compile()
    compile_seconds = time.perf_counter() - start
    device_kind, backend = mesh.devices.flat[0].device_kind, jax.default_backend()
    print(f"{config.model.name}, {run.total_steps} steps of batch {config.train.batch_size} "
          f"({run.total_steps / run.steps_per_epoch:g} epochs), {config.train.precision}, "
          f"tta={config.eval.tta}, {mesh.size} x {device_kind} ({backend} backend); "
          f"compile {compile_seconds:.2f} s", file=stream, flush=True)

    summary = {
        "config": config.to_dict(), "runs": [], "runs_asked": runs, "warmup_runs": warmup,
        "compile_seconds": compile_seconds, "lower_seconds": lower_seconds,
        "process_seconds": time.time() - PROCESS_START,
        "backend": backend, "device_kind": device_kind, "devices": mesh.size,
        "compilation_cache": jax.config.jax_compilation_cache_dir,
        "xla_flags": xla_flags.in_effect(),
        "dataset": run.dataset.origin, "jax_version": jax.__version__,
        "date": time.strftime("%Y-%m-%d"), "finished": False,
    }
    report_progress = progress or (lambda summary: None)
    report_progress(summary)
    first_seed = config.seed if first_seed is None else first_seed
    for i in range(warmup):  # not counted, as in the PyTorch speedruns
        jax.block_until_ready(program(np.int32(first_seed + runs + i), x_train, y_train,
                                      eval_arrays))
    results = summary["runs"]
    for i in range(runs):
        seed = first_seed + i
        start = time.perf_counter()
        metrics = jax.device_get(program(np.int32(seed), x_train, y_train, eval_arrays))
        seconds = time.perf_counter() - start
        # process_seconds: the whole process up to this run's accuracy (with --warmup=0,
        # the first run's is what a user of a cold start waits for)
        result = {"seed": seed, "seconds": seconds,
                  "process_seconds": time.time() - PROCESS_START,
                  **{k: float(v) for k, v in metrics.items()}}
        results.append(result)
        print(f"run {i + 1}/{runs}  seed {seed}  test_accuracy {result['test_accuracy']:.2%}  "
              f"seconds {seconds:.3f}", file=stream, flush=True)
        if result["nonfinite_steps"] and config.train.nonfinite == "stop":
            raise TrainingError(
                f"seed {seed}: {int(result['nonfinite_steps'])} training steps had a non-finite "
                "loss; lower optimizer.learning_rate or set train.nonfinite='skip'")
        summary.update(run_statistics(results), process_seconds=time.time() - PROCESS_START)
        report_progress(summary)
    summary.update(process_seconds=time.time() - PROCESS_START, finished=True)
    if not results:  # --runs=0: compile (and warm up) only
        print(f"compile {compile_seconds:.2f} s  whole process {summary['process_seconds']:.1f} s",
              file=stream, flush=True)
        return summary
    print(f"{runs} runs: test_accuracy {summary['accuracy_mean']:.2%} +- "
          f"{summary['accuracy_std']:.2%}  seconds {summary['seconds_mean']:.3f} +- "
          f"{summary['seconds_std']:.3f} (min {summary['seconds_min']:.3f}, max "
          f"{summary['seconds_max']:.3f})  compile {compile_seconds:.2f} s  whole process "
          f"{summary['process_seconds']:.1f} s", file=stream, flush=True)
    return summary


def whole_run_fn(config, run, **kwargs):
    """whole_run for `config` and its prepare.setup `run` (on one mesh), to jit; kwargs:
    whole_run's (with_weights)."""
    cuts = (train.finished_groups(config.optimizer, run.state.params, run.total_steps,
                                  models.frozen_params(config.model))
            if config.train.get("drop_finished_groups", False) else {})
    return functools.partial(
        whole_run, model=run.model, tx=run.state.tx, image_shape=run.dataset.image_shape,
        state_sharding=parallel.replicated(run.mesh),
        whiten=(prepare.whitening_fn(config, run.mean, run.std)
                if models.has_whitened_stem(config.model) else None),
        steps_per_epoch=run.steps_per_epoch,
        total_steps=run.total_steps, step_kwargs=prepare.step_arguments(config, run),
        eval_kwargs=prepare.eval_arguments(config, run), cuts=cuts, **kwargs)


def run_statistics(results: list) -> dict:
    """Mean and spread of the finished runs' accuracy and seconds."""
    accuracy = np.array([r["test_accuracy"] for r in results])
    seconds = np.array([r["seconds"] for r in results])
    return dict(accuracy_mean=float(accuracy.mean()), accuracy_std=float(accuracy.std()),
                seconds_mean=float(seconds.mean()), seconds_std=float(seconds.std()),
                seconds_min=float(seconds.min()), seconds_max=float(seconds.max()))


# ---------------------------------------------------------------- cold and warm

class ChildFailed(RuntimeError):
    """A --whole_process child exited non-zero; the message carries its last error line."""


def enable_compilation_cache(directory: str) -> None:
    """Keeps every compiled program in `directory`. Must run before the first compilation:
    JAX reads these settings once, when it first compiles."""
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise UsageError(f"--compilation_cache={directory}: not a folder")
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as error:
        raise UsageError(f"--compilation_cache={directory}: cannot create it "
                         f"({error.strerror or error})") from None
    if not os.access(directory, os.W_OK | os.X_OK):
        raise UsageError(f"--compilation_cache={directory}: not writable")
    jax.config.update("jax_compilation_cache_dir", directory)
    # JAX's defaults skip programs that compile in under a second; a warm start needs all.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def count_files(directory: str) -> int:
    return sum(len(files) for _, _, files in os.walk(directory))


def run_child(name: str, command: list, scratch: str, stream) -> None:
    """Runs `command`, copying its stdout to `stream` as it comes (a speedrun's compile
    takes a while); its stderr is kept aside for the one-line error if it fails."""
    with open(os.path.join(scratch, f"{name}.stderr"), "w+") as errors:
        with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=errors, text=True) as child:
            for line in child.stdout:
                stream.write(line)
                stream.flush()
        errors.seek(0)
        error_text = errors.read()
    if child.returncode:
        lines = [line.strip() for line in error_text.splitlines() if line.strip()]
        last = lines[-1].removeprefix("error: ") if lines else "no error output"
        how = (f"killed by signal {-child.returncode}" if child.returncode < 0
               else f"exit {child.returncode}")
        raise ChildFailed(f"the {name} run failed ({how}): {last}")
    sys.stderr.write(error_text)  # its warnings, if any


def whole_process(args: list, cache_root=None, stream=sys.stdout) -> dict:
    """Runs `python -m jaxtrain.bench *args` twice, cold then warm, sharing a persistent
    compilation cache.

    Each run is a new process because that is what a user's next command is: a
    second run in this process would find its programs in memory and time nothing
    a user gets. This process never touches a device, which stays free for them.
    """
    with tempfile.TemporaryDirectory(prefix="jaxtrain-bench-") as scratch:
        if cache_root:  # a fresh subfolder: emptying a folder the user named could lose data
            try:
                os.makedirs(cache_root, exist_ok=True)
                cache = os.path.abspath(tempfile.mkdtemp(prefix="whole_process-", dir=cache_root))
            except OSError as error:
                raise UsageError(f"--compilation_cache={cache_root}: cannot create a folder "
                                 f"there ({error.strerror or error})") from None
        else:
            cache = os.path.join(scratch, "compilation_cache")
        summaries, cache_files = {}, {}
        for name in ("cold", "warm"):
            print(f"{name} process: compilation cache {cache} ({count_files(cache)} files)",
                  file=stream, flush=True)
            path = os.path.join(scratch, f"{name}.json")
            # Later flags win: these override any in args (or in a --flagfile there).
            run_child(name, [sys.executable, "-m", "jaxtrain.bench", *args, "--nowhole_process",
                             f"--compilation_cache={cache}", f"--json={path}"], scratch, stream)
            with open(path) as f:
                summaries[name] = json.load(f)
            cache_files[name] = count_files(cache)
    cold, warm = summaries["cold"], summaries["warm"]
    print(f"whole process: cold {cold['process_seconds']:.1f} s (compile "
          f"{cold['compile_seconds']:.1f} s), warm {warm['process_seconds']:.1f} s (compile "
          f"{warm['compile_seconds']:.1f} s)", file=stream, flush=True)
    return {
        "cold": cold, "warm": warm,
        "whole_process": {"cold_seconds": cold["process_seconds"],
                          "cold_compile_seconds": cold["compile_seconds"],
                          "warm_seconds": warm["process_seconds"],
                          "warm_compile_seconds": warm["compile_seconds"]},
        # Files in the cache after each run: the warm run should add none.
        "cache_files": cache_files,
        "compilation_cache": cache if cache_root else None,  # None: removed with the run
    }


def main(argv):
    from absl import flags
    from absl import logging
    from ml_collections import config_flags

    FLAGS = flags.FLAGS
    logging.set_verbosity(logging.WARNING)
    if len(argv) > 1:
        sys.exit(f"error: unexpected arguments: {' '.join(argv[1:])}")
    distributed = (FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id)
    try:
        if FLAGS.inspect and (FLAGS["devices"].present or FLAGS.whole_process):
            raise UsageError("--devices and --whole_process are for the benchmark; --inspect "
                             "compiles for every device")
        input_only_flag = FLAGS["input-only"].value
        if input_only_flag and (FLAGS.inspect or FLAGS.whole_process):
            raise UsageError("--input-only times the input pipeline alone; drop --inspect "
                             "and --whole_process")
        if FLAGS.memory and (FLAGS.inspect or input_only_flag or FLAGS.whole_process
                             or FLAGS["devices"].present):
            raise UsageError("--memory compiles one step for every device and runs nothing; "
                             "drop --inspect, --input-only, --whole_process and --devices")
        if FLAGS.profile and not FLAGS.inspect:
            raise UsageError("--profile traces the steps --inspect compiles; add --inspect")
        if FLAGS.hlo and not FLAGS.inspect:
            raise UsageError("--hlo writes the step --inspect compiles; add --inspect")
        if FLAGS.whole_process:
            if parallel.distributed_settings(*distributed) is not None:
                raise UsageError("--whole_process runs single-process benchmarks only")
            result = whole_process(sys.argv[1:], FLAGS.compilation_cache)
        else:
            if FLAGS.compilation_cache:
                enable_compilation_cache(FLAGS.compilation_cache)
            parallel.initialize(*distributed)
            if FLAGS.memory:
                from jaxtrain import memory
                result = memory.step_memory(FLAGS.config)
                if parallel.is_main_process():
                    print(memory.describe(result), flush=True)
            elif input_only_flag:
                result = input_only(FLAGS.config, FLAGS.batches)
            elif FLAGS.inspect:
                result = inspect(FLAGS.config, FLAGS.steps, FLAGS.profile, FLAGS.repeats,
                                 hlo_path(FLAGS.hlo, FLAGS.profile, FLAGS.json))
                if parallel.is_main_process():
                    print_inspection(result, config_flags.get_config_filename(FLAGS["config"]))
            else:
                write = FLAGS.json and parallel.is_main_process()
                result = benchmark(FLAGS.config, FLAGS.runs, FLAGS.warmup, FLAGS.seed,
                                   FLAGS.devices, progress=(
                                       functools.partial(report.write_json_atomically,
                                                         FLAGS.json) if write else None))
    except (data.DataError, ConfigError, TrainingError, parallel.DistributedError,
            UsageError, ChildFailed) as error:
        sys.exit(f"error: {error}")
    # (--whole_process: this process asks no device anything, not even its process index)
    if FLAGS.json and (FLAGS.whole_process or parallel.is_main_process()):
        report.write_json_atomically(FLAGS.json, result)


def input_only(config, batches: int = 50, stream=sys.stdout) -> dict:
    """Reads `batches` batches (after a first, untimed one) through the config's stream."""
    config = config.copy_and_resolve_references()
    with config.unlocked():
        config.data.placement = "stream"
    run = prepare.setup(config, abstract_state=True)
    prepare.check_batch_split(config.train.batch_size, run.mesh)
    source = prepare.open_stream(config, run, run.data_key)
    try:
        start = time.perf_counter()
        source.open(0)
        jax.block_until_ready(source.next())
        first_seconds = time.perf_counter() - start
        source.wait_seconds = 0.0
        start = time.perf_counter()
        for _ in range(batches):
            jax.block_until_ready(source.next())
        seconds = time.perf_counter() - start
    finally:
        source.close()
    result = {"images_per_second": batches * config.train.batch_size / seconds,
              "batches": batches, "batch_size": config.train.batch_size, "seconds": seconds,
              "first_batch_seconds": first_seconds, "workers": source.workers,
              "image_shape": list(source.image_shape), "augment_crop": config.augment.crop,
              "dataset": run.dataset.origin, "device_kind": jax.devices()[0].device_kind}
    if parallel.is_main_process():
        print(f"input only: {result['images_per_second']:,.0f} images/s ({batches} batches of "
              f"{config.train.batch_size}, {tuple(source.image_shape)}, "
              f"{source.workers or 'no'} worker processes, crop {config.augment.crop!r}); "
              f"first batch after {first_seconds:.2f} s", file=stream, flush=True)
    return result


def define_flags():
    from absl import flags
    from ml_collections import config_flags

    config_flags.DEFINE_config_file("config", None, "Path to a config file with get_config().",
                                    lock_config=True)
    flags.DEFINE_integer("runs", 10, "Timed runs, seeds --seed, --seed + 1, ...; 0: compile only.",
                         lower_bound=0)
    flags.DEFINE_integer("warmup", 1, "Untimed runs before the timed ones (same program).",
                         lower_bound=0)
    flags.DEFINE_integer("seed", None, "First seed (default: config.seed).")
    flags.DEFINE_integer("devices", 1, "Benchmark on the first N devices (the public records "
                         "use one GPU).")
    flags.DEFINE_string("compilation_cache", None, "Keep compiled programs in this folder "
                        "(JAX's persistent compilation cache), for later processes to reuse.")
    flags.DEFINE_bool("whole_process", False, "Run the benchmark twice in new processes, with "
                      "an empty compilation cache and then the one the first run wrote, and "
                      "report both whole-process times.")
    flags.DEFINE_bool("inspect", False, "Report XLA kernels, FLOPs and speed of one train "
                      "step instead of benchmarking.")
    flags.DEFINE_integer("steps", 10, "--inspect: steps in the timed chunk.", lower_bound=1)
    flags.DEFINE_integer("repeats", 5, "--inspect: timed chunks; the step time is the "
                         "fastest.", lower_bound=1)
    flags.DEFINE_bool("input-only", False, "Time the streaming input pipeline alone "
                      "(images/s read, decoded and put on the devices; no training).")
    flags.DEFINE_bool("memory", False, "Print what the config's train step needs per device "
                      "(XLA's memory analysis of the step compiled for shapes only; nothing "
                      "is initialised or run).")
    flags.DEFINE_integer("batches", 50, "--input-only: batches to time.", lower_bound=1)
    flags.DEFINE_string("profile", None, "--inspect: also trace one chunk of --steps steps "
                        "with jax.profiler into this folder (TensorBoard, Perfetto) and list "
                        "the ten XLA ops and the 60 kernels (by name) that took the most "
                        "time.")
    flags.DEFINE_string("hlo", None, "--inspect: write the train step's optimised HLO text "
                        "(gzip) here; default: train_step.hlo.txt.gz in the --profile folder, "
                        "else FILE.hlo.txt.gz beside --json=FILE.json.")
    flags.DEFINE_string("json", None, "Also write the results to this JSON file.")
    flags.DEFINE_string("coordinator_address", None, "Multi-process runs, as in main.py.")
    flags.DEFINE_integer("num_processes", None, "Multi-process runs, as in main.py.")
    flags.DEFINE_integer("process_id", None, "Multi-process runs, as in main.py.")
    flags.mark_flags_as_required(["config"])


if __name__ == "__main__":
    from absl import app

    from jaxtrain.cli import parse_flags

    define_flags()
    app.run(main, flags_parser=parse_flags)
