"""A trained run, restored for inference: `jaxtrain.restore(workdir).predict(images)`."""
import functools
import json
import os

import jax
import ml_collections
import numpy as np

from jaxtrain import checkpoint, checks, models, replicas, train, user_model, xla_cache


class Classifier:
    """Classifies uint8 images (N, H, W, C) with a restored model, BatchNorm in inference mode."""

    def __init__(self, state, meta: dict, tta: str, pad_mode: str, batch_size: int,
                 replica: int | None = None):
        self.state = state
        self.replica = replica  # which replica of a replicated run (None: a single run)
        self.step = int(state.step)
        self.class_names = tuple(meta["class_names"])
        self.image_shape = tuple(meta["image_shape"])
        self.batch_size = batch_size
        self._logits = jax.jit(lambda state, images: train.predict_logits(
            state, images, mean=tuple(meta["mean"]), std=tuple(meta["std"]), tta=tta,
            pad_mode=pad_mode))

    def predict(self, images):
        """Returns (labels int32 (N,), probabilities float32 (N, classes))."""
        images = np.asarray(images)
        if images.dtype != np.uint8 or images.shape[1:] != self.image_shape:
            raise ValueError(f"expected uint8 images of shape (N, {self.image_shape}), "
                             f"got {images.dtype} {images.shape}")
        batches = [images[i:i + self.batch_size] for i in range(0, len(images), self.batch_size)]
        probabilities = np.concatenate(
            [np.asarray(jax.nn.softmax(self._logits(self.state, batch))) for batch in batches]
            or [np.zeros((0, len(self.class_names)), np.float32)])
        return probabilities.argmax(-1).astype(np.int32), probabilities


def restore(workdir: str, step: int | None = None, tta: str | None = None,
            model=None, replica: int | None = None, which: str = "latest",
            weights: str = "raw") -> Classifier:
    """The newest (or the given) checkpoint of the run in `workdir`, ready to classify.

    Needs no data: the normalisation and class names are stored in the checkpoint.
    `model`: the Flax module instance a run was trained on through
    train_and_evaluate(model=...) (a model.name is rebuilt, or imported, by itself).
    `replica`: which replica of a train.replicas or sweep run (default: the one with
    the best test accuracy at that checkpoint's last evaluation). which='best': the
    best checkpoint by the run's checkpoint.best_metric instead of the newest.
    weights='ema': the moving average of the weights a train.ema_decay run kept.
    """
    if which not in ("latest", "best"):
        raise ValueError(f"which={which!r}: must be 'latest' or 'best'")
    if weights not in ("raw", "ema"):
        raise ValueError(f"weights={weights!r}: must be 'raw' or 'ema'")
    with open(os.path.join(workdir, checkpoint.CONFIG_FILE)) as f:
        config = ml_collections.ConfigDict(json.load(f))
    xla_cache.enable(config.get("train", {}).get("compilation_cache", xla_cache.DEFAULT))
    best = checkpoint.best_policy(config.get("checkpoint", {}))
    if which == "best" and best is None:
        raise ValueError(f"which='best': the run in {workdir} kept no best checkpoint (it "
                         "trained with checkpoint.best_metric='')")
    manager = checkpoint.create_manager(checkpoint.checkpoint_dir(workdir), create=False,
                                        best=best)
    try:
        if which == "best":
            step = checkpoint.best_step(manager)
        meta = checkpoint.read_meta(manager, step)
        if model is not None:
            model = user_model.from_instance(model)
        else:
            model = models.create_model(config.model, len(meta["class_names"]),
                                        checks.PRECISIONS[config.train.precision])
        runs = replicas.runs(config)
        if runs is None and replica is not None:
            raise ValueError(f"replica={replica}: {workdir} holds a single run, not replicas")
        if runs is not None and replica is not None and not 0 <= replica < len(runs):
            raise ValueError(f"replica={replica}: {workdir} holds replicas 0 .. {len(runs) - 1}")
        tx = replicas.create_optimizer(config, 1, models.frozen_params(config.model))
        # The state's shapes only (no init compiled): Orbax fills them from the checkpoint.
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        key = jax.random.split(jax.random.key(0), len(runs)) if runs else jax.random.key(0)
        abstract = jax.eval_shape(functools.partial(
            train.create_train_state, model=model, tx=tx, image_shape=tuple(meta["image_shape"]),
            hyperparams=replicas.hyperparams(runs), replicas=runs is not None,
            ema=config.train.get("ema_decay") is not None), key)
        state, _, meta = checkpoint.restore(manager, checkpoint.restore_target(abstract, device),
                                            key, meta["step"])
    finally:
        manager.close()
    if weights == "ema":
        if state.ema is None:
            raise ValueError(f"weights='ema': the run in {workdir} kept no moving average "
                             "(it trained with train.ema_decay=None)")
        state = train.ema_weights(state)
    if runs is not None:
        replica = replicas.best_replica(meta) if replica is None else replica
        state = replicas.take(state, replica)
    return Classifier(state, meta, tta or config.eval.tta, config.augment.pad_mode,
                      config.eval.batch_size, replica)
