"""Where training batches come from: device-resident arrays, or a Grain stream.

data.placement='device' puts the whole uint8 training split on every device
once; each compiled step gathers its batch there (step.train_step_at). It
is the fastest path and the default for data that fits.

data.placement='stream' reads batches on the host with Grain: each JAX
process reads only its slice of every global batch (from arrays in host
memory, or straight from an image folder's files, decoded in Grain worker
processes), and batches go to the devices ahead of the step that uses them,
so the copy overlaps the previous step. Both paths take the epoch's order
from (seed, epoch) (step.epoch_order) and run the same augmentation and step
on the device, so they train on exactly the same batches.

'auto' picks 'device' when the uint8 training split fits in
data.device_fraction of one device's memory, else 'stream', and says why.

One Grain pipeline serves the whole run (element g: global step g's batch),
so worker processes start once. Resume: the Grain iterator's state goes into
the Orbax checkpoint (Grain's own CheckpointHandler, one file per process),
next to the step the iterator started at and the step it is at.
"""
from __future__ import annotations

import collections
import copy
import gc
import json
import os
import threading
import time

import jax
import numpy as np

from jaxtrain import data
from jaxtrain.data import folder, folder_stream

PLACEMENTS = ("auto", "device", "stream")
READ_AHEAD = 16  # steps past the last that the source can serve (see RunBatches.__len__)


def device_memory() -> tuple[int, str]:
    """(bytes, what they are) of one local device; a CPU device counts host memory."""
    device = jax.local_devices()[0]
    try:
        stats = device.memory_stats() or {}
    except Exception:  # some backends do not implement it
        stats = {}
    if stats.get("bytes_limit"):
        return int(stats["bytes_limit"]), f"one {device.device_kind}'s memory"
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "host memory (CPU device)"


def choose_placement(placement: str, train_bytes: int, fraction: float,
                     memory: tuple[int, str] | None = None) -> tuple[str, str]:
    """(placement, why) for data.placement, the training split's uint8 size and
    data.device_fraction."""
    if placement != "auto":
        return placement, f"data.placement={placement!r}"
    limit, what = memory or device_memory()
    fits = train_bytes <= fraction * limit
    return ("device" if fits else "stream",
            f"data.placement='auto': the uint8 training split is {_gib(train_bytes)}, "
            f"{'within' if fits else 'over'} data.device_fraction={fraction:g} of {what} "
            f"({_gib(limit)})")


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def load(data_config, memory: tuple[int, str] | None = None):
    """(dataset, placement, why): the data block's dataset, read the way its placement needs.

    A folder that will stream is only indexed (its training images are decoded
    while training); any other source is loaded into host arrays first.
    """
    dc = data_config
    if dc.name == "folder" and dc.placement != "device" and dc.dir:
        count, shape = folder_stream.count_and_shape(dc.dir, dc.image_size or None, dc.channels)
        placement, why = choose_placement(dc.placement, count * int(np.prod(shape)),
                                          dc.device_fraction, memory)
        if placement == "stream":
            dataset = folder_stream.load_folder_stream(
                dc.dir, dc.image_size or None, dc.resize, dc.channels, dc.workers,
                cache_dir=data.CACHE_DIR)
            return dataset, placement, why
        return data.load_config(dc), placement, why
    dataset = data.load_config(dc)
    placement, why = choose_placement(dc.placement, dataset.x_train.nbytes, dc.device_fraction,
                                      memory)
    return dataset, placement, why


# Images a side, channels, classes and training images of the datasets known by name
KNOWN_SHAPES = {"cifar10": (32, 3, 10, 50_000), "cifar100": (32, 3, 100, 50_000),
                "fashion_mnist": (28, 1, 10, 60_000), "mnist": (28, 1, 10, 60_000)}
STAND_IN_CLASSES = 1000  # a folder's classes when its folder is not there (ImageNet's)


