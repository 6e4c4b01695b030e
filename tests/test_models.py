import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from configs import default
from jaxtrain import models


def model_config(name, **overrides):
    config = default.get_config().model
    config.name = name
    config.update(overrides)
    return config


def init(model, shape=(2, 32, 32, 3)):
    return model.init(jax.random.key(0), jnp.zeros(shape), train=False)


def test_seed_cnn_matches_the_article_network():
    variables = init(models.create_model(model_config("seed_cnn"), 10, jnp.float32))
    params = variables["params"]
    # torch: conv1 456 + conv2 2416 + fc1 48120 + fc2 10164 + fc3 850
    assert models.count_params(params) == 62006
    assert "batch_stats" not in variables
    kernel = np.asarray(params["Conv_0"]["kernel"])
    assert kernel.shape == (5, 5, 3, 6)
    bound = 1 / np.sqrt(5 * 5 * 3)  # PyTorch's default init range
    assert np.abs(kernel).max() <= bound and np.abs(kernel).max() > 0.9 * bound
    bias = np.asarray(params["Conv_0"]["bias"])
    assert np.abs(bias).max() <= bound and np.any(bias != 0)


def test_seed_cnn_batch_norm_option_adds_statistics():
    variables = init(models.create_model(model_config("seed_cnn", batch_norm=True), 10,
                                         jnp.float32))
    assert len(variables["batch_stats"]) == 4  # after 2 convs and 2 hidden dense layers


def test_cifar_cnn_shapes_and_mixed_precision():
    model = models.create_model(model_config("cifar_cnn"), 10, jnp.bfloat16)
    variables = init(model)
    assert all(p.dtype == jnp.float32 for p in jax.tree_util.tree_leaves(variables))
    x = jax.random.normal(jax.random.key(1), (8, 32, 32, 3))
    logits, updates = model.apply(variables, x, train=True, mutable=["batch_stats"])
    assert logits.shape == (8, 10) and logits.dtype == jnp.float32
    assert all(s.dtype == jnp.float32 for s in jax.tree_util.tree_leaves(updates))
    # the convolutions really run in bfloat16
    hlo = jax.jit(lambda v, x: model.apply(v, x)).lower(variables, x).as_text()
    assert "bf16" in hlo


def test_batch_norm_train_and_eval_modes_differ_and_stats_update():
    model = models.create_model(model_config("cifar_cnn", widths=(8, 8, 8), stem_width=4), 10,
                                jnp.float32)
    variables = init(model)
    x = 3.0 + 2.0 * jax.random.normal(jax.random.key(1), (16, 32, 32, 3))
    train_logits, updates = model.apply(variables, x, train=True, mutable=["batch_stats"])
    eval_logits = model.apply(variables, x, train=False)
    assert not np.allclose(train_logits, eval_logits)
    before = jax.tree_util.tree_leaves(variables["batch_stats"])
    after = jax.tree_util.tree_leaves(updates["batch_stats"])
    assert any(not np.allclose(a, b) for a, b in zip(before, after))


def test_unknown_model_name():
    with pytest.raises(ValueError, match="unknown model.name 'resnet'"):
        models.create_model(model_config("resnet"), 10, jnp.float32)


def test_mlp_matches_the_articles_bp_network():
    model = models.create_model(model_config("mlp", hidden_sizes=(256, 128, 100),
                                             batch_norm=True), 10, jnp.float32)
    variables = init(model, (2, 28, 28, 1))
    # torch: Linear 784-256, BN1d(256), Linear 256-128, BN1d(128), Linear 128-100, BN1d(100),
    # Linear 100-10
    assert models.count_params(variables["params"]) == 248734
    assert len(variables["batch_stats"]) == 3


