"""The speedrun benchmark (`python -m jaxtrain.bench`), its whole-process timing and
the input pipeline timed alone.

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

--input-only times the streaming input pipeline alone (data.placement='stream',
whatever the config says): the config's batches read, decoded, augmented on
the host and put on the devices, with no training step, so its images/s is
the most a streamed run could train at. The first batch (worker start-up) is
timed apart."""
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
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

import jax  # noqa: E402
import jax.extend  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxtrain import models  # noqa: E402
from jaxtrain.config import checks  # noqa: E402
from jaxtrain.errors import ConfigError, TrainingError  # noqa: E402
from jaxtrain.models import whitening  # noqa: E402
from jaxtrain.runtime import mesh as mesh_lib, processes, xla_flags  # noqa: E402
from jaxtrain.training import (chunks, evaluation, inputs, model_state,  # noqa: E402
                               placement, prepare, step as step_lib, train_state)


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


def whole_run(seed, x_train, y_train, eval_arrays, *, model, tx, image_shape, state_sharding,
              whiten, steps_per_epoch, total_steps, spec, eval_kwargs, cuts=None,
              with_weights=False):
    """One run from its seed to its test metrics: the body of the benchmark's one program.

    Seeds derive keys exactly as prepare.setup does, and a whitened stem's filters
    come from the same function (`whiten`, model_state.whitening_fn, or None) computed
    here, inside the timed program, as the public speedruns count it; so a run
    here is the run `python main.py` makes with the same config and seed.
    `cuts` (train.drop_finished_groups: step.finished_groups): the steps from each cut
    on compute no gradient for the parameters held constant there, as main.py's chunks
    after it do. `with_weights`: also returns the trained {"params", "batch_stats"}.
    """
    init_key, data_key = jax.random.split(jax.random.key(seed))
    stem_kernel = None if whiten is None else whiten(x_train[:whitening.WHITENING_IMAGES])
    state = train_state.create_train_state(init_key, model, tx, image_shape, state_sharding,
                                           stem_kernel)
    last_epoch = (total_steps - 1) // steps_per_epoch
    last_losses, nonfinite = [], jnp.zeros((), jnp.int32)  # the last epoch's per-step losses
    for begin, end, constant in phases(total_steps, cuts or {}):
        phase_spec = spec.replace(constant_params=constant) if constant else spec

        def chunk(state, epoch, first_step=0, num_steps=steps_per_epoch, phase_spec=phase_spec):
            return chunks.train_epoch_chunk(state, x_train, y_train, data_key, epoch, first_step,
                                            num_steps=num_steps, spec=phase_spec)

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
    finite = jnp.isfinite(losses)  # the mean over finite steps, as chunks.summarize_chunk's
    train_loss = jnp.sum(jnp.where(finite, losses, 0.0)) / jnp.maximum(jnp.sum(finite), 1)
    metrics = evaluation.evaluate(state, *eval_arrays, **eval_kwargs)
    result = {"test_accuracy": metrics["accuracy"], "test_loss": metrics["loss"],
              "train_loss": train_loss, "nonfinite_steps": nonfinite}
    if with_weights:
        return result, {"params": state.params, "batch_stats": state.batch_stats}
    return result


def phases(total_steps: int, cuts: dict) -> list:
    """[(first step, end step, parameters held constant)]: the run split at the cuts."""
    bounds = [0, *(cut for cut in sorted(cuts) if 0 < cut < total_steps), total_steps]
    return [(begin, end, step_lib.constant_at(cuts, begin))
            for begin, end in zip(bounds, bounds[1:])]


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
    mesh = mesh_lib.create_mesh(select_devices(devices))
    placement.check_batch_split(config.train.batch_size, mesh,  # before loading any data
                              config.train.accumulate_steps)
    run = device_resident(prepare.setup(config, mesh, abstract_state=True), "the benchmark")
    x_train, y_train = placement.put_train_data(run)
    eval_arrays = placement.put_eval_data(config.eval.batch_size, run)
    replicated = mesh_lib.replicated(run.mesh)
    program = jax.jit(whole_run_fn(config, run), out_shardings=replicated)
    start = time.perf_counter()
    lowered = program.lower(np.int32(0), x_train, y_train, eval_arrays)
    # Tracing and lowering: the part of compile_seconds a compilation cache cannot skip.
    lower_seconds = time.perf_counter() - start
    program = lowered.compile()
    compile_seconds = time.perf_counter() - start
    device_kind, backend = mesh.devices.flat[0].device_kind, jax.default_backend()
    print(f"{config.model.name}, {run.total_steps} steps of batch {config.train.batch_size} "
          f"({run.total_steps / run.steps_per_epoch:g} epochs), {checks.resolve_precision(config.train.precision)}, "
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
    cuts = (step_lib.finished_groups(config.optimizer, run.state.params, run.total_steps,
                                     models.frozen_params(config.model))
            if config.train.get("drop_finished_groups", False) else {})
    return functools.partial(
        whole_run, model=run.model, tx=run.state.tx, image_shape=run.dataset.image_shape,
        state_sharding=mesh_lib.replicated(run.mesh),
        whiten=(model_state.whitening_fn(config.model, run.mean, run.std)
                if whitening.has_whitened_stem(config.model) else None),
        steps_per_epoch=run.steps_per_epoch,
        total_steps=run.total_steps, spec=prepare.step_spec(config, run),
        eval_kwargs=prepare.eval_arguments(config, run), cuts=cuts, **kwargs)


def run_statistics(results: list) -> dict:
    """Mean and spread of the finished runs' accuracy and seconds."""
    accuracy = np.array([r["test_accuracy"] for r in results])
    seconds = np.array([r["seconds"] for r in results])
    return dict(accuracy_mean=float(accuracy.mean()), accuracy_std=float(accuracy.std()),
                seconds_mean=float(seconds.mean()), seconds_std=float(seconds.std()),
                seconds_min=float(seconds.min()), seconds_max=float(seconds.max()))


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


def input_only(config, batches: int = 50, stream=sys.stdout) -> dict:
    """Reads `batches` batches (after a first, untimed one) through the config's stream."""
    config = config.copy_and_resolve_references()
    with config.unlocked():
        config.data.placement = "stream"
    run = prepare.setup(config, abstract_state=True)
    placement.check_batch_split(config.train.batch_size, run.mesh)
    source = inputs.open_stream(run, run.data_key, batch_size=config.train.batch_size,
                                workers=config.data.workers, augment_config=config.augment,
                                seed=config.seed)
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
    if processes.is_main_process():
        print(f"input only: {result['images_per_second']:,.0f} images/s ({batches} batches of "
              f"{config.train.batch_size}, {tuple(source.image_shape)}, "
              f"{source.workers or 'no'} worker processes, crop {config.augment.crop!r}); "
              f"first batch after {first_seconds:.2f} s", file=stream, flush=True)
    return result