def shapes_only(data_config):
    """(dataset, placement, why) with the shapes data_config would give and no image read
    (zeros, broadcast): what a step compiled for shapes needs (bench --memory). None when
    the shapes cannot be known without the data (arrays, tfds, a folder kept at its
    images' own size)."""
    dc = data_config
    if dc.name in KNOWN_SHAPES and dc.get("source", "auto") != "tfds":
        side, channels, classes, count = KNOWN_SHAPES[dc.name]
        if dc.name == "cifar100" and dc.get("label", "fine") == "coarse":
            classes = 20
    elif dc.name == "folder" and dc.image_size:
        side, channels, count = dc.image_size, dc.channels, 50_000
        train = os.path.join(dc.dir, "train") if dc.dir else ""
        classes = (len([d for d in os.scandir(train) if d.is_dir()])
                   if train and os.path.isdir(train) else STAND_IN_CLASSES)
    else:
        return None
    shape = (side, side, channels)

    def zeros(n):
        return np.broadcast_to(np.zeros((1, *shape), np.uint8), (n, *shape))
    dataset = data.Dataset(zeros(count), np.zeros(count, np.int32), zeros(1),
                           np.zeros(1, np.int32), tuple(map(str, range(classes))),
                           f"shapes only: {side}x{side}x{channels} images, {classes} classes "
                           "(no image read)")
    placement = "stream" if dc.placement == "stream" else "device"
    return dataset, placement, "shapes only"


def epoch_keys(key, epoch):
    """(order_key, augment_key) of an epoch: from (key, epoch) alone, so any step of
    any epoch can be rerun or resumed exactly, on either path."""
    return jax.random.split(jax.random.fold_in(key, epoch))


def epoch_permutation(key_data: np.ndarray, epoch: int, num_examples: int) -> np.ndarray:
    """The order of `epoch` (step.epoch_order's), computed on the host CPU from the run's
    key data: Threefry bits and a stable sort are the same on every backend."""
    with jax.default_device(jax.local_devices(backend="cpu")[0]):
        key = jax.random.wrap_key_data(np.asarray(key_data))
        return np.asarray(jax.random.permutation(epoch_keys(key, epoch)[0], num_examples))


class RunBatches:
    """Grain random-access source: element g is this process's part of global step g's
    batch. The epoch's order is derived where the element is read (a worker
    computes each epoch's order once), so one pipeline serves the whole run.

    An element is a dict of numpy arrays: images uint8 (b, h, w, c), labels int32
    (b,), indices int32 (b,) (the step uses them for the per-image alternating flips).
    """

    def __init__(self, images, labels, key_data, *, batch_size: int, steps_per_epoch: int,
                 total_steps: int, process: int = 0, processes: int = 1):
        self.images, self.labels = images, labels
        self.key_data = np.asarray(key_data)
        self.batch_size, self.steps_per_epoch, self.total_steps = (batch_size, steps_per_epoch,
                                                                   total_steps)
        self.local_batch = batch_size // processes
        self.offset = process * self.local_batch
        self._order = (None, None)  # (epoch, its order): one tuple, so threads see both or neither

    def __len__(self) -> int:
        # A few steps past the end: Grain's workers then never reach the end of the
        # source, where (grain 0.2.18) they leave shared-memory blocks behind.
        return self.total_steps + READ_AHEAD

    def __getstate__(self):
        return dict(self.__dict__, _order=(None, None))  # workers compute their own

    def order(self, epoch: int) -> np.ndarray:
        cached_epoch, order = self._order
        if cached_epoch != epoch:
            order = epoch_permutation(self.key_data, epoch, len(self.images))
            self._order = (epoch, order)
        return order

    def indices(self, step: int) -> tuple[int, np.ndarray]:
        """(epoch, this process's image indices) of global step `step`."""
        epoch, in_epoch = divmod(step, self.steps_per_epoch)
        start = in_epoch * self.batch_size + self.offset
        return epoch, self.order(epoch)[start:start + self.local_batch]

    def __getitem__(self, step: int) -> dict:
        epoch, picked = self.indices(step)
        read = getattr(self.images, "read", None)
        images = read(picked, epoch) if read else self.images[picked]
        return {"images": images, "labels": self.labels[picked],
                "indices": picked.astype(np.int32)}


