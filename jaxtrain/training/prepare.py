"""From a config to everything a run needs before its first step, in order: the data
(inputs.py), the model and its initial state (model_state.py), the optimiser (optim.py,
replicas.py), on the devices of the mesh (placement.py); and the static arguments of the
compiled steps and evaluation (shared by training, evaluation, the benchmark and compare)."""
import dataclasses
from typing import Any

from jaxtrain import data, models
from jaxtrain.errors import ConfigError
from jaxtrain.runtime import mesh as mesh_lib
from jaxtrain.training import (augment, batches, evaluation, inputs, model_state, optim,
                               parts as parts_lib, placement as placement_lib, replicas,
                               train_state)
from jaxtrain.training import step as step_lib
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
    loss: Any = None  # fn(logits, targets) -> per-example losses (losses.py, parts.py)
    augment_fn: Any = None  # the user's fn(images, key) -> images, or None
    logs_learning_rate: bool = True  # the optimiser takes the schedule (optim.takes_schedule)


def setup(config, mesh=None, abstract_state: bool = False, parts=None, clock=None,
          data_read=None) -> Setup:
    """Data, model, optimiser and the initial state (shared by training and evaluation),
    from a config checked where its run or command started (checks.check_config).

    The state is replicated over `mesh` (default: all devices), the data-parallel layout.
    With train.replicas or a sweep, the state and data_key have a leading replica axis
    (replicas.py: how it is laid out). With abstract_state, the state holds only shapes
    and dtypes (jax.eval_shape): for callers that build the state inside their own
    program, it saves compiling the init.
    `parts` (parts.Parts): what the user passed from Python (a model instance, an
    optimiser, a loss, an augmentation) instead of the config's choices.
    `clock` (phases.Clock): times loading, statistics and building, a line each.
    `data_read`: (dataset, placement, why) to use instead of reading config.data
    (batches.shapes_only's stand-in, for a step compiled for shapes).
    """
    lap = clock.lap if clock is not None else lambda *args: None
    parts = parts or parts_lib.Parts()
    if mesh is None:
        mesh = placement_lib.create_mesh(config.get("parallel", {}).get("fsdp", 1))
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
    mean, std = inputs.channel_stats(dataset, config.data, trained_with)
    computed = not (tuple(config.data.mean) and tuple(config.data.std))
    lap("statistics", None if not computed else "computed the channel mean and std"
        if trained_with is None else f"normalising as model.init_from's weights were "
        f"trained: mean {inputs.rounded(mean)}, std {inputs.rounded(std)}")
    steps_per_epoch, total_steps = inputs.steps(config.train, len(dataset.x_train), mesh.size)

    conv_impl = models.conv_choice(config.model)  # the one place 'auto' is settled
    model = model_state.build_model(config.model, dataset.num_classes, config.train.precision,
                                    conv_impl, parts.model)
    loss = parts_lib.loss(config.train, parts, dataset.num_classes)
    augment_fn = parts_lib.augmentation(config.augment, parts, dataset.image_shape)
    abstract_params = model_state.abstract_init(model, config.model, dataset.image_shape)
    stem = model_state.stem_kernel(config.model, dataset, mean, std, compute=not abstract_state)

    schedule = optim.create_schedule(config.optimizer, total_steps)
    frozen = models.frozen_params(config.model)
    optim.check_groups(config.optimizer, abstract_params["params"], frozen)
    given = parts_lib.optimizer(config, parts)
    tx = replicas.create_optimizer(config, total_steps, frozen, given)

    state, data_key, sharding, report = model_state.initial_state(
        config.model, config.seed, config.train.get("ema_decay") is not None, model, tx,
        dataset, mesh, runs, stem, abstract_params, abstract=abstract_state)
    if report is not None:
        lap("build", report.line() + " in {seconds:.1f} s")
    copies = f"{len(runs)} replicas of " if runs else ""
    lap("build", f"built {copies}{config.model.name} "
                 f"({model_state.param_count(state.params, runs):,} parameters) and its "
                 "optimiser state")
    return Setup(mesh, dataset, placement, placement_reason, model, stem, mean, std,
                 schedule, state, data_key, steps_per_epoch, total_steps, runs,
                 report.to_json() if report is not None else None, sharding, conv_impl,
                 models.xla_convolutions(config.model.name, conv_impl), loss, augment_fn,
                 optim.takes_schedule(config.optimizer, given))


def step_spec(config, run: Setup) -> step_lib.StepSpec:
    """What this run's training step computes (step.StepSpec), read from its config."""
    batch_sharding = (None if placement_lib.splits_replicas(run)
                      else mesh_lib.batch_sharded(run.mesh))
    return step_lib.StepSpec(
        mean=run.mean, std=run.std, num_classes=run.dataset.num_classes,
        batch_size=config.train.batch_size, batch_sharding=batch_sharding,
        augment=augment.device_kwargs(config.augment), mix=augment.mix_kwargs(config.augment),
        label_smoothing=config.train.label_smoothing,
        skip_nonfinite=config.train.nonfinite == "skip", ema_decay=config.train.get("ema_decay"),
        freeze_batch_stats=bool(config.model.get("freeze_batch_stats", False)),
        accumulate_steps=config.train.get("accumulate_steps", 1), loss=run.loss,
        augment_fn=run.augment_fn)


def eval_arguments(config, run: Setup) -> dict:
    """The static keyword arguments of evaluation.evaluate for this run
    (evaluation.predict_logits takes all but tta_images and loss)."""
    return dict(mean=run.mean, std=run.std, tta=config.eval.tta, pad_mode=config.augment.pad_mode,
                tta_images=inputs.tta_image_count(config.eval.tta_fraction,
                                                  len(run.dataset.x_test)), loss=run.loss)


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


