"""A trained run, restored for inference: `jaxtrain.restore(workdir).predict(images)`,
or `.predict_files(paths)` on image files decoded as the run's data were."""
import concurrent.futures
import dataclasses
import functools
import json
import os

import jax
import ml_collections
import numpy as np
import optax

from jaxtrain import models
from jaxtrain.config import checks
from jaxtrain.data import DataError
from jaxtrain.models import user
from jaxtrain.runtime import xla_cache
from jaxtrain.training import checkpoint, evaluation, replicas, train_state


@dataclasses.dataclass(frozen=True)
class FilePredictions:
    """What Classifier.predict_files found: one row per file it could classify."""
    paths: tuple[str, ...]       # the files classified, in the order given (folders walked)
    labels: np.ndarray           # int32 (N,): the most probable class of each
    probabilities: np.ndarray    # float32 (N, classes)
    class_names: tuple[str, ...]  # the run's classes: class_names[labels[i]] names file i's
    errors: tuple[tuple[str, str], ...] = ()  # (path, why) of each file or path not classified

    def top(self, i: int, k: int) -> list[tuple[str, float]]:
        """File i's k most probable (class name, probability), most probable first."""
        order = np.argsort(-self.probabilities[i], kind="stable")[:k]
        return [(self.class_names[c], float(self.probabilities[i, c])) for c in order]


class Classifier:
    """Classifies uint8 images (N, H, W, C) with a restored model, BatchNorm in inference mode."""

    def __init__(self, state, meta: dict, tta: str, pad_mode: str, batch_size: int,
                 replica: int | None = None, resize: str = "crop", workdir: str | None = None,
                 weights: str = "raw", precision: str = "float32"):
        self.state = state
        self.replica = replica  # which replica of a replicated run (None: a single run)
        self.step = int(state.step)
        self.class_names = tuple(meta["class_names"])
        self.image_shape = tuple(meta["image_shape"])
        self.mean, self.std = tuple(meta["mean"]), tuple(meta["std"])
        self.tta, self.pad_mode = tta, pad_mode
        self.resize = resize  # how files are fitted to image_shape (the run's data.resize)
        self.batch_size = batch_size
        self.workdir, self.weights, self.precision = workdir, weights, precision  # its origin
        self._probabilities = jax.jit(functools.partial(self.probabilities, tta=tta))

    def logits(self, state, images, tta: str):
        """The pure function predict compiles: uint8 images -> TTA-averaged logits."""
        return evaluation.predict_logits(state, images, mean=self.mean, std=self.std, tta=tta,
                                         pad_mode=self.pad_mode)

    def probabilities(self, state, images, tta: str):
        """logits -> softmax, in the same compiled program (one dispatch per batch)."""
        return jax.nn.softmax(self.logits(state, images, tta), axis=-1)

    def predict(self, images):
        """Returns (labels int32 (N,), probabilities float32 (N, classes))."""
        images = np.asarray(images)
        if images.dtype != np.uint8 or images.shape[1:] != self.image_shape:
            raise ValueError(f"expected uint8 images of shape (N, {self.image_shape}), "
                             f"got {images.dtype} {images.shape}")
        batches = [images[i:i + self.batch_size] for i in range(0, len(images), self.batch_size)]
        probabilities = np.concatenate(
            [np.asarray(self._probabilities(self.state, batch)) for batch in batches]
            or [np.zeros((0, len(self.class_names)), np.float32)])
        return probabilities.argmax(-1).astype(np.int32), probabilities

    def load_files(self, paths, workers: int | None = None):
        """Image files (folders walked recursively) -> (uint8 images (N, H, W, C), their
        paths, (path, why) for each that could not be read).

        Decoded and resized as the run's own data were (data/folder.py: Pillow, the
        run's data.resize to its image size, channels); threads decode in parallel
        (Pillow lets go of the GIL while it decodes).
        """
        from jaxtrain.data import folder
        files, errors = folder.find_images(paths)
        height, width, channels = self.image_shape

        def decode(path):
            try:
                return folder.decode_image(path, (height, width), channels, self.resize)
            except DataError as error:
                return str(error)

        workers = workers or min(32, os.cpu_count() or 1)
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            decoded = list(pool.map(decode, files))
        kept = [(path, image) for path, image in zip(files, decoded)
                if not isinstance(image, str)]
        errors += [(path, image) for path, image in zip(files, decoded) if isinstance(image, str)]
        images = np.stack([image for _, image in kept]) if kept else \
            np.zeros((0, *self.image_shape), np.uint8)
        return images, tuple(path for path, _ in kept), tuple(errors)

    def predict_files(self, paths, workers: int | None = None) -> FilePredictions:
        """Classifies image files or folders of them (JPEG, PNG, BMP, WebP, any mode or
        size); a file that cannot be read is listed in .errors, the others classified."""
        if isinstance(paths, (str, os.PathLike)):
            paths = [paths]
        images, files, errors = self.load_files(paths, workers)
        labels, probabilities = self.predict(images)
        return FilePredictions(files, labels, probabilities, self.class_names, errors)


