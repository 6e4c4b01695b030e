"""Where a run's arrays live: the device mesh of parallel.fsdp, the batch's split over
the devices, the state's sharding, and the training and test splits put on the devices."""
import jax

from jaxtrain.config import checks
from jaxtrain.errors import ConfigError
from jaxtrain.runtime import mesh as mesh_lib
from jaxtrain.training import inputs, replicas


def create_mesh(fsdp: int = 1, devices=None):
    """The device mesh for parallel.fsdp=`fsdp` (mesh.create_mesh): data, or data x fsdp."""
    devices = jax.devices() if devices is None else devices
    if len(devices) % fsdp:
        divisors = [str(d) for d in range(1, len(devices) + 1) if len(devices) % d == 0]
        raise ConfigError(f"config.parallel.fsdp={fsdp} does not divide the {len(devices)} "
                          f"devices: use one of {', '.join(divisors)}")
    return mesh_lib.create_mesh(devices, fsdp)


def check_batch_split(batch_size: int, mesh, accumulate_steps: int = 1) -> None:
    """The global batch must split evenly over the devices, and each device's share into
    accumulate_steps micro-batches; says which sizes would."""
    devices = mesh.size
    if batch_size % devices:
        lower, upper = batch_size // devices * devices, -(-batch_size // devices) * devices
        options = " or ".join(str(size) for size in (lower, upper) if size > 0)
        raise ConfigError(f"config.train.batch_size={batch_size} does not split evenly over "
                          f"{devices} devices: use a multiple of {devices} (e.g. {options})")
    if (batch_size // devices) % accumulate_steps:
        per_device = batch_size // devices
        step = devices * accumulate_steps
        sizes = [size for size in (batch_size // step * step, -(-batch_size // step) * step)
                 if size > 0]
        raise ConfigError(
            f"config.train.accumulate_steps={accumulate_steps} does not divide the batch per "
            f"device ({batch_size} / {devices} devices = {per_device} images): use one of "
            f"{checks.divisors(per_device)}, or a batch_size that is a multiple of {step} "
            f"(e.g. {' or '.join(map(str, sizes))})")


def splits_replicas(run) -> bool:
    return bool(run.runs) and replicas.splits_replicas(run.mesh, len(run.runs))


def state_sharding(run):
    """Where the training state lives: replicated, split over its replica axis, or
    (parallel.fsdp) a tree of one sharding per leaf."""
    if run.shardings is not None:
        return run.shardings
    if run.runs:
        return replicas.state_sharding(run.mesh, len(run.runs))
    return mesh_lib.replicated(run.mesh)


def put_train_data(run):
    """The training split, replicated on every device (see jaxtrain/runtime/mesh.py for why)."""
    replicated = mesh_lib.replicated(run.mesh)
    return (mesh_lib.put(run.dataset.x_train, replicated),
            mesh_lib.put(run.dataset.y_train, replicated))


def put_eval_data(batch_size: int, run):
    """The test split as padded batches of eval.batch_size=`batch_size` on the devices, each
    batch split over them (whole on every device when each device evaluates replicas of
    its own)."""
    arrays = inputs.batch_for_eval(run.dataset.x_test, run.dataset.y_test, batch_size,
                                   run.mesh.size)
    sharding = (mesh_lib.replicated(run.mesh) if splits_replicas(run)
                else mesh_lib.batch_sharded(run.mesh, batch_axis=1))
    return tuple(mesh_lib.put(a, sharding) for a in arrays)
