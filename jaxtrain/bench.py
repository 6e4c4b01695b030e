"""Speed: the speedrun benchmark and the XLA inspection report.

    python -m jaxtrain.bench --config=configs/cifar_speedrun.py --runs=10 [--json=FILE]
    python -m jaxtrain.bench --config=configs/cifar.py --inspect [--json=FILE]

The benchmark times what the public PyTorch speedruns time: from the first
training step to the final test accuracy, data already on the device,
compilation excluded. Each run, with its own seed, is one XLA program (init,
every epoch as a lax.scan of steps, the test-time-augmented evaluation),
compiled once for all runs: the seed is an argument, not a constant.

The inspection report compiles one training step of any config and reads what
XLA made of it: kernels launched (fusions, library calls, copies, collectives),
FLOPs and bytes from XLA's cost analysis, then times the step to give achieved
TFLOP/s and the fraction of the device's bfloat16 peak.
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
import json  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxtrain import data, hlo, models, parallel, report, train  # noqa: E402

# Dense bfloat16 tensor-core peaks (TFLOP/s, no sparsity) from the vendors' data sheets,
# matched against jax's device_kind; the first match wins.
PEAK_BF16_TFLOPS = (("H200", 989.4), ("H100 PCIe", 756.0), ("H100", 989.4), ("A100", 312.0),
                    ("L40S", 362.1), ("L4", 121.0))


def peak_tflops(device_kind: str):
    return next((peak for name, peak in PEAK_BF16_TFLOPS if name in device_kind), None)


def cost(compiled) -> dict:
    """XLA's cost analysis of a compiled program (per device), as a plain dict."""
    analysis = compiled.cost_analysis()
    if isinstance(analysis, (list, tuple)):  # older jax: one dict per program
        analysis = analysis[0] if analysis else {}
    return dict(analysis or {})


# ---------------------------------------------------------------- inspection

def inspect(config, steps: int = 10) -> dict:
    """Compiles one train step of `config`, reports its kernels, FLOPs and speed."""
    run = train.setup(config)
    train.check_batch_split(config.train.batch_size, run.mesh)
    x_train, y_train = train.put_train_data(run)
    step_kwargs = train.step_arguments(config, run)
    replicated = parallel.replicated(run.mesh)
    order, augment_key = train.epoch_order_fn(run)(run.data_key, np.int32(0))

    start = time.perf_counter()
    step_fn = jax.jit(functools.partial(train.train_step_at, **step_kwargs), donate_argnums=0,
                      out_shardings=replicated)
    compiled = step_fn.lower(run.state, np.int32(0), x_train, y_train, order, augment_key).compile()
    compile_seconds = time.perf_counter() - start
    text = compiled.as_text()
    analysis = cost(compiled)

    # Time the loop training would use: a lax.scan chunk, or one call per step.
    loop = train.resolve_loop(config.train.loop, models.is_convolutional(config.model.name))
    steps = max(1, min(steps, run.steps_per_epoch))
    run_chunk = train.compile_chunks(loop, run.state, x_train, y_train, (order, augment_key),
                                     {steps}, step_kwargs, replicated)
    state = jax.tree.map(jnp.copy, run.state)  # the step donates its input
    state, _ = jax.block_until_ready(run_chunk(state, order, augment_key, 0, steps))  # warm-up
    start = time.perf_counter()
    jax.block_until_ready(run_chunk(state, order, augment_key, 0, steps))
    step_seconds = (time.perf_counter() - start) / steps

    devices = run.mesh.size
    flops = float(analysis.get("flops", 0.0))  # per device
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
        "flops_per_step": flops * devices,
        "flops_per_image": flops * devices / config.train.batch_size,
        "bytes_accessed_per_step": float(analysis.get("bytes accessed", 0.0)) * devices,
        "loop": loop, "timed_steps": steps, "step_seconds": step_seconds,
        "images_per_second": config.train.batch_size / step_seconds,
        "achieved_tflops_per_device": achieved,
        "peak_bf16_tflops_per_device": peak,
        "fraction_of_peak": achieved / peak if peak else None,
        "collectives_per_step": {kind: {"ops": ops, "bytes": size} for kind, (ops, size)
                                 in hlo.collective_traffic(text).items()},
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
         f"({info['flops_per_image'] / 1e9:.4g} G per image)")
    line(f"  bytes accessed per step:   {info['bytes_accessed_per_step'] / 1e9:,.4g} GB")
    peak = (f", {info['fraction_of_peak']:.1%} of the {info['peak_bf16_tflops_per_device']:g} "
            "TFLOP/s bf16 peak" if info["fraction_of_peak"] is not None
            else " (no bf16 peak known for this device)")
    line(f"  step time:                 {info['step_seconds'] * 1e3:.2f} ms "
         f"({info['timed_steps']} timed, {info['loop']} loop), "
         f"{info['images_per_second']:,.0f} images/s")
    line(f"  achieved:                  {info['achieved_tflops_per_device']:.3f} TFLOP/s per "
         f"device{peak}")
    for kind, traffic in info["collectives_per_step"].items():
        line(f"  {kind + ' per step:':<27}{traffic['ops']} ops, "
             f"{traffic['bytes'] / 1e6:.2f} MB per device")


