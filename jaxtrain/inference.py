"""A trained run, restored for inference: `jaxtrain.restore(workdir).predict(images)`."""
import functools
import json
import os

import jax
import ml_collections
import numpy as np

from jaxtrain import checkpoint, checks, models, optim, train, user_model, xla_cache


class Classifier:
    """Classifies uint8 images (N, H, W, C) with a restored model, BatchNorm in inference mode."""

    def __init__(self, state, meta: dict, tta: str, pad_mode: str, batch_size: int):
        self.state = state
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
            model=None) -> Classifier:
    """The newest (or the given) checkpoint of the run in `workdir`, ready to classify.

    Needs no data: the normalisation and class names are stored in the checkpoint.
    `model`: the Flax module instance a run was trained on through
    train_and_evaluate(model=...) (a model.name is rebuilt, or imported, by itself).
    """
    with open(os.path.join(workdir, checkpoint.CONFIG_FILE)) as f:
        config = ml_collections.ConfigDict(json.load(f))
    xla_cache.enable(config.get("train", {}).get("compilation_cache", xla_cache.DEFAULT))
    manager = checkpoint.create_manager(checkpoint.checkpoint_dir(workdir), create=False)
    try:
        meta = checkpoint.read_meta(manager, step)
        if model is not None:
            model = user_model.from_instance(model)
        else:
            model = models.create_model(config.model, len(meta["class_names"]),
                                        checks.PRECISIONS[config.train.precision])
        tx = optim.create_optimizer(config.optimizer, optim.create_schedule(config.optimizer, 1),
                                    models.frozen_params(config.model))
        # The state's shapes only (no init compiled): Orbax fills them from the checkpoint.
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        abstract = jax.eval_shape(functools.partial(
            train.create_train_state, model=model, tx=tx, image_shape=tuple(meta["image_shape"])),
            jax.random.key(0))
        state, _, meta = checkpoint.restore(manager, checkpoint.restore_target(abstract, device),
                                            jax.random.key(0), meta["step"])
    finally:
        manager.close()
    return Classifier(state, meta, tta or config.eval.tta, config.augment.pad_mode,
                      config.eval.batch_size)
