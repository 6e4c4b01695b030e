import functools

import flax.linen as nn
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


def small_cifar_cnn(num_classes=10, **overrides):
    """A cifar_cnn small enough for the CPU; 16x16 inputs leave 1x1 after three blocks."""
    settings = dict(widths=(8, 12, 4), stem_width=6)
    settings.update(overrides)
    return models.create_model(model_config("cifar_cnn", **settings), num_classes, jnp.float32)


def conv_same(x, kernel):
    return jax.lax.conv_general_dilated(x, kernel, (1, 1), "SAME",
                                        dimension_numbers=("NHWC", "HWIO", "NHWC"),
                                        precision=jax.lax.Precision.HIGHEST)


@pytest.mark.parametrize("in_channels,out_channels", [(4, 8), (8, 4), (6, 6)])
def test_dirac_init_passes_the_first_channels_through(in_channels, out_channels):
    shape, key = (3, 3, in_channels, out_channels), jax.random.key(0)
    kernel = models.conv_kernel_init("dirac")(key, shape)
    x = jax.random.normal(jax.random.key(1), (2, 5, 5, in_channels))
    n = min(in_channels, out_channels)
    np.testing.assert_allclose(conv_same(x, kernel)[..., :n], x[..., :n], atol=1e-6)
    # the other filters keep the default init
    default = models.conv_kernel_init("default")(key, shape)
    np.testing.assert_array_equal(kernel[..., n:], default[..., n:])


def test_dirac_init_reaches_every_block_conv_and_only_them():
    variables = small_cifar_cnn(conv_init="dirac").init(jax.random.key(0),
                                                        jnp.zeros((1, 16, 16, 3)))
    default = small_cifar_cnn().init(jax.random.key(0), jnp.zeros((1, 16, 16, 3)))
    params, default = variables["params"], default["params"]
    x = jax.random.normal(jax.random.key(1), (2, 4, 4, 12))
    for block in ("ConvBlock_0", "ConvBlock_1", "ConvBlock_2"):
        for conv in ("Conv_0", "Conv_1"):
            kernel = params[block][conv]["kernel"]
            _, _, in_channels, out_channels = kernel.shape
            n = min(in_channels, out_channels)
            out = conv_same(x[..., :in_channels], kernel)
            np.testing.assert_allclose(out[..., :n], x[..., :n], atol=1e-6)
            np.testing.assert_array_equal(kernel[..., n:], default[block][conv]["kernel"][..., n:])
    # ConvBlock_1/Conv_0 maps 8 -> 12 channels: 4 filters keep the default init
    assert params["ConvBlock_1"]["Conv_0"]["kernel"].shape == (3, 3, 8, 12)
    # the stem and the head are not block convs
    np.testing.assert_array_equal(params["Conv_0"]["kernel"], default["Conv_0"]["kernel"])
    np.testing.assert_array_equal(params["Dense_0"]["kernel"], default["Dense_0"]["kernel"])


def test_activation_names_map_to_their_functions():
    assert models.ACTIVATIONS == ("gelu_tanh", "gelu", "silu", "relu")
    z = jnp.linspace(-4.0, 4.0, 81)
    erf = jax.scipy.special.erf
    expected = {
        "gelu_tanh": 0.5 * z * (1 + jnp.tanh(np.sqrt(2 / np.pi) * (z + 0.044715 * z ** 3))),
        "gelu": 0.5 * z * (1 + erf(z / np.sqrt(2))),
        "silu": z / (1 + jnp.exp(-z)),
        "relu": jnp.maximum(z, 0.0),
    }
    for name in models.ACTIVATIONS:
        np.testing.assert_allclose(models.activation_fn(name)(z), expected[name], atol=1e-6,
                                   err_msg=name)
    # the two GELUs really differ (by up to ~5e-4)
    assert np.abs(expected["gelu"] - expected["gelu_tanh"]).max() > 1e-4


def test_cifar_cnn_activation_option_changes_the_network():
    x = jax.random.normal(jax.random.key(1), (2, 16, 16, 3))
    variables = small_cifar_cnn().init(jax.random.key(0), x)  # the same params for every name
    logits = {name: small_cifar_cnn(activation=name).apply(variables, x)
              for name in models.ACTIVATIONS}
    for i, a in enumerate(models.ACTIVATIONS):
        for b in models.ACTIVATIONS[i + 1:]:
            assert not np.allclose(logits[a], logits[b]), (a, b)
    assert small_cifar_cnn().activation == "gelu_tanh"  # the default is the old behaviour


def test_unknown_activation_or_conv_init_names_the_key_and_the_choices():
    with pytest.raises(ValueError, match=r"model.activation 'tanh'.*gelu_tanh, gelu, silu, relu"):
        small_cifar_cnn(activation="tanh")
    with pytest.raises(ValueError, match=r"model.conv_init 'orthogonal'.*default, dirac"):
        small_cifar_cnn(conv_init="orthogonal")
    assert models.CONV_INITS == ("default", "dirac")


