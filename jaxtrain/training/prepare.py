"""From a config to everything a run needs before its first step: the data, the
model, the optimiser, the initial state, and the static arguments of the compiled
steps and evaluation (shared by training, evaluation, the benchmark and compare)."""
import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxtrain import data, models
from jaxtrain.config import checks
from jaxtrain.data import folder_stream
from jaxtrain.errors import ConfigError
from jaxtrain.models import user, whitening
from jaxtrain.runtime import mesh as mesh_lib
from jaxtrain.training import augment, batches, evaluation, optim, replicas, train_state
from jaxtrain.weights import readers


@dataclasses.dataclass(frozen=True)
class Setup:
    """Everything a run derives from its config before the first step: what the code
    below run/ is given instead of the whole config (with the config block it needs)."""
    mesh: Any  # jax.sharding.Mesh: the devices, a data axis (and an fsdp axis)
    dataset: data.Dataset  # the host uint8 arrays (a stream's: its test split only)
    placement: str  # 'device' or 'stream' (batches.py)
    placement_reason: str  # why, in words (the run's first console line)
    model: Any  # the Flax module
    stem_kernel: Any  # None, or the whitened stem's fixed weights (None with abstract_state)
    mean: tuple  # per-channel normalisation, of pixel values in [0, 1]
    std: tuple
    schedule: Any  # the learning-rate schedule (a single run's; replicas: run.plan's)
    state: train_state.TrainState  # the initial state (shapes only with abstract_state)
    data_key: Any  # the data order's and augmentation's PRNG key
    steps_per_epoch: int
    total_steps: int
    runs: Any  # None, or the replicas (replicas.Run) trained together, on a leading axis
    init_from: Any = None  # what model.init_from loaded (readers.Report.to_json()); None: a
                           # random init, or an abstract state, which reads no weights
    shardings: Any = None  # where the state lives: one sharding, or parallel.fsdp's tree of them
    conv_impl: str = "xla"  # model.conv_impl as resolved here, once: 'onednn' or 'xla'
    xla_convolutions: bool = False  # a convolutional model on XLA's own convolutions
                                    # (what keeps train.loop='auto' out of a scan on the CPU)


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