def test_mlp_batch_norm_uses_batch_statistics_only_in_training():
    model = models.create_model(model_config("mlp", hidden_sizes=(32,), batch_norm=True), 10,
                                jnp.float32)
    variables = init(model, (2, 28, 28, 1))
    x = jax.random.normal(jax.random.key(1), (8, 28, 28, 1))
    # inference mode is per example: one image gives the same logits alone or in a batch
    alone = model.apply(variables, x[:1], train=False)
    np.testing.assert_allclose(model.apply(variables, x, train=False)[:1], alone, rtol=1e-5)
    # training mode normalises with the batch, so the other images change the result
    in_batch, _ = model.apply(variables, x, train=True, mutable=["batch_stats"])
    in_other_batch, _ = model.apply(variables, jnp.concatenate([x[:1], 2 * x[1:]]), train=True,
                                    mutable=["batch_stats"])
    assert not np.allclose(in_batch[0], in_other_batch[0])


def test_mlp_dropout_only_in_training():
    model = models.create_model(model_config("mlp", hidden_sizes=(64,), dropout=0.5), 10,
                                jnp.float32)
    variables = init(model, (2, 28, 28, 1))
    x = jax.random.normal(jax.random.key(1), (4, 28, 28, 1))

    def train_logits(seed):
        return model.apply(variables, x, train=True, mutable=["batch_stats"],
                           rngs={"dropout": jax.random.key(seed)})[0]

    assert not np.allclose(train_logits(0), train_logits(1))
    np.testing.assert_array_equal(model.apply(variables, x), model.apply(variables, x))


@pytest.mark.parametrize("name", ["seed_cnn", "cifar_cnn", "mlp"])
def test_every_model_takes_one_channel_28x28_images(name):
    model = models.create_model(model_config(name, batch_norm=True), 10, jnp.float32)
    variables = init(model, (2, 28, 28, 1))
    logits = model.apply(variables, jnp.ones((3, 28, 28, 1)))
    assert logits.shape == (3, 10)
    if name == "seed_cnn":  # conv 5x5 -> 24 -> pool 12 -> conv -> 8 -> pool 4: 16*4*4 inputs
        assert variables["params"]["Dense_0"]["kernel"].shape == (256, 120)


def test_whitening_kernel_decorrelates_real_image_patches(cifar_subset):
    images = cifar_subset["x_train"]
    mean, std = images.mean(axis=(0, 1, 2)) / 255, images.std(axis=(0, 1, 2)) / 255
    kernel = models.whitening_kernel(images, mean, std, filters=24)
    assert kernel.shape == (2, 2, 3, 24)
    np.testing.assert_array_equal(kernel[..., 12:], -kernel[..., :12])
    x = (images[1000:1500].astype(np.float32) / 255 - mean) / std  # images it was not fitted on
    out = jax.lax.conv_general_dilated(jnp.asarray(x), jnp.asarray(kernel), (1, 1), "VALID",
                                       dimension_numbers=("NHWC", "HWIO", "NHWC"))
    covariance = np.cov(np.asarray(out).reshape(-1, 24)[:, :6], rowvar=False)  # top 6
    np.testing.assert_allclose(np.diag(covariance), 1.0, atol=0.1)
    assert np.abs(covariance - np.diag(np.diag(covariance))).max() < 0.1
    raw = np.cov(x[:, :2, :2].reshape(len(x), -1), rowvar=False)  # neighbouring pixels: correlated
    assert np.abs(raw - np.diag(np.diag(raw))).max() > 0.5


def test_only_cifar_cnn_with_a_whitened_stem_freezes_a_parameter():
    assert models.frozen_params(model_config("cifar_cnn", stem_init="whiten")) == ("Conv_0/kernel",)
    assert models.frozen_params(model_config("cifar_cnn")) == ()
    assert models.frozen_params(model_config("mlp", stem_init="whiten")) == ()
    with pytest.raises(ValueError, match="at most 24"):
        models.check_stem(model_config("cifar_cnn", stem_init="whiten", stem_width=26), 3)
    models.check_stem(model_config("cifar_cnn", stem_init="whiten", stem_width=8), 1)
    assert models.has_whitened_stem(model_config("cifar_cnn", stem_init="whiten"))
    assert not models.has_whitened_stem(model_config("mlp", stem_init="whiten"))
