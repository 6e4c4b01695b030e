"""Many training steps as one compiled program (a chunk): a lax.scan over device-resident
data, a per-step loop, or steps over a stream's batches, compiled ahead of time for every
chunk length the plan needs."""
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxtrain.training import step as step_lib

pass


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
                      **step_kwargs):
    """Steps first_step .. first_step + num_steps - 1 of `epoch`, as one lax.scan.

    The one epoch driver (training and the benchmark): the epoch's order, key and
    flips are derived here from (data_key, epoch), so a chunk that starts mid-epoch
    sees exactly the steps of the uninterrupted run.
    """
    order, augment_key, flips = step_lib.epoch_order(
        data_key, epoch, x_train.shape[0], step_lib.alternates_flip(step_kwargs["augment_kwargs"]))
    steps = first_step + jnp.arange(num_steps, dtype=jnp.int32)

    def body(state, step):
        return step_lib.train_step_at(state, step, x_train, y_train, order, augment_key, flips,
                                      **step_kwargs)

    state, metrics = jax.lax.scan(body, state, steps)
    return state, summarize_chunk(steps, metrics)


def resolve_loop(loop: str, xla_convolutions: bool) -> str:
    """train.loop 'auto': one lax.scan per chunk, except on the CPU for models whose
    convolutions are XLA's own (Setup.xla_convolutions).

    XLA:CPU runs convolution weight gradients inside a while loop on a slow
    generic path (measured here: the weight gradient of one 3x3 conv, 64 to 64
    channels, batch 256 at 16x16, took 7.9 s per iteration inside lax.scan and
    0.35 s outside), so there each step is its own compiled call instead. Dense
    models scan on the CPU too (the MLP recipe: 3.6 s against 5.3 s for 1,404 steps),
    and so do convolutional ones through oneDNN (model.conv_impl; 300 steps of
    configs/fashion_mnist_cnn.py: 10.4 s scanned against 19.0 s step by step).
    """
    if loop == "auto":
        return "python" if xla_convolutions and jax.default_backend() == "cpu" else "scan"
    return loop


def epoch_order_fn(num_examples: int, step_kwargs: dict, out_sharding=None,
                   replicas: bool = False):
    """epoch_order for a training split of num_examples images and this run's
    augmentation, jitted (the Python loop calls it once per epoch); with `replicas`,
    one order per key of a leading axis of keys."""
    alternate_flip = step_lib.alternates_flip(step_kwargs["augment_kwargs"])
    order = functools.partial(step_lib.epoch_order, num_examples=num_examples,
                              alternate_flip=alternate_flip)
    return jax.jit(jax.vmap(order, in_axes=(0, None)) if replicas else order,
                   out_shardings=out_sharding)


def compile_chunks(loop, state, x_train, y_train, data_key, lengths, step_kwargs,
                   out_sharding=None, replicas: bool = False):
    """Ahead-of-time compiles the training steps; returns
    run_chunk(state, data_key, epoch, first_step, num_steps, should_stop) -> (state, summary).

    A scanned chunk is one train_epoch_chunk program, run to its end. The Python
    loop computes the epoch's order once per epoch and calls one compiled
    train_step_at per step; it can stop after any step when should_stop(metrics) says
    so. `out_sharding` places the new state and the metrics (replicated, for
    data parallelism), or is a pair (the state's, the metrics'). With `replicas`,
    the state and data_key carry a leading axis of independent runs, trained
    together by jax.vmap inside each program (each its own order and augmentation
    from its key; the data is shared), and every summary array gains that axis too.
    """
    batched = (lambda fn, axes: jax.vmap(fn, in_axes=axes)) if replicas else (lambda fn, _: fn)
    if loop == "scan":
        chunk_fns = {}
        for length in sorted(lengths):
            chunk = functools.partial(train_epoch_chunk, num_steps=length, **step_kwargs)
            fn = jax.jit(batched(chunk, (0, None, None, 0, None, None)),
                         donate_argnums=0, out_shardings=out_sharding)
            chunk_fns[length] = fn.lower(state, x_train, y_train, data_key, np.int32(0),
                                         np.int32(0)).compile()

        def run_chunk(state, data_key, epoch, first_step, num_steps, should_stop=None):
            return chunk_fns[num_steps](state, x_train, y_train, data_key, np.int32(epoch),
                                        np.int32(first_step))
        run_chunk.programs = list(chunk_fns.values())  # for memory.py's analysis
        return run_chunk

    # the epoch's order: laid out as the metrics are (replicated), or for replicas as
    # their state's leading axis
    order_sharding = out_sharding[int(not replicas)] if isinstance(out_sharding, tuple) \
        else out_sharding
    order_fn = epoch_order_fn(x_train.shape[0], step_kwargs, order_sharding, replicas)
    order_fn = order_fn.lower(data_key, np.int32(0)).compile()
    first_order = order_fn(data_key, np.int32(0))
    order_axes = (0, 0, None if first_order[2] is None else 0)  # (order, augment key, flips)
    step_fn = jax.jit(batched(functools.partial(step_lib.train_step_at, **step_kwargs),
                              (0, None, None, None, *order_axes)),
                      donate_argnums=0, out_shardings=out_sharding)
    step_fn = step_fn.lower(state, np.int32(0), x_train, y_train, *first_order).compile()
    current = {}  # the last epoch's key, number and order: one order_fn call per epoch

    def run_chunk(state, data_key, epoch, first_step, num_steps, should_stop=None):
        if current.get("key") is not data_key or current.get("epoch") != epoch:
            current.update(key=data_key, epoch=epoch, order=order_fn(data_key, np.int32(epoch)))
        return step_by_step(
            lambda state, step: step_fn(state, np.int32(step), x_train, y_train,
                                        *current["order"]),
            state, first_step, num_steps, should_stop, replicas)
    run_chunk.programs = [step_fn]  # for memory.py's analysis
    return run_chunk


