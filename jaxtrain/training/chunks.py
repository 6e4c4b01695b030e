"""Many training steps as one compiled program (a chunk): a lax.scan over device-resident
data, a per-step loop, or steps over a stream's batches, compiled ahead of time for every
chunk length the plan needs."""
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxtrain.training import step as step_lib


def summarize_chunk(steps, metrics):
    """Mean metrics over a chunk's finite steps, its first step with a non-finite loss
    (-1: none), how many such steps it had, and every step's metrics ("per_step"): the
    loop's metrics rows come from these, so logging often costs no extra chunk."""
    finite = jnp.isfinite(metrics["loss"])
    summary = {name: jnp.sum(jnp.where(finite, values, 0.0)) / jnp.maximum(jnp.sum(finite), 1)
               for name, values in metrics.items()}
    summary["nonfinite_step"] = jnp.where(jnp.all(finite), -1, steps[jnp.argmin(finite)])
    summary["nonfinite_steps"] = jnp.sum(~finite)
    summary["per_step"] = metrics
    return summary


def train_epoch_chunk(state, x_train, y_train, data_key, epoch, first_step, *, num_steps,
                      spec: step_lib.StepSpec):
    """Steps first_step .. first_step + num_steps - 1 of `epoch`, as one lax.scan.

    The one epoch driver (training and the benchmark): the epoch's order, key and
    flips are derived here from (data_key, epoch), so a chunk that starts mid-epoch
    sees exactly the steps of the uninterrupted run.
    """
    order, augment_key, flips = step_lib.epoch_order(
        data_key, epoch, x_train.shape[0], step_lib.alternates_flip(spec))
    steps = first_step + jnp.arange(num_steps, dtype=jnp.int32)

    def body(state, step):
        return step_lib.train_step_at(state, step, x_train, y_train, order, augment_key, flips,
                                      spec=spec)

    state, metrics = jax.lax.scan(body, state, steps)
    return state, summarize_chunk(steps, metrics)


def train_steps_chunk(state, x_train, y_train, data_key, epoch, first_step, num_steps, *,
                      max_steps, spec: step_lib.StepSpec):
    """Steps first_step .. first_step + num_steps - 1 of `epoch`, where num_steps is an
    argument (up to max_steps), not a shape: one while loop that runs any length of
    chunk, so chunks can be cut by time (Pace) with no program compiled per length.
    The same steps as train_epoch_chunk; the per-step metrics come padded to max_steps
    (the host keeps the first num_steps)."""
    order, augment_key, flips = step_lib.epoch_order(
        data_key, epoch, x_train.shape[0], step_lib.alternates_flip(spec))

    def body(i, carry):
        state, per_step = carry
        state, metrics = step_lib.train_step_at(state, first_step + i, x_train, y_train, order,
                                                augment_key, flips, spec=spec)
        return state, {name: values.at[i].set(metrics[name].astype(values.dtype))
                       for name, values in per_step.items()}

    per_step = {name: jnp.zeros((max_steps,), jnp.float32) for name in METRICS}
    state, per_step = jax.lax.fori_loop(0, num_steps, body, (state, per_step))
    return state, {"per_step": per_step}


METRICS = ("loss", "accuracy")  # what step.train_step reports of every step


def resolve_loop(loop: str, xla_convolutions: bool) -> str:
    """train.loop 'auto': one lax.scan per chunk, except on the CPU for models whose
    convolutions are XLA's own (Setup.xla_convolutions).

    XLA:CPU runs convolution weight gradients inside a while loop on a slow generic
    path (BENCHMARKS.md#convolutional-nets-on-the-cpu-issue-32), so there each step is
    its own compiled call instead; dense models and oneDNN's convolutions scan.
    """
    if loop == "auto":
        return "python" if xla_convolutions and jax.default_backend() == "cpu" else "scan"
    return loop