def test_configs_saved_before_the_options_restore_with_the_old_behaviour():
    config = model_config("cifar_cnn").to_dict()
    for key in ("activation", "conv_init", "bn_epsilon", "head_init_std"):
        del config[key]
    model = models.create_model(ml_collections.ConfigDict(config), 10, jnp.float32)
    assert (model.activation, model.conv_init, model.bn_epsilon, model.head_init_std) \
        == ("gelu_tanh", "default", 1e-5, 0.0)


def test_bn_epsilon_reaches_every_batch_norm():
    model = small_cifar_cnn(bn_epsilon=1e-3)
    x = jax.random.normal(jax.random.key(1), (2, 16, 16, 3))
    variables = model.init(jax.random.key(0), x)
    epsilons = []

    def record(next_fun, args, kwargs, context):
        if isinstance(context.module, nn.BatchNorm):
            epsilons.append(context.module.epsilon)
        return next_fun(*args, **kwargs)

    with nn.intercept_methods(record):
        model.apply(variables, x)
    assert epsilons == [1e-3] * 6  # two per block
    # and it is used: a huge epsilon shrinks the normalised activations
    big = small_cifar_cnn(bn_epsilon=1e3).apply(variables, x, train=True,
                                                mutable=["batch_stats"])[0]
    assert not np.allclose(big, model.apply(variables, x, train=True,
                                            mutable=["batch_stats"])[0])


def test_head_init_std():
    def head(**overrides):
        model = small_cifar_cnn(num_classes=1000, **overrides)  # many weights: a good std
        variables = model.init(jax.random.key(0), jnp.zeros((1, 16, 16, 3)))
        return np.asarray(variables["params"]["Dense_0"]["kernel"])

    kernel = head(head_init_std=1.0)
    assert kernel.shape == (4, 1000)
    assert abs(kernel.std() - 1.0) < 0.05 and abs(kernel.mean()) < 0.05
    # 0 keeps Flax's default (LeCun normal: std 1/sqrt(fan_in) = 1/2)
    assert abs(head().std() - 0.5) < 0.03
    with pytest.raises(ValueError, match="model.head_init_std"):
        head(head_init_std=-1.0)


def cifar_stats(images):
    mean = tuple(float(m) for m in images.mean(axis=(0, 1, 2)) / 255)
    std = tuple(float(s) for s in images.std(axis=(0, 1, 2)) / 255)
    return mean, std


def test_whitening_kernel_is_the_same_eager_and_jitted(cifar_subset):
    images = cifar_subset["x_train"]
    mean, std = cifar_stats(images)
    eager = models.whitening_kernel(images[:500], mean, std, filters=24)
    jitted = jax.jit(functools.partial(models.whitening_kernel, mean=mean, std=std, filters=24,
                                       max_images=500))
    # a device array in, only the first max_images used
    np.testing.assert_allclose(jitted(jnp.asarray(images)), eager, rtol=1e-5, atol=1e-5)
    assert eager.dtype == jnp.float32 and eager.shape == (2, 2, 3, 24)


def test_whitening_kernel_whitens_the_patches_it_was_fitted_on(cifar_subset):
    images = cifar_subset["x_train"][:500]
    mean, std = cifar_stats(images)
    eps = 5e-4
    kernel = np.asarray(models.whitening_kernel(images, mean, std, filters=24, eps=eps))
    x = (images.astype(np.float64) / 255 - np.array(mean)) / np.array(std)
    windows = np.lib.stride_tricks.sliding_window_view(x, (2, 2), axis=(1, 2))
    patches = windows.transpose(0, 1, 2, 4, 5, 3).reshape(-1, 12)  # (kh, kw, c) order
    moment = patches.T @ patches / len(patches)  # uncentred, as the speedruns
    eigenvalues = np.linalg.eigvalsh(moment)[::-1]
    out = patches @ kernel.reshape(12, 24)[:, :12]  # every direction, largest first
    whitened = out.T @ out / len(out)
    # identity, up to eps: direction i has second moment eigenvalue_i / (eigenvalue_i + eps)
    np.testing.assert_allclose(whitened, np.diag(eigenvalues / (eigenvalues + eps)), atol=2e-3)
    assert eigenvalues[0] / eigenvalues[-1] > 1e3  # real images: strongly correlated pixels


def test_whitening_kernel_checks_its_arguments():
    images = np.zeros((4, 8, 8, 3), np.uint8)
    with pytest.raises(ValueError, match="filters=26"):
        models.whitening_kernel(images, (0.5,) * 3, (0.25,) * 3, filters=26)
    with pytest.raises(ValueError, match="uint8"):
        models.whitening_kernel(images.astype(np.float32), (0.5,) * 3, (0.25,) * 3, filters=8)