def setup(config, mesh=None, abstract_state: bool = False, model=None, clock=None,
          data_read=None) -> Setup:
    """Data, model, optimiser and the initial state (shared by training and evaluation),
    from a config checked where its run or command started (checks.check_config).

    The state is replicated over `mesh` (default: all devices), the data-parallel layout.
    With train.replicas or a sweep, the state and data_key have a leading replica axis
    (replicas.py: how it is laid out). With abstract_state, the state holds only shapes
    and dtypes (jax.eval_shape): for callers that build the state inside their own
    program, it saves compiling the init.
    `model`: a Flax Linen or NNX module instance to train instead of model.name's.
    `clock` (phases.Clock): times loading, statistics and building, a line each.
    `data_read`: (dataset, placement, why) to use instead of reading config.data
    (batches.shapes_only's stand-in, for a step compiled for shapes).
    """
    lap = clock.lap if clock is not None else lambda *args: None
    mesh = create_mesh(config) if mesh is None else mesh
    init_from = config.model.get("init_from", "")
    if init_from and not abstract_state:
        readers.source(init_from)  # a missing or unreadable source fails before the data loads
        readers.check_fits(init_from, config.model.name)
    dataset, placement, placement_reason = data_read or batches.load(config.data)
    runs = replicas.runs(config)
    if runs and placement == "stream":
        raise ConfigError(f"config.train.replicas={config.train.replicas} (or a sweep) needs "
                          f"the training data on the devices, but it is streamed "
                          f"({placement_reason}); train the runs one at a time")
    lap("load", f"loaded {config.data.name} from {dataset.origin} ({len(dataset.x_train):,} "
                f"training and {len(dataset.x_test):,} test images)")
    trained_with = readers.preprocessing(init_from) if init_from else None
    computed = not (tuple(config.data.mean) and tuple(config.data.std))
    mean, std = channel_stats(dataset, config, trained_with)
    lap("statistics", None if not computed else "computed the channel mean and std"
        if trained_with is None else f"normalising as model.init_from's weights were "
        f"trained: mean {_rounded(mean)}, std {_rounded(std)}")
    batch_size = config.train.batch_size
    steps_per_epoch = len(dataset.x_train) // batch_size
    if steps_per_epoch == 0:
        multiple = (mesh.size if mesh is not None else jax.device_count()) * \
            config.train.accumulate_steps
        fits = fitting_batch(len(dataset.x_train), multiple)
        fix = (f": use a smaller one, e.g. --config.train.batch_size={fits} "
               f"({len(dataset.x_train) // fits} steps an epoch)" if fits else "")
        raise ConfigError(f"config.train.batch_size={batch_size} is larger than the training "
                          f"split ({len(dataset.x_train)} images){fix}")
    total_steps = (config.train.num_steps if config.train.num_steps > 0
                   else config.train.num_epochs * steps_per_epoch)
    conv_impl = models.conv_choice(config.model)  # the one place 'auto' is settled
    if model is not None:
        model = user.from_instance(model)
    else:
        try:
            model = models.create_model(config.model, dataset.num_classes,
                                        checks.compute_dtype(config.train.precision),
                                        conv_impl=conv_impl)
        except ValueError as error:  # an unknown or unimportable model.name
            raise ConfigError(str(error)) from None
    abstract_params = abstract_init(model, config.model, dataset.image_shape)
    stem_kernel = None
    if whitening.has_whitened_stem(config.model):
        try:
            whitening.check_stem(config.model, dataset.image_shape[-1])
        except ValueError as error:
            raise ConfigError(str(error)) from None
        if not abstract_state:  # callers of an abstract state compute it in their program
            stem_kernel = whitening_fn(config, mean, std)(
                dataset.x_train[:whitening.WHITENING_IMAGES])
    schedule = optim.create_schedule(config.optimizer, total_steps)
    frozen = models.frozen_params(config.model)
    optim.check_groups(config.optimizer, abstract_params["params"], frozen)
    tx = replicas.create_optimizer(config, total_steps, frozen)
    if runs:  # seeds seed, seed + 1, ...: each replica's keys are its single run's
        sharding = replicas.state_sharding(mesh, len(runs))
        seeds = np.asarray([run.seed for run in runs], np.int32)
        init_key, data_key = jax.jit(lambda seeds: tuple(jax.vmap(
            lambda seed: jax.random.split(jax.random.key(seed)))(seeds).T),
            out_shardings=sharding)(seeds)
    else:
        sharding = mesh_lib.replicated(mesh)
        init_key, data_key = jax.jit(lambda: jax.random.split(jax.random.key(config.seed)),
                                     out_shardings=sharding)()
    init = functools.partial(train_state.create_train_state, model=model, tx=tx,
                             image_shape=dataset.image_shape, sharding=sharding,
                             stem_kernel=stem_kernel, hyperparams=replicas.hyperparams(runs),
                             replicas=runs is not None,
                             ema=config.train.get("ema_decay") is not None)
    report = None
    if init_from and not abstract_state:  # read at step 0 only: a resumed run reads none
        initial, report = readers.initialise(init_from, model, abstract_params,
                                             config.model.name, dataset.image_shape,
                                             config.model.get("init_from_exclude", ""))
        init = functools.partial(init, initial=initial)
    if mesh_lib.fsdp_size(mesh) > 1:  # each leaf split over the fsdp axis by its shape
        sharding = mesh_lib.state_shardings(
            jax.eval_shape(functools.partial(init, sharding=None), init_key), mesh)
        init = functools.partial(init, sharding=sharding)
    state = jax.eval_shape(init, init_key) if abstract_state else init(init_key)
    if report is not None:
        lap("build", report.line() + " in {seconds:.1f} s")
    copies = f"{len(runs)} replicas of " if runs else ""
    lap("build", f"built {copies}{config.model.name} ({param_count(state.params, runs):,} "
                 "parameters) and its optimiser state")
    return Setup(mesh, dataset, placement, placement_reason, model, stem_kernel, mean, std,
                 schedule, state, data_key, steps_per_epoch, total_steps, runs,
                 report.to_json() if report is not None else None, sharding, conv_impl,
                 models.xla_convolutions(config.model.name, conv_impl))


def _rounded(values) -> str:
    return "(" + ", ".join(f"{v:.3f}" for v in values) + ")"


def param_count(params, runs=None) -> int:
    """The model's parameter count (one replica's, for a replicated state)."""
    return models.count_params(params) // (len(runs) if runs else 1)


def create_mesh(config, devices=None):
    """The device mesh of config.parallel (mesh.create_mesh): data, or data x fsdp."""
    devices = jax.devices() if devices is None else devices
    fsdp = config.get("parallel", {}).get("fsdp", 1)
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


def whitening_fn(config, mean, std):
    """whitening.whitening_kernel for this run's stem, jitted: training and the benchmark
    (inside its timed program) compute the same filters from the training images."""
    return jax.jit(functools.partial(whitening.whitening_kernel, mean=tuple(mean), std=tuple(std),
                                     filters=config.model.stem_width))


def abstract_init(model, model_config, image_shape):
    """The model's variables as shapes (jax.eval_shape of its init); a model that cannot
    take the images is a ConfigError naming the key that sizes it."""
    try:
        return jax.eval_shape(functools.partial(
            model.init, x=jnp.zeros((1, *image_shape)), train=False), jax.random.key(0))
    except Exception as error:  # whatever Flax or XLA raise for impossible shapes
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        size = "x".join(map(str, image_shape))
        if model_config.name == "cifar_cnn":
            key, value = "model.widths", tuple(model_config.widths)
            what = (f"cifar_cnn halves the image once per block: {len(value)} blocks are too "
                    f"many for {size} images")
        else:
            key, value = "model.name", model_config.name
            what = f"the model cannot take {size} images"
        raise ConfigError(f"config.{key}={value!r}: {what} ({type(error).__name__}: "
                          f"{reason})") from None