def epoch_order_fn(num_examples: int, spec: step_lib.StepSpec, out_sharding=None,
                   replicas: bool = False):
    """epoch_order for a training split of num_examples images and this run's
    augmentation, jitted (the Python loop calls it once per epoch); with `replicas`,
    one order per key of a leading axis of keys."""
    alternate_flip = step_lib.alternates_flip(spec)
    order = functools.partial(step_lib.epoch_order, num_examples=num_examples,
                              alternate_flip=alternate_flip)
    return jax.jit(jax.vmap(order, in_axes=(0, None)) if replicas else order,
                   out_shardings=out_sharding)


class Pace:
    """How long one compiled call of training may run: `seconds`, so that a signal is
    honoured, and the progress bar moves, within about that. It learns the time a step
    takes from each call and sizes the next one by it; with nothing measured yet, a call
    runs one step."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.step_seconds = None  # the last call's time per step

    def steps(self, left: int) -> int:
        """How many of the `left` steps the next call runs."""
        if self.step_seconds is None:
            return 1
        return int(min(max(self.seconds // self.step_seconds, 1), left))

    def took(self, steps: int, seconds: float) -> None:
        self.step_seconds = seconds / steps


class ScannedChunks:
    """Scanned chunks: run(state, data_key, epoch, first_step, num_steps, progress) ->
    (state, {"per_step": the steps' metrics on the host}).

    Two kinds of program: one lax.scan per planned chunk length (the steps unrolled into
    one call, what a GPU runs fastest), or with a Pace, one while loop that takes the
    number of steps as an argument (train_steps_chunk): a chunk then runs as calls of
    about Pace.seconds each, and can stop between any two. `paced` starts the run with
    the second kind (the CPU, where a chunk of an epoch takes long); else the run
    switches to it when a chunk has taken longer than the pace (`pace_from_now`)."""

    def __init__(self, state, x_train, y_train, data_key, lengths, spec,
                 out_sharding=None, replicas: bool = False, pace: Pace | None = None,
                 paced: bool = False):
        self.x_train, self.y_train, self.pace = x_train, y_train, pace
        self.batched = (lambda fn, axes: jax.vmap(fn, in_axes=axes)) if replicas \
            else (lambda fn, _: fn)
        self.spec, self.out_sharding = spec, out_sharding
        self.max_steps, self.static, self.paced = max(lengths), {}, None
        if paced and pace is not None:
            self.pace_from_now(state, data_key)
        else:
            for length in sorted(lengths):
                chunk = functools.partial(train_epoch_chunk, num_steps=length, spec=spec)
                fn = jax.jit(self.batched(chunk, (0, None, None, 0, None, None)),
                             donate_argnums=0, out_shardings=out_sharding)
                self.static[length] = fn.lower(state, x_train, y_train, data_key, np.int32(0),
                                               np.int32(0)).compile()

    @property
    def programs(self) -> list:
        """The compiled programs (memory.py's analysis)."""
        return list(self.static.values()) + ([self.paced] if self.paced else [])

    def pace_from_now(self, state, data_key) -> None:
        """Compiles the paced program (if not yet): from the next chunk on, every chunk
        runs in calls of about the pace's seconds."""
        if self.paced is not None:
            return
        chunk = functools.partial(train_steps_chunk, max_steps=self.max_steps, spec=self.spec)
        fn = jax.jit(self.batched(chunk, (0, None, None, 0, None, None, None)),
                     donate_argnums=0, out_shardings=self.out_sharding)
        self.paced = fn.lower(state, self.x_train, self.y_train, data_key, np.int32(0),
                              np.int32(0), np.int32(1)).compile()

    def __call__(self, state, data_key, epoch, first_step, num_steps, progress=None):
        """Runs the chunk; progress(steps done, their metrics), if given, after each call,
        and the chunk stops early where it returns True (a paced chunk only)."""
        if self.paced is None:
            state, summary = self.static[num_steps](state, self.x_train, self.y_train, data_key,
                                                    np.int32(epoch), np.int32(first_step))
            summary = jax.device_get(summary)
            if progress is not None:
                progress(num_steps, summary["per_step"])
            return state, {"per_step": summary["per_step"]}
        done, parts = 0, []
        while done < num_steps:
            steps = self.pace.steps(num_steps - done)
            began = time.perf_counter()
            state, out = self.paced(state, self.x_train, self.y_train, data_key,
                                    np.int32(epoch), np.int32(first_step + done),
                                    np.int32(steps))
            per_step = {name: values[..., :steps]
                        for name, values in jax.device_get(out["per_step"]).items()}
            self.pace.took(steps, time.perf_counter() - began)
            parts.append(per_step)
            done += steps
            if progress is not None and progress(done, per_step):
                break
        return state, {"per_step": {name: np.concatenate([part[name] for part in parts], -1)
                                    for name in parts[0]}}


def compile_chunks(loop, state, x_train, y_train, data_key, lengths, spec,
                   out_sharding=None, replicas: bool = False, pace: Pace | None = None,
                   paced: bool = False):
    """Ahead-of-time compiles the training steps; returns
    run_chunk(state, data_key, epoch, first_step, num_steps, progress=None) -> (state,
    {"per_step": each step's metrics, on the host}).

    "scan": ScannedChunks (with `pace` and `paced`: chunks cut by time). The Python
    loop computes the epoch's order once per epoch and calls one compiled
    train_step_at per step; progress(steps done, the step's metrics) after each, and it
    stops after any step where that returns True. `out_sharding` places the new state
    and the metrics (replicated, for data parallelism), or is a pair (the state's, the
    metrics'). With `replicas`, the state and data_key carry a leading axis of
    independent runs, trained together by jax.vmap inside each program (each its own
    order and augmentation from its key; the data is shared), and every metric gains
    that axis too (replica first).
    """
    if loop == "scan":
        return ScannedChunks(state, x_train, y_train, data_key, lengths, spec,
                             out_sharding, replicas, pace, paced)
    batched = (lambda fn, axes: jax.vmap(fn, in_axes=axes)) if replicas else (lambda fn, _: fn)
    # the epoch's order: laid out as the metrics are (replicated), or for replicas as
    # their state's leading axis
    order_sharding = out_sharding[int(not replicas)] if isinstance(out_sharding, tuple) \
        else out_sharding
    order_fn = epoch_order_fn(x_train.shape[0], spec, order_sharding, replicas)
    order_fn = order_fn.lower(data_key, np.int32(0)).compile()
    first_order = order_fn(data_key, np.int32(0))
    order_axes = (0, 0, None if first_order[2] is None else 0)  # (order, augment key, flips)
    step_fn = jax.jit(batched(functools.partial(step_lib.train_step_at, spec=spec),
                              (0, None, None, None, *order_axes)),
                      donate_argnums=0, out_shardings=out_sharding)
    step_fn = step_fn.lower(state, np.int32(0), x_train, y_train, *first_order).compile()
    current = {}  # the last epoch's key, number and order: one order_fn call per epoch

    def run_chunk(state, data_key, epoch, first_step, num_steps, progress=None):
        if current.get("key") is not data_key or current.get("epoch") != epoch:
            current.update(key=data_key, epoch=epoch, order=order_fn(data_key, np.int32(epoch)))
        return step_by_step(
            lambda state, step: step_fn(state, np.int32(step), x_train, y_train,
                                        *current["order"]),
            state, first_step, num_steps, progress)
    run_chunk.programs = [step_fn]  # for memory.py's analysis
    return run_chunk


def step_by_step(take_step, state, first_step: int, num_steps: int, progress=None):
    """A chunk as one compiled call per step: take_step(state, step) -> (state, metrics)
    for each step, progress(steps done, the step's metrics) after each (the step before
    it finished, this one maybe still computing), stopping after any step where it
    returns True. Returns (state, {"per_step": the metrics on the host, a replica axis first})."""
    metrics = []
    for step in range(first_step, first_step + num_steps):
        state, step_metrics = take_step(state, step)
        metrics.append(step_metrics)
        if progress is None:
            continue
        if len(metrics) > 1:  # one step in flight: a stop waits for it, not for a queue
            jax.block_until_ready(metrics[-2])
        if progress(len(metrics), step_metrics):
            break
    metrics = jax.device_get(metrics)
    return state, {"per_step": {name: np.moveaxis(np.stack([m[name] for m in metrics]), 0, -1)
                                for name in METRICS}}


def compile_stream_chunks(state, stream, data_key, num_examples: int, spec,
                          out_sharding=None):
    """compile_chunks for streamed data: one compiled train_step_streamed per step, fed by
    `stream` (batches.Stream). Its batches are put on the devices ahead of time, and
    each step is dispatched without waiting for the one before, so reading the next
    batch overlaps the running step. Same run_chunk signature as compile_chunks."""
    step_fn = jax.jit(functools.partial(step_lib.train_step_streamed, num_examples=num_examples,
                                        spec=spec),
                      donate_argnums=0, out_shardings=out_sharding)
    step_fn = step_fn.lower(state, *stream.batch_spec(), data_key, np.int32(0),
                            np.int32(0)).compile()

    def run_chunk(state, data_key, epoch, first_step, num_steps, progress=None):
        stream.seek(epoch * stream.source.steps_per_epoch + first_step)
        return step_by_step(
            lambda state, step: step_fn(state, *stream.next(), data_key, np.int32(epoch),
                                        np.int32(step)),
            state, first_step, num_steps, progress)
    run_chunk.programs = [step_fn]  # for memory.py's analysis
    return run_chunk


class PhasedChunks:
    """One run_chunk for a plan cut at `cuts` (step.finished_groups): the chunks of each
    phase (the same parameters held constant, step.constant_at) compiled by
    compile_phase(those paths, {the phase's chunk lengths}) -> run_chunk, and each chunk
    run by its phase's. Only phases the plan reaches are compiled (a run resumed after a
    cut compiles the programs after it alone)."""

    def __init__(self, plan, steps_per_epoch: int, cuts: dict, compile_phase):
        self.steps_per_epoch, self.cuts = steps_per_epoch, cuts
        lengths = {}
        for epoch, first_step, length in plan:
            lengths.setdefault(self.phase(epoch, first_step, length), set()).add(length)
        self.phases = {constant: compile_phase(constant, chunk_lengths)
                       for constant, chunk_lengths in lengths.items()}

    def phase(self, epoch, first_step, num_steps=1) -> frozenset:
        step = epoch * self.steps_per_epoch + first_step
        constant = step_lib.constant_at(self.cuts, step)
        if constant != step_lib.constant_at(self.cuts, step + num_steps - 1):
            raise ValueError(f"the chunk of steps {step + 1}-{step + num_steps} crosses a cut "
                             f"of {sorted(self.cuts)}: plan_chunks' breaks must include the "
                             "cuts")
        return constant

    @property
    def programs(self) -> list:
        return [program for one in self.phases.values() for program in one.programs]

    def pace_from_now(self, state, data_key) -> None:
        for one in self.phases.values():
            if hasattr(one, "pace_from_now"):
                one.pace_from_now(state, data_key)

    def __call__(self, state, data_key, epoch, first_step, num_steps, progress=None):
        return self.phases[self.phase(epoch, first_step, num_steps)](
            state, data_key, epoch, first_step, num_steps, progress)


def phased_chunks(plan, steps_per_epoch: int, cuts: dict, compile_phase):
    """PhasedChunks, or with a single phase, its run_chunk itself."""
    chunks = PhasedChunks(plan, steps_per_epoch, cuts, compile_phase)
    return next(iter(chunks.phases.values())) if len(chunks.phases) == 1 else chunks


def timed(fn, *args):
    """Calls fn and waits for its results; returns (results on host, seconds)."""
    start = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    return out, time.perf_counter() - start
