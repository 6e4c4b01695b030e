"""The data a run reads, as its steps need it: the channel statistics, the steps an epoch,
the test split padded to whole batches, the share of it that gets TTA, and the stream of
training batches read on the host."""
import math

import numpy as np

from jaxtrain import data
from jaxtrain.data import folder_stream
from jaxtrain.errors import ConfigError
from jaxtrain.runtime import mesh as mesh_lib
from jaxtrain.training import batches


def fitting_batch(num_images: int, multiple: int = 1) -> int | None:
    """A batch size for a training split of num_images: the largest power of two (times
    `multiple`, the devices x accumulate_steps it must split into) giving at least 8
    steps an epoch, else the largest multiple that fits; None if none does."""
    if num_images < multiple:
        return None
    batch = multiple
    while batch * 2 * 8 <= num_images:
        batch *= 2
    return batch


def steps(train_config, num_images: int, devices: int) -> tuple[int, int]:
    """(steps an epoch, the run's steps) of train.batch_size over `num_images` training
    images; a batch larger than the split is a ConfigError saying which would fit."""
    batch_size = train_config.batch_size
    steps_per_epoch = num_images // batch_size
    if steps_per_epoch == 0:
        fits = fitting_batch(num_images, devices * train_config.accumulate_steps)
        fix = (f": use a smaller one, e.g. --config.train.batch_size={fits} "
               f"({num_images // fits} steps an epoch)" if fits else "")
        raise ConfigError(f"config.train.batch_size={batch_size} is larger than the training "
                          f"split ({num_images} images){fix}")
    total_steps = (train_config.num_steps if train_config.num_steps > 0
                   else train_config.num_epochs * steps_per_epoch)
    return steps_per_epoch, total_steps


def channel_stats(dataset: data.Dataset, data_config, trained_with=None) -> tuple[tuple, tuple]:
    """data.mean/data.std (`data_config`: the config's data block), else those pretrained
    weights were trained with (`trained_with`: (mean, std), model.init_from's), else
    computed from the training split."""
    mean, std = tuple(data_config.mean), tuple(data_config.std)
    if trained_with is not None:
        mean, std = mean or tuple(trained_with[0]), std or tuple(trained_with[1])
    channels = dataset.image_shape[-1]
    if not mean or not std:
        # from each channel's histogram of byte values: exact, and much faster than
        # numpy's mean and std over axes (0, 1, 2) of a uint8 array; counted 1024
        # images at a time (bincount widens its input to int64: one block stays in
        # cache). A streamed folder: from
        # STATS_IMAGES images spread evenly over it.
        images = dataset.x_train
        if not isinstance(images, np.ndarray):
            images = images[np.linspace(0, len(images) - 1, min(len(images), STATS_IMAGES),
                                        dtype=np.int64)]
        values = np.arange(256, dtype=np.float64) / 255.0
        counts = np.zeros((channels, 256), np.int64)
        for start in range(0, len(images), 1024):
            pixels = images[start:start + 1024].reshape(-1, channels)
            for c in range(channels):
                counts[c] += np.bincount(pixels[:, c], minlength=256)
        means = [float(values @ n / n.sum()) for n in counts]
        stds = [float(np.sqrt(((values - m) ** 2) @ n / n.sum())) for m, n in zip(means, counts)]
        mean, std = mean or tuple(means), std or tuple(stds)
    for key, value in (("data.mean", mean), ("data.std", std)):
        if len(value) not in (1, channels):
            raise ConfigError(f"config.{key}={value!r}: needs 1 or {channels} values "
                              f"for {channels}-channel images")
    return mean, std


STATS_IMAGES = 2048  # a streamed folder's mean and std come from this many of its images


def batch_for_eval(images: np.ndarray, labels: np.ndarray, batch_size: int, multiple_of: int = 1):
    """Pads the test split to whole batches: (B, batch, ...) arrays and a validity mask.

    The batch is rounded up to a multiple of `multiple_of` (the device count) so
    that it splits evenly over the devices.
    """
    batch_size = -(-min(batch_size, len(images)) // multiple_of) * multiple_of
    num_batches = -(-len(images) // batch_size)
    pad = num_batches * batch_size - len(images)
    valid = np.concatenate([np.ones(len(images), np.float32), np.zeros(pad, np.float32)])
    images = np.concatenate([images, np.zeros((pad, *images.shape[1:]), images.dtype)])
    labels = np.concatenate([labels, np.zeros(pad, labels.dtype)])
    return (images.reshape(num_batches, batch_size, *images.shape[1:]),
            labels.reshape(num_batches, batch_size), valid.reshape(num_batches, batch_size))


def tta_image_count(fraction: float, num_images: int):
    """eval.tta_fraction as evaluation.evaluate's static tta_images: None = all, else
    ceil(fraction x num_images) (within float rounding: 0.3 x 10 is 3, not 4)."""
    count = min(max(math.ceil(fraction * num_images - 1e-9), 0), num_images)
    return None if count == num_images else count


def open_stream(run, data_key, *, batch_size: int, workers: int, augment_config,
                seed: int) -> batches.Stream:
    """The training split as an batches.Stream for this run: Grain worker processes for
    a folder (`workers`: data.workers, 0: one per core; with augment.crop's random crops
    seeded by `seed`), threads for arrays already in memory."""
    images = run.dataset.x_train
    if isinstance(images, folder_stream.FolderImages):
        workers = workers or folder_stream.folder._cpu_count()
        if augment_config.crop != "none":
            images = images.with_random_crop(seed, augment_config.crop_scale,
                                             augment_config.crop_ratio, augment_config.flip)
    else:
        workers = 0
    return batches.Stream(images, run.dataset.y_train, data_key,
                          batch_size=batch_size, steps_per_epoch=run.steps_per_epoch,
                          total_steps=run.total_steps, sharding=mesh_lib.batch_sharded(run.mesh),
                          workers=workers)


def rounded(values) -> str:
    """'(0.491, 0.482, 0.447)': values as a console line shows them."""
    return "(" + ", ".join(f"{v:.3f}" for v in values) + ")"