def channel_stats(dataset: data.Dataset, config, trained_with=None) -> tuple[tuple, tuple]:
    """data.mean/data.std from the config, else those pretrained weights were trained
    with (`trained_with`: (mean, std), model.init_from's), else computed from the
    training split."""
    mean, std = tuple(config.data.mean), tuple(config.data.std)
    if trained_with is not None:
        mean, std = mean or tuple(trained_with[0]), std or tuple(trained_with[1])
    channels = dataset.image_shape[-1]
    if not mean or not std:
        # from each channel's histogram of byte values: exact, and ~10x faster than
        # numpy's mean and std over axes (0, 1, 2) of a uint8 array; counted 1024
        # images at a time (bincount widens its input to int64: one block stays in
        # cache, 4-15x faster than the whole split at once). A streamed folder: from
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


def put_eval_data(config, run: Setup):
    """The test split as padded batches on the devices, each batch split over them (whole
    on every device when each device evaluates replicas of its own)."""
    arrays = batch_for_eval(run.dataset.x_test, run.dataset.y_test, config.eval.batch_size,
                            run.mesh.size)
    sharding = (mesh_lib.replicated(run.mesh) if splits_replicas(run)
                else mesh_lib.batch_sharded(run.mesh, batch_axis=1))
    return tuple(mesh_lib.put(a, sharding) for a in arrays)


def splits_replicas(run: Setup) -> bool:
    return bool(run.runs) and replicas.splits_replicas(run.mesh, len(run.runs))


def state_sharding(run: Setup):
    """Where the training state lives: replicated, split over its replica axis, or
    (parallel.fsdp) a tree of one sharding per leaf."""
    if run.shardings is not None:
        return run.shardings
    if run.runs:
        return replicas.state_sharding(run.mesh, len(run.runs))
    return mesh_lib.replicated(run.mesh)


def put_train_data(run: Setup):
    """The training split, replicated on every device (see jaxtrain/runtime/mesh.py for why)."""
    replicated = mesh_lib.replicated(run.mesh)
    return (mesh_lib.put(run.dataset.x_train, replicated),
            mesh_lib.put(run.dataset.y_train, replicated))


def step_arguments(config, run: Setup) -> dict:
    """The static keyword arguments of step.train_step_at (and chunks.train_epoch_chunk)
    for this run."""
    batch_sharding = None if splits_replicas(run) else mesh_lib.batch_sharded(run.mesh)
    return dict(batch_size=config.train.batch_size,
                batch_sharding=batch_sharding, mean=run.mean, std=run.std,
                augment_kwargs=augment.device_kwargs(config.augment),
                mix_kwargs=augment.mix_kwargs(config.augment),
                num_classes=run.dataset.num_classes,
                label_smoothing=config.train.label_smoothing,
                skip_nonfinite=config.train.nonfinite == "skip",
                ema_decay=config.train.get("ema_decay"),
                freeze_batch_stats=bool(config.model.get("freeze_batch_stats", False)),
                accumulate_steps=config.train.get("accumulate_steps", 1))


def tta_image_count(fraction: float, num_images: int):
    """eval.tta_fraction as evaluation.evaluate's static tta_images: None = all, else
    ceil(fraction x num_images) (within float rounding: 0.3 x 10 is 3, not 4)."""
    count = min(max(math.ceil(fraction * num_images - 1e-9), 0), num_images)
    return None if count == num_images else count


def eval_arguments(config, run: Setup) -> dict:
    """The static keyword arguments of evaluation.evaluate for this run
    (evaluation.predict_logits takes all but tta_images)."""
    return dict(mean=run.mean, std=run.std, tta=config.eval.tta, pad_mode=config.augment.pad_mode,
                tta_images=tta_image_count(config.eval.tta_fraction, len(run.dataset.x_test)))


def compile_eval(config, run: Setup, state, eval_arrays):
    """evaluation.evaluate for this run's state, compiled to run one test batch per call
    (evaluation.compile_evaluation: stoppable between batches, with progress): every
    replica's metrics (R,) for a replicated run, the replicas evaluated one after
    another inside each call (lax.map: vmapped convolutions become grouped ones, which
    XLA:CPU runs far slower, and one replica's activations at a time keep memory as a
    single run's)."""
    return evaluation.compile_evaluation(state, *eval_arrays, **eval_arguments(config, run),
                                         replicas=bool(run.runs),
                                         out_sharding=mesh_lib.replicated(run.mesh))


def open_stream(config, run: Setup, data_key) -> batches.Stream:
    """The training split as an batches.Stream for this run: Grain worker processes for
    a folder (data.workers, 0: one per core), threads for arrays already in memory."""
    images = run.dataset.x_train
    workers = 0
    if isinstance(images, folder_stream.FolderImages):
        workers = config.data.workers or folder_stream.folder._cpu_count()
        if config.augment.crop != "none":
            images = images.with_random_crop(config.seed, config.augment.crop_scale,
                                             config.augment.crop_ratio, config.augment.flip)
    return batches.Stream(images, run.dataset.y_train, data_key,
                          batch_size=config.train.batch_size, steps_per_epoch=run.steps_per_epoch,
                          total_steps=run.total_steps, sharding=mesh_lib.batch_sharded(run.mesh),
                          workers=workers)