def restore(workdir: str, step: int | None = None, tta: str | None = None,
            model=None, replica: int | None = None, which: str = "latest",
            weights: str = "raw", precision: str | None = None,
            pool_impl: str | None = None, conv_impl: str | None = None) -> Classifier:
    """The newest (or the given) checkpoint of the run in `workdir`, ready to classify.

    Needs no data: the normalisation and class names are stored in the checkpoint; nor
    the run's optimiser: only the weights are read, whatever optimiser state is saved.
    `model`: the Flax module instance a run was trained on through
    train_and_evaluate(model=...), or its class ('package.module:ClassName', built as a
    model.name is); without it a model.name is rebuilt, or imported, by itself, and so
    is an instance's class when it can be imported and built to fit the checkpoint.
    `replica`: which replica of a train.replicas or sweep run (default: the one with
    the best test accuracy at that checkpoint's last evaluation). which='best': the
    best checkpoint by the run's checkpoint.best_metric instead of the newest.
    weights='ema': the moving average of the weights a train.ema_decay run kept.
    precision: 'float32' or 'bfloat16' to compute in instead of the run's
    train.precision (the weights are float32 either way). pool_impl: how the built-in
    CNNs' max-pooling is computed instead of the run's model.pool_impl (export asks for
    'xla': ONNX's MaxPool, and lax's own pooling wherever a StableHLO file runs);
    conv_impl: the same for model.conv_impl ('xla': lax's convolutions, e.g. to compare).
    """
    if which not in ("latest", "best"):
        raise ValueError(f"which={which!r}: must be 'latest' or 'best'")
    if weights not in ("raw", "ema"):
        raise ValueError(f"weights={weights!r}: must be 'raw' or 'ema'")
    if precision is not None and precision not in checks.PRECISIONS:
        raise ValueError(f"precision={precision!r}: must be one of {', '.join(checks.PRECISIONS)}")
    config_file = os.path.join(workdir, checkpoint.CONFIG_FILE)
    if not os.path.isfile(config_file):
        raise checkpoint.CheckpointError(
            f"{workdir}: not a jaxtrain run (no {checkpoint.CONFIG_FILE} in it: give the "
            "workdir a training run wrote)")
    with open(config_file) as f:
        config = ml_collections.ConfigDict(json.load(f))
    if pool_impl is not None:
        config.model.pool_impl = pool_impl
    if conv_impl is not None:
        config.model.conv_impl = conv_impl
    if not checkpoint.saved_steps(checkpoint.checkpoint_dir(workdir)):
        raise checkpoint.CheckpointError(
            f"no checkpoint in {checkpoint.checkpoint_dir(workdir)} (the run saved none yet)")
    xla_cache.enable(config.get("train", {}).get("compilation_cache", xla_cache.DEFAULT))
    best = checkpoint.best_policy(config.get("checkpoint", {}))
    if which == "best" and best is None:
        raise ValueError(f"which='best': the run in {workdir} kept no best checkpoint (it "
                         "trained with checkpoint.best_metric='')")
    manager = checkpoint.create_manager(checkpoint.checkpoint_dir(workdir), create=False,
                                        best=best, weights_only=True)
    try:
        if which == "best":
            step = checkpoint.best_step(manager)
        meta = checkpoint.read_meta(manager, step)
        recorded_class = model is None and config.model.name.startswith(user.INSTANCE_PREFIX)
        if isinstance(model, str):  # a class, built as a model.name is
            config.model.name = model
        if model is None or isinstance(model, str):
            model = models.create_model(config.model, len(meta["class_names"]),
                                        checks.compute_dtype(precision or config.train.precision))
        else:
            model = user.from_instance(model)
        runs = replicas.runs(config)
        if runs is None and replica is not None:
            raise ValueError(f"replica={replica}: {workdir} holds a single run, not replicas")
        if runs is not None and replica is not None and not 0 <= replica < len(runs):
            raise ValueError(f"replica={replica}: {workdir} holds replicas 0 .. {len(runs) - 1}")
        # The weights' shapes only (no init compiled): Orbax fills them from the checkpoint.
        # No optimiser: inference needs none, and the run's may be one passed from Python,
        # which cannot be rebuilt here; the checkpoint's optimiser state is left unread.
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        key = jax.random.split(jax.random.key(0), len(runs)) if runs else jax.random.key(0)
        abstract = jax.eval_shape(functools.partial(
            train_state.create_train_state, model=model, tx=optax.identity(),
            image_shape=tuple(meta["image_shape"]), replicas=runs is not None,
            ema=config.train.get("ema_decay") is not None), key)
        try:
            state, meta = checkpoint.restore_weights(
                manager, checkpoint.restore_target(abstract, device), meta["step"])
        except checkpoint.CheckpointError as error:
            if not recorded_class:
                raise
            raise checkpoint.CheckpointError(  # its class built by default: not the instance
                f"{error}; this run trained a model passed from Python "
                f"({config.model.name[len(user.INSTANCE_PREFIX):]}), which its class as built "
                f"here is not: {user.PASS_IT_AGAIN}") from None
    finally:
        manager.close()
    if weights == "ema":
        if state.ema is None:
            raise ValueError(f"weights='ema': the run in {workdir} kept no moving average "
                             "(it trained with train.ema_decay=None)")
        state = train_state.ema_weights(state)
    if runs is not None:
        replica = replicas.best_replica(meta) if replica is None else replica
        state = replicas.take(state, replica)
    return Classifier(state, meta, tta or config.eval.tta, config.augment.pad_mode,
                      config.eval.batch_size, replica,
                      resize=config.get("data", {}).get("resize", "crop"), workdir=workdir,
                      weights=weights,
                      precision=checks.resolve_precision(precision or config.train.precision))


def restore_for(workdir: str, checkpoint_flag, weights: str = "raw", tta=None, precision=None,
                pool_impl=None, model=None):
    """jaxtrain.restore for the --checkpoint flag's step ('best', a number, or the newest)
    and the --model flag's class."""
    step, which = None, "latest"
    if checkpoint_flag == "best":
        which = "best"
    elif checkpoint_flag is not None:
        if not checkpoint_flag.strip().isdigit():
            raise ValueError(f"--checkpoint={checkpoint_flag}: expected a step number or 'best'")
        step = int(checkpoint_flag)
        check_step(workdir, step)
    return restore(workdir, step=step, which=which, weights=weights, tta=tta,
                   precision=precision, pool_impl=pool_impl, model=model)


def check_step(workdir: str, step: int) -> None:
    saved = checkpoint.saved_steps(checkpoint.checkpoint_dir(workdir))
    if step not in saved:
        raise checkpoint.CheckpointError(
            f"--checkpoint={step}: no such step in {checkpoint.checkpoint_dir(workdir)} "
            f"(saved steps: {', '.join(map(str, saved)) or 'none'})")