# ---------------------------------------------------------------- the speedrun

def whole_run(seed, x_train, y_train, eval_arrays, *, model, tx, image_shape, state_sharding,
              stem_kernel, steps_per_epoch, total_steps, step_kwargs, eval_kwargs):
    """One run from its seed to its test metrics: the body of the benchmark's one program.

    Seeds derive keys exactly as train.setup does, so a run here is the run
    `python main.py` makes with the same config and seed.
    """
    init_key, data_key = jax.random.split(jax.random.key(seed))
    state = train.create_train_state(init_key, model, tx, image_shape, state_sharding,
                                     stem_kernel)
    num_examples = x_train.shape[0]

    def epoch(state, index, num_steps):
        order, augment_key = train.epoch_order(data_key, index, num_examples)
        return train.train_chunk(state, x_train, y_train, order, augment_key, 0,
                                 num_steps=num_steps, **step_kwargs)

    full_epochs, tail_steps = divmod(total_steps, steps_per_epoch)
    state, summaries = jax.lax.scan(functools.partial(epoch, num_steps=steps_per_epoch), state,
                                    jnp.arange(full_epochs))
    train_loss = summaries["loss"][-1] if full_epochs else jnp.nan
    nonfinite = jnp.sum(summaries["nonfinite_steps"])
    if tail_steps:
        state, tail = epoch(state, full_epochs, tail_steps)
        train_loss, nonfinite = tail["loss"], nonfinite + tail["nonfinite_steps"]
    metrics = train.evaluate(state, *eval_arrays, **eval_kwargs)
    return {"test_accuracy": metrics["accuracy"], "test_loss": metrics["loss"],
            "train_loss": train_loss, "nonfinite_steps": nonfinite}


