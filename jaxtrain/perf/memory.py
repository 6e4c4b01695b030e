"""What one training step needs on each device, from XLA's own memory analysis.

`python -m jaxtrain.bench --config=... --memory` compiles the run's train step
(its model, batch, precision, train.accumulate_steps, model.remat, parallel.fsdp)
for shapes only: no parameter is initialised, no step runs and, where the config
says what the images look like (a dataset known by name, a folder with
data.image_size), no image is read, so it answers for a model, batch or dataset
not at hand, before anyone rents the device it needs.
The step compiled is step.train_step on one global batch, laid out as training
lays it out; the device-resident training split, which training keeps beside it,
is counted apart (`training_data_bytes`). XLA reports per device:

- arguments: the state (parameters, optimiser state, BatchNorm statistics, EMA)
  and the batch, as this device holds them;
- outputs: the new state and the metrics (the state's buffers are donated, so
  they alias the arguments: `alias`);
- temporaries: everything else alive during the step: activations kept for the
  backward pass, gradients, workspace.

peak_bytes = arguments + outputs - alias + temporaries: the most the step can
hold at once. A training run records the same for its compiled chunk in
summary.json (`step_memory`).
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxtrain.config import checks
from jaxtrain.runtime import mesh as mesh_lib
from jaxtrain.training import batches, checkpoint, placement, prepare
from jaxtrain.training import step as step_lib

FIELDS = {"arguments_bytes": "argument_size_in_bytes", "outputs_bytes": "output_size_in_bytes",
          "alias_bytes": "alias_size_in_bytes", "temporaries_bytes": "temp_size_in_bytes",
          "generated_code_bytes": "generated_code_size_in_bytes"}


def analysis(compiled) -> dict | None:
    """A compiled program's memory analysis per device as a plain dict (None where the
    backend gives none), with peak_bytes."""
    stats = compiled.memory_analysis()
    if isinstance(stats, (list, tuple)):
        stats = stats[0] if stats else None
    if stats is None:
        return None
    result = {name: int(getattr(stats, field, 0) or 0) for name, field in FIELDS.items()}
    result["peak_bytes"] = (result["arguments_bytes"] + result["outputs_bytes"]
                            - result["alias_bytes"] + result["temporaries_bytes"])
    return result


def programs_memory(programs) -> dict | None:
    """analysis() of the compiled program among `programs` with the highest peak (a
    run's chunks, or its one per-step program); None without any."""
    found = [a for a in (analysis(p) for p in programs) if a is not None]
    return max(found, key=lambda a: a["peak_bytes"]) if found else None


def bytes_on_one_device(tree, shardings) -> int:
    """The bytes of the first device's pieces of (abstract) arrays laid out by `shardings`."""
    leaves, where = jax.tree.leaves(tree), jax.tree.leaves(
        shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
    if len(where) == 1:
        where = where * len(leaves)
    return sum(int(np.prod(s.shard_shape(leaf.shape))) * np.dtype(leaf.dtype).itemsize
               for leaf, s in zip(leaves, where))


def compile_step(config, run=None):
    """(step.train_step compiled for `config`'s shapes and layouts, the Setup)."""
    if run is None:
        mesh = placement.create_mesh(config.parallel.fsdp)
        placement.check_batch_split(config.train.batch_size, mesh, config.train.accumulate_steps)
        # The state's shapes do not depend on the batch: set up with the smallest batch
        # the layout takes, so a batch larger than the training split is sized too.
        smallest = config.copy_and_resolve_references()
        with smallest.unlocked():
            smallest.train.batch_size = mesh.size * config.train.accumulate_steps
        # Shapes only: no image is read where the config says what they look like
        stand_in = batches.shapes_only(config.data)
        if stand_in is not None and not (tuple(config.data.mean) and tuple(config.data.std)):
            with smallest.unlocked():  # nothing to compute them from; they change no shape
                smallest.data.mean, smallest.data.std = (0.5,), (0.25,)
        run = prepare.setup(smallest, mesh, abstract_state=True, data_read=stand_in)
    replicated = mesh_lib.replicated(run.mesh)
    state_sharding = placement.state_sharding(run)
    state = checkpoint.restore_target(run.state, state_sharding)
    batch = config.train.batch_size
    batch_sharding = mesh_lib.batch_sharded(run.mesh)
    images = jax.ShapeDtypeStruct((batch, *run.dataset.image_shape), jnp.uint8,
                                  sharding=batch_sharding)
    labels = jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=batch_sharding)
    key = jax.ShapeDtypeStruct((), jax.eval_shape(jax.random.key, 0).dtype, sharding=replicated)
    spec = prepare.step_spec(config, run)  # (its batch_size and batch_sharding: unused here)
    step = jax.jit(functools.partial(step_lib.train_step, spec=spec), donate_argnums=0,
                   out_shardings=(state_sharding, replicated))
    return step.lower(state, images, labels, key).compile(), run


def step_memory(config) -> dict:
    """What config's train step needs per device (module docstring), and its layout."""
    compiled, run = compile_step(config)
    result = analysis(compiled) or {}
    state_sharding = placement.state_sharding(run)
    x, y = run.dataset.x_train, run.dataset.y_train
    result.update({
        "model": config.model.name, "batch_size": config.train.batch_size,
        "image_shape": list(run.dataset.image_shape), "precision": checks.resolve_precision(config.train.precision),
        "accumulate_steps": config.train.accumulate_steps, "remat": bool(config.model.remat),
        "fsdp": mesh_lib.fsdp_size(run.mesh), "devices": run.mesh.size,
        "device_kind": jax.devices()[0].device_kind,
        "params_bytes_per_device": bytes_on_one_device(
            run.state.params, getattr(state_sharding, "params", state_sharding)),
        "state_bytes_per_device": bytes_on_one_device(run.state, state_sharding),
        "training_data_bytes": (int(x.nbytes + y.nbytes) if run.placement == "device"
                                and config.data.name != "folder" else 0),
        "data": run.dataset.origin,
    })
    return result


def describe(info: dict) -> str:
    """A few lines for the console."""
    def gib(n):
        return f"{n / 2**30:.3f} GiB"
    layout = (f"fsdp={info['fsdp']} over {info['devices']} devices" if info["fsdp"] > 1
              else f"replicated over {info['devices']} device(s)")
    lines = [f"{info['model']} batch {info['batch_size']} at {'x'.join(map(str, info['image_shape']))}, "
             f"{info['precision']}, accumulate_steps={info['accumulate_steps']}, "
             f"remat={info['remat']}, {layout} ({info['device_kind']})"]
    if "peak_bytes" in info:
        lines += [f"  per device: arguments {gib(info['arguments_bytes'])} (state "
                  f"{gib(info['state_bytes_per_device'])}, of which parameters "
                  f"{gib(info['params_bytes_per_device'])}), outputs {gib(info['outputs_bytes'])}"
                  f" (aliasing {gib(info['alias_bytes'])}), temporaries "
                  f"{gib(info['temporaries_bytes'])}",
                  f"  peak {gib(info['peak_bytes'])} per device, plus the training split "
                  f"{gib(info['training_data_bytes'])} when it is on the devices"]
    else:
        lines.append("  this backend reports no memory analysis")
    if info.get("data", "").startswith("shapes only"):
        lines.append(f"  data: {info['data']}")
    return "\n".join(lines)


def device_limit_bytes(device=None) -> int | None:
    """What one device can hold, as its allocator reports (bytes_limit); None on a
    backend that reports none (the CPU)."""
    device = device or jax.devices()[0]
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    return int(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None


def largest_batch(config, limit_bytes: int, multiple: int = 8, start: int = 128,
                  max_probes: int = 6, seconds: float | None = None, clock=None) -> dict:
    """The largest train.batch_size (a multiple of `multiple`) whose step's peak_bytes fit
    in limit_bytes, searched on compiled memory analyses alone (nothing is run).

    Peak memory grows about linearly with the batch, so each probe after the first two
    goes where the line through the nearest fitting and failing probes (or the last
    two) reaches the limit, kept inside the bracket; the search ends when the bracket
    is `multiple` wide, after max_probes compiles, or once `seconds` have passed. The
    result has every probe (batch, peak bytes, fits, seconds) and the bracket.
    """
    import time
    clock = clock or time.monotonic
    began = clock()
    probes = []

    def probe(batch):
        trial = config.copy_and_resolve_references()
        with trial.unlocked():
            trial.train.batch_size = batch
        start_time = clock()
        peak = step_memory(trial).get("peak_bytes")
        if peak is None:
            raise ValueError("this backend reports no memory analysis")
        probes.append({"batch_size": batch, "peak_bytes": peak, "fits": peak <= limit_bytes,
                       "seconds": round(clock() - start_time, 2)})
        return peak <= limit_bytes

    def rounded(batch):
        return max(multiple, int(batch) // multiple * multiple)

    lo, hi = None, None  # largest batch that fits, smallest that does not
    batch = rounded(start)
    while len(probes) < max_probes and (seconds is None or clock() - began < seconds):
        if probe(batch):
            lo = batch
        else:
            hi = batch
        if lo is not None and hi is not None and hi - lo <= multiple:
            break
        if hi == multiple:  # not even the smallest batch fits
            break
        known = sorted(probes, key=lambda p: p["batch_size"])
        below = [p for p in known if p["fits"]]
        above = [p for p in known if not p["fits"]]
        pair = (below[-1:] + above[:1]) if below and above else known[-2:]
        if len(pair) == 2 and pair[1]["peak_bytes"] != pair[0]["peak_bytes"]:
            slope = ((pair[1]["peak_bytes"] - pair[0]["peak_bytes"])
                     / (pair[1]["batch_size"] - pair[0]["batch_size"]))
            guess = pair[0]["batch_size"] + (limit_bytes - pair[0]["peak_bytes"]) / slope
        else:  # one probe: double or halve
            guess = batch * 2 if lo == batch else batch / 2
        guess = rounded(guess)
        low, high = (lo or 0) + multiple, (hi - multiple) if hi else guess * 4
        batch = min(max(guess, low), high)
        if batch in {p["batch_size"] for p in probes}:
            batch = rounded((low + high) / 2) if high >= low else batch
            if batch in {p["batch_size"] for p in probes}:
                break
    return {"largest_batch": lo, "smallest_failing_batch": hi, "limit_bytes": limit_bytes,
            "multiple": multiple, "probes": probes,
            "exact": lo is not None and hi is not None and hi - lo <= multiple,
            "seconds": round(clock() - began, 2)}