def _worker_init(index: int, count: int) -> None:
    """In a Grain worker: JAX (for the epoch orders) on the CPU only, never the GPU; and
    exit when the training process is gone (killed, it cannot stop its workers)."""
    del index, count
    jax.config.update("jax_platforms", "cpu")
    parent = os.getppid()

    def exit_with_parent():
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)
    threading.Thread(target=exit_with_parent, daemon=True, name="jaxtrain-parent").start()


def _ensure_absl_flags_parsed():
    """Grain reads absl flags; a library user's program may never parse them."""
    from absl import flags
    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


class _SavedState:
    """A Grain iterator state frozen at save time: Orbax writes it in the background,
    while the live iterator moves on."""

    def __init__(self, state: dict):
        self._state = json.dumps(state).encode()

    def get_state(self) -> bytes:
        return self._state


class Stream:
    """Batches of the training split for this process, step after step, on the devices.

    images: a uint8 (N, h, w, c) array or a folder_stream.FolderImages; key: the run's
    data key (the order's source, as on the device path); sharding: the global
    batch's sharding. workers: Grain worker processes (0: read in threads of this
    process, right for arrays already in memory).
    """

    def __init__(self, images, labels, key, *, batch_size: int, steps_per_epoch: int,
                 total_steps: int, sharding, workers: int = 0, prefetch: int = 2):
        import grain  # only streaming runs pay for the import
        self._grain = grain
        _ensure_absl_flags_parsed()
        processes = jax.process_count()
        if batch_size % processes:
            raise ValueError(f"batch {batch_size} does not split over {processes} processes")
        key_data = np.asarray(jax.random.key_data(key).addressable_data(0))
        self.source = RunBatches(images, labels, key_data, batch_size=batch_size,
                                 steps_per_epoch=steps_per_epoch, total_steps=total_steps,
                                 process=jax.process_index(), processes=processes)
        self.image_shape = tuple(images.shape[1:])
        self.batch_size, self.sharding = batch_size, sharding
        self.workers, self.prefetch = workers, prefetch
        self.first_step = self.position = None
        self._iterator = None
        if workers:
            folder.quiet_resource_tracker()
        self._ahead = collections.deque()  # (batch on the devices, Grain state after it)
        self._state = None  # the Grain state after the last batch taken
        self.wait_seconds = 0.0

    def batch_spec(self) -> tuple:
        """ShapeDtypeStructs of (images, labels, indices) as the step receives them."""
        return (jax.ShapeDtypeStruct((self.batch_size, *self.image_shape), np.uint8,
                                     sharding=self.sharding),
                jax.ShapeDtypeStruct((self.batch_size,), np.int32, sharding=self.sharding),
                jax.ShapeDtypeStruct((self.batch_size,), np.int32, sharding=self.sharding))

    def _to_devices(self, batch: dict) -> tuple:
        # np.array copies out of a worker's shared memory block, which Grain then frees
        # at once (a device array on the CPU could otherwise keep pointing into it)
        put = jax.make_array_from_process_local_data
        return tuple(put(self.sharding, np.array(batch[k]))
                     for k in ("images", "labels", "indices"))

    def _read_ahead(self) -> None:
        """Tops up the batches already on their way to the devices (transfers are
        asynchronous: they overlap the step running meanwhile)."""
        while len(self._ahead) < self.prefetch:
            batch = next(self._iterator)
            state = copy.deepcopy(self._iterator.get_state())  # the live one moves on
            self._ahead.append((self._to_devices(batch), state))

    def open(self, first_step: int = 0, restore=None) -> None:
        """Starts reading at global step `first_step`. restore: (iterator -> None, position):
        sets the iterator to a checkpoint's Grain state (saved by an iterator opened at the
        same first_step), whose next step is `position`."""
        grain = self._grain
        self.close()
        dataset = grain.MapDataset.source(self.source)[first_step:]
        threads = 0 if self.workers else 2
        dataset = dataset.to_iter_dataset(grain.ReadOptions(num_threads=threads,
                                                            prefetch_buffer_size=2 * threads))
        if self.workers:
            dataset = dataset.mp_prefetch(grain.MultiprocessingOptions(
                num_workers=self.workers, per_worker_buffer_size=2), worker_init_fn=_worker_init)
        # (Grain's ThreadPrefetchIterDataset after mp_prefetch cost more per batch than
        # the read-ahead to the devices of _read_ahead's few lines.)
        self._iterator = iter(dataset)
        self._ahead.clear()
        self._state = copy.deepcopy(self._iterator.get_state())
        self.first_step = self.position = first_step
        if restore is not None:
            set_state, self.position = restore
            try:
                set_state(self._iterator)
                self._state = copy.deepcopy(self._iterator.get_state())
            except BaseException:
                self.close()
                raise

    def seek(self, step: int) -> None:
        """Makes the next batch global step `step`, reopening only when needed."""
        if self._iterator is None or self.position != step:
            self.open(step)

    def fill(self) -> None:
        """Waits until the first batches are read (the workers started): called before
        training's clock starts, so their start-up does not count as waiting for input."""
        self._fill()

    def next(self) -> tuple:
        """The next batch (images, labels, indices) on the devices; the time spent
        waiting for it adds to wait_seconds."""
        start = time.perf_counter()
        self._fill()
        self.wait_seconds += time.perf_counter() - start
        batch, self._state = self._ahead.popleft()
        self.position += 1
        return batch

    def _fill(self) -> None:
        failure = None
        try:
            self._read_ahead()
        except StopIteration:
            failure = RuntimeError(f"the stream has no step {self.position}")
        except Exception as error:  # a worker's DataError arrives wrapped
            failure = _data_error(error)
        if failure is not None:
            # Closed here, out of the except block: Grain's exception and the frames it
            # holds (with batches in shared memory) are gone, so close frees them all.
            self.close()
            raise failure

    def checkpoint(self) -> tuple[dict, object]:
        """(meta, Grain item) describing the position after the last batch taken."""
        return ({"first_step": self.first_step, "position": self.position},
                _SavedState(self._state))

    def close(self) -> None:
        if self._iterator is not None:
            close = getattr(self._iterator, "close", None)
            if close is not None:
                close()
            self._iterator = None
            self._ahead.clear()
            if self.workers:
                _free_shared_memory()


def _free_shared_memory() -> None:
    """Frees the shared-memory blocks of batches already dropped: those held in reference
    cycles (an exception's frames), and those queued on Grain's background deleter,
    which a process about to exit would otherwise leave to the resource tracker (and
    its "leaked shared_memory objects" warning)."""
    gc.collect()
    try:  # grain 0.2.18's deleter: one thread, first in first out
        from grain._src.python.ipc.shared_memory_array import SharedMemoryArray
        deleter = SharedMemoryArray._del_thread_pool
    except (ImportError, AttributeError):
        return
    if deleter is not None:
        deleter.apply(int)  # returns once every deletion queued before it has run


def _data_error(error: Exception) -> Exception:
    """The DataError inside a Grain worker's error (its message names the file), else `error`."""
    seen = error
    while seen is not None:
        if isinstance(seen, data.DataError):
            return data.DataError(str(seen))  # a new one: no frames of the pipeline attached
        text = str(seen)
        marker = "DataError: "
        if marker in text:
            return data.DataError(text.split(marker, 1)[1].strip().splitlines()[0])
        seen = seen.__cause__ or seen.__context__
    return error