def benchmark(config, runs: int, warmup: int = 1, first_seed=None, stream=sys.stdout) -> dict:
    """`runs` timed runs with seeds first_seed, first_seed + 1, ... (default config.seed)."""
    run = train.setup(config, abstract_state=True)  # each run initialises in its program
    train.check_batch_split(config.train.batch_size, run.mesh)
    x_train, y_train = train.put_train_data(run)
    eval_arrays = train.put_eval_data(config, run)
    replicated = parallel.replicated(run.mesh)
    program = jax.jit(functools.partial(
        whole_run, model=run.model, tx=run.state.tx, image_shape=run.dataset.image_shape,
        state_sharding=replicated, stem_kernel=run.stem_kernel,
        steps_per_epoch=run.steps_per_epoch,
        total_steps=run.total_steps, step_kwargs=train.step_arguments(config, run),
        eval_kwargs=train.eval_arguments(config, run)), out_shardings=replicated)
    start = time.perf_counter()
    program = program.lower(np.int32(0), x_train, y_train, eval_arrays).compile()
    compile_seconds = time.perf_counter() - start
    print(f"{config.model.name}, {run.total_steps} steps of batch {config.train.batch_size} "
          f"({run.total_steps / run.steps_per_epoch:g} epochs), {config.train.precision}, "
          f"tta={config.eval.tta}, {run.mesh.size} x {jax.devices()[0].device_kind}; "
          f"compile {compile_seconds:.2f} s", file=stream, flush=True)

    first_seed = config.seed if first_seed is None else first_seed
    for i in range(warmup):  # not counted, as in the PyTorch speedruns
        jax.block_until_ready(program(np.int32(first_seed + runs + i), x_train, y_train,
                                      eval_arrays))
    results = []
    for i in range(runs):
        seed = first_seed + i
        start = time.perf_counter()
        metrics = jax.device_get(program(np.int32(seed), x_train, y_train, eval_arrays))
        seconds = time.perf_counter() - start
        result = {"seed": seed, "seconds": seconds,
                  **{k: float(v) for k, v in metrics.items()}}
        results.append(result)
        print(f"run {i + 1}/{runs}  seed {seed}  test_accuracy {result['test_accuracy']:.2%}  "
              f"seconds {seconds:.3f}", file=stream, flush=True)
        if result["nonfinite_steps"] and config.train.nonfinite == "stop":
            raise train.TrainingError(
                f"seed {seed}: {int(result['nonfinite_steps'])} training steps had a non-finite "
                "loss; lower optimizer.learning_rate or set train.nonfinite='skip'")
    process_seconds = time.time() - PROCESS_START
    summary = {
        "config": config.to_dict(), "runs": results, "warmup_runs": warmup,
        "compile_seconds": compile_seconds, "process_seconds": process_seconds,
        "device_kind": jax.devices()[0].device_kind, "devices": run.mesh.size,
        "dataset": run.dataset.origin, "jax_version": jax.__version__,
        "date": time.strftime("%Y-%m-%d"),
    }
    if not results:  # --runs=0: compile (and warm up) only
        print(f"compile {compile_seconds:.2f} s  whole process {process_seconds:.1f} s",
              file=stream, flush=True)
        return summary
    accuracy = np.array([r["test_accuracy"] for r in results])
    seconds = np.array([r["seconds"] for r in results])
    summary.update(accuracy_mean=float(accuracy.mean()), accuracy_std=float(accuracy.std()),
                   seconds_mean=float(seconds.mean()), seconds_std=float(seconds.std()),
                   seconds_min=float(seconds.min()), seconds_max=float(seconds.max()))
    print(f"{runs} runs: test_accuracy {summary['accuracy_mean']:.2%} +- "
          f"{summary['accuracy_std']:.2%}  seconds {summary['seconds_mean']:.3f} +- "
          f"{summary['seconds_std']:.3f} (min {summary['seconds_min']:.3f}, max "
          f"{summary['seconds_max']:.3f})  compile {compile_seconds:.2f} s  whole process "
          f"{process_seconds:.1f} s", file=stream, flush=True)
    return summary


def main(argv):
    from absl import flags
    from absl import logging
    from ml_collections import config_flags

    FLAGS = flags.FLAGS
    logging.set_verbosity(logging.WARNING)
    if len(argv) > 1:
        sys.exit(f"error: unexpected arguments: {' '.join(argv[1:])}")
    try:
        parallel.initialize(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id)
        if FLAGS.inspect:
            result = inspect(FLAGS.config, FLAGS.steps)
            if parallel.is_main_process():
                print_inspection(result, config_flags.get_config_filename(FLAGS["config"]))
        else:
            result = benchmark(FLAGS.config, FLAGS.runs, FLAGS.warmup, FLAGS.seed)
    except (data.DataError, train.ConfigError, train.TrainingError,
            parallel.DistributedError) as error:
        sys.exit(f"error: {error}")
    if FLAGS.json and parallel.is_main_process():
        report.write_json_atomically(FLAGS.json, result)


def define_flags():
    from absl import flags
    from ml_collections import config_flags

    config_flags.DEFINE_config_file("config", None, "Path to a config file with get_config().",
                                    lock_config=True)
    flags.DEFINE_integer("runs", 10, "Timed runs, seeds --seed, --seed + 1, ...; 0: compile only.")
    flags.DEFINE_integer("warmup", 1, "Untimed runs before the timed ones (same program).")
    flags.DEFINE_integer("seed", None, "First seed (default: config.seed).")
    flags.DEFINE_bool("inspect", False, "Report XLA kernels, FLOPs and speed of one train "
                      "step instead of benchmarking.")
    flags.DEFINE_integer("steps", 10, "--inspect: steps to time.")
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
