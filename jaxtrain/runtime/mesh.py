"""Where arrays live: the device mesh (a data axis, and an fsdp axis when parallel.fsdp > 1),
the replicated, batch-sharded and fsdp shardings, and putting host arrays on them."""
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

DATA_AXIS = "data"
FSDP_AXIS = "fsdp"
FSDP_MIN_ELEMENTS = 4096  # parallel.fsdp: smaller tensors (biases, norms, BN statistics) stay replicated


def create_mesh(devices=None, fsdp: int = 1) -> Mesh:
    """A 1-D "data" mesh over `devices` (default: every device of every process), or
    with fsdp > 1 a 2-D data x fsdp one whose rows are fsdp consecutive devices (those
    of one process, where a process has that many)."""
    devices = np.asarray(jax.devices() if devices is None else devices)
    if fsdp == 1:
        return Mesh(devices, (DATA_AXIS,))
    if devices.size % fsdp:
        raise ValueError(f"parallel.fsdp={fsdp} does not divide the {devices.size} devices")
    return Mesh(devices.reshape(-1, fsdp), (DATA_AXIS, FSDP_AXIS))


def fsdp_size(mesh: Mesh) -> int:
    return dict(mesh.shape).get(FSDP_AXIS, 1)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def batch_sharded(mesh: Mesh, batch_axis: int = 0) -> NamedSharding:
    """Splits axis `batch_axis` over every device of the mesh (over both of a data x
    fsdp mesh's axes); the other axes are whole on each device."""
    axes = DATA_AXIS if len(mesh.axis_names) == 1 else tuple(mesh.axis_names)
    return NamedSharding(mesh, PartitionSpec(*([None] * batch_axis), axes))


def fsdp_spec(shape, fsdp: int) -> PartitionSpec:
    """How parallel.fsdp splits a tensor of `shape`: along its largest dimension that
    fsdp divides (the later one of equals: a kernel's output features), or not at all
    for a small tensor or one with no such dimension."""
    if fsdp == 1 or int(np.prod(shape)) < FSDP_MIN_ELEMENTS:
        return PartitionSpec()
    dims = [d for d, size in enumerate(shape) if size % fsdp == 0]
    if not dims:
        return PartitionSpec()
    split = max(dims, key=lambda d: (shape[d], d))
    return PartitionSpec(*(FSDP_AXIS if d == split else None for d in range(len(shape))))


def state_shardings(state, mesh: Mesh):
    """Each array of `state` (a TrainState, or its shapes) split as fsdp_spec says over
    the mesh's fsdp axis (replicated over its data axis): one NamedSharding per leaf."""
    fsdp = fsdp_size(mesh)
    return jax.tree.map(lambda leaf: NamedSharding(mesh, fsdp_spec(leaf.shape, fsdp)), state)


def bytes_per_device(tree) -> dict:
    """{device id: bytes} that the arrays of `tree` hold on each local device: what a
    layout costs each device (a replicated array counts on every device)."""
    held = {}
    for leaf in jax.tree.leaves(tree):
        for shard in getattr(leaf, "addressable_shards", ()):
            held[shard.device.id] = held.get(shard.device.id, 0) + shard.data.nbytes
    return held


def put(array: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A global array from a host array every process holds in full; each process
    copies only the pieces its own devices need (no cross-process check or transfer)."""
    array = np.asarray(array)
    return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])