def step_by_step(take_step, state, first_step: int, num_steps: int, should_stop=None,
                 replicas: bool = False):
    """A chunk as one compiled call per step: take_step(state, step) -> (state, metrics)
    for each step (stopping after any step should_stop(its metrics) asks to; they may
    still be computing: dispatch runs ahead); (state, summary), a summary per replica
    (leading axis) with `replicas`."""
    metrics = []
    for step in range(first_step, first_step + num_steps):
        state, step_metrics = take_step(state, step)
        metrics.append(step_metrics)
        if should_stop is not None and should_stop(step_metrics):
            break
    stacked = jax.tree.map(lambda *values: jnp.stack(values), *metrics)
    steps = jnp.arange(first_step, first_step + len(metrics), dtype=jnp.int32)
    if replicas:  # stacked: (steps, replicas)
        return state, jax.vmap(summarize_chunk, in_axes=(None, 1))(steps, stacked)
    return state, summarize_chunk(steps, stacked)


def compile_stream_chunks(state, stream, data_key, num_examples: int, step_kwargs,
                          out_sharding=None):
    """compile_chunks for streamed data: one compiled train_step_streamed per step, fed by
    `stream` (batches.Stream). Its batches are put on the devices ahead of time, and
    each step is dispatched without waiting for the one before, so reading the next
    batch overlaps the running step. Same run_chunk signature as compile_chunks."""
    step_fn = jax.jit(functools.partial(step_lib.train_step_streamed, num_examples=num_examples,
                                        **step_kwargs),
                      donate_argnums=0, out_shardings=out_sharding)
    step_fn = step_fn.lower(state, *stream.batch_spec(), data_key, np.int32(0),
                            np.int32(0)).compile()

    def run_chunk(state, data_key, epoch, first_step, num_steps, should_stop=None):
        stream.seek(epoch * stream.source.steps_per_epoch + first_step)
        return step_by_step(
            lambda state, step: step_fn(state, *stream.next(), data_key, np.int32(epoch),
                                        np.int32(step)),
            state, first_step, num_steps, should_stop)
    run_chunk.programs = [step_fn]  # for memory.py's analysis
    return run_chunk


def phased_chunks(plan, steps_per_epoch: int, cuts: dict, compile_phase):
    """One run_chunk for a plan cut at `cuts` (finished_groups): the chunks of each phase
    (the same parameters held constant, constant_at) compiled by compile_phase(those
    paths, {the phase's chunk lengths}) -> run_chunk, and each chunk run by its phase's.
    Only phases the plan reaches are compiled (a run resumed after a cut compiles the
    programs after it alone); with one phase, its run_chunk itself."""
    def phase(epoch, first_step, num_steps=1):
        step = epoch * steps_per_epoch + first_step
        constant = step_lib.constant_at(cuts, step)
        if constant != step_lib.constant_at(cuts, step + num_steps - 1):
            raise ValueError(f"the chunk of steps {step + 1}-{step + num_steps} crosses a cut "
                             f"of {sorted(cuts)}: plan_chunks' breaks must include the cuts")
        return constant

    lengths = {}
    for epoch, first_step, length in plan:
        lengths.setdefault(phase(epoch, first_step, length), set()).add(length)
    phases = {constant: compile_phase(constant, chunk_lengths)
              for constant, chunk_lengths in lengths.items()}
    if len(phases) == 1:
        return next(iter(phases.values()))

    def run_chunk(state, data_key, epoch, first_step, num_steps, should_stop=None):
        return phases[phase(epoch, first_step, num_steps)](state, data_key, epoch, first_step,
                                                           num_steps, should_stop)
    run_chunk.programs = [program for one in phases.values() for program in one.programs]
    return run_chunk


def timed(fn, *args):
    """Calls fn and waits for its results; returns (results on host, seconds)."""
    start = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    return out, time.perf_counter() - start
