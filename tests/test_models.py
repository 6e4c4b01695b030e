import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from conftest import normal
from tolerances import ELEMENTWISE, NETWORK_PASS, WHITENING
from configs import default
from jaxtrain import models
from jaxtrain.models import cnn, resnet, whitening
from jaxtrain.training import prepare


def model_config(name, **overrides):
    config = default.get_config().model
    config.name = name
    config.update(overrides)
    return config


def init(model, shape=(2, 32, 32, 3)):
    """The model's variables (train=False) from one compiled init call, drawn with an RBG
    key: its init compiles in a fraction of the time threefry's takes on the CPU (~2 s
    against ~10 s for a small cifar_cnn), and what these tests check (shapes, ranges,
    paths, one init against another with the same key) holds for either."""
    return jax.jit(functools.partial(model.init, train=False))(jax.random.key(0, impl="rbg"),
                                                               jnp.zeros(shape))


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


@pytest.mark.slow
def test_cifar_cnn_shapes_and_mixed_precision():
    model = models.create_model(model_config("cifar_cnn"), 10, jnp.bfloat16)
    variables = init(model)
    assert all(p.dtype == jnp.float32 for p in jax.tree_util.tree_leaves(variables))
    x = normal((8, 32, 32, 3), 1)
    logits, updates = jax.jit(functools.partial(model.apply, train=True, mutable=["batch_stats"]))(
        variables, x)  # one compiled program: op by op, each op compiles on its own
    assert logits.shape == (8, 10) and logits.dtype == jnp.float32
    assert all(s.dtype == jnp.float32 for s in jax.tree_util.tree_leaves(updates))
    # the convolutions really run in bfloat16
    hlo = jax.jit(lambda v, x: model.apply(v, x)).lower(variables, x).as_text()
    assert "bf16" in hlo


@pytest.mark.slow
def test_batch_norm_train_and_eval_modes_differ_and_stats_update():
    model = models.create_model(model_config("cifar_cnn", widths=(8, 8, 8), stem_width=4), 10,
                                jnp.float32)
    variables = init(model)
    x = 3.0 + 2.0 * normal((16, 32, 32, 3), 1)
    (train_logits, updates), eval_logits = jax.jit(lambda variables, x: (  # one program
        model.apply(variables, x, train=True, mutable=["batch_stats"]),
        model.apply(variables, x, train=False)))(variables, x)
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
    x = normal((8, 28, 28, 1), 1)

    @jax.jit  # one program
    def logits(variables, x):
        def train(images):
            return model.apply(variables, images, train=True, mutable=["batch_stats"])[0]
        return (model.apply(variables, x[:1], train=False), model.apply(variables, x, train=False),
                train(x), train(jnp.concatenate([x[:1], 2 * x[1:]])))

    alone, evaluated, in_batch, in_other_batch = logits(variables, x)
    # inference mode is per example: one image gives the same logits alone or in a batch
    np.testing.assert_allclose(evaluated[:1], alone, rtol=NETWORK_PASS)
    # training mode normalises with the batch, so the other images change the result
    assert not np.allclose(in_batch[0], in_other_batch[0])


def test_mlp_dropout_only_in_training():
    model = models.create_model(model_config("mlp", hidden_sizes=(64,), dropout=0.5), 10,
                                jnp.float32)
    variables = init(model, (2, 28, 28, 1))
    x = normal((4, 28, 28, 1), 1)

    @jax.jit
    def train_logits(key):
        return model.apply(variables, x, train=True, mutable=["batch_stats"],
                           rngs={"dropout": key})[0]

    assert not np.allclose(train_logits(jax.random.key(0)), train_logits(jax.random.key(1)))
    evaluate = jax.jit(model.apply)
    np.testing.assert_array_equal(evaluate(variables, x), evaluate(variables, x))


@pytest.mark.parametrize("name", ["seed_cnn", "cifar_cnn", "mlp"])
def test_every_model_takes_one_channel_28x28_images(name):
    model = models.create_model(model_config(name, batch_norm=True), 10, jnp.float32)
    variables = init(model, (2, 28, 28, 1))
    logits = jax.jit(model.apply)(variables, jnp.ones((3, 28, 28, 1)))
    assert logits.shape == (3, 10)
    if name == "seed_cnn":  # conv 5x5 -> 24 -> pool 12 -> conv -> 8 -> pool 4: 16*4*4 inputs
        assert variables["params"]["Dense_0"]["kernel"].shape == (256, 120)


@pytest.mark.slow
def test_whitening_kernel_decorrelates_real_image_patches(cifar_subset):
    images = cifar_subset["x_train"]
    mean, std = images.mean(axis=(0, 1, 2)) / 255, images.std(axis=(0, 1, 2)) / 255
    kernel = whitening.whitening_kernel(images, mean, std, filters=24)
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
        whitening.check_stem(model_config("cifar_cnn", stem_init="whiten", stem_width=26), 3)
    whitening.check_stem(model_config("cifar_cnn", stem_init="whiten", stem_width=8), 1)
    assert whitening.has_whitened_stem(model_config("cifar_cnn", stem_init="whiten"))
    assert not whitening.has_whitened_stem(model_config("mlp", stem_init="whiten"))


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
    shape = (3, 3, in_channels, out_channels)

    @jax.jit  # one program, not one per op
    def kernels_and_output(key, x):
        kernel = cnn.conv_kernel_init("dirac")(key, shape)
        return kernel, cnn.conv_kernel_init("default")(key, shape), conv_same(x, kernel)

    x = normal((2, 5, 5, in_channels), 1)
    kernel, default, out = kernels_and_output(jax.random.key(0, impl="rbg"), x)
    n = min(in_channels, out_channels)
    np.testing.assert_allclose(out[..., :n], x[..., :n], atol=ELEMENTWISE)
    # the other filters keep the default init
    np.testing.assert_array_equal(kernel[..., n:], default[..., n:])


@pytest.mark.slow
def test_dirac_init_reaches_every_block_conv_and_only_them():
    dirac, plain = small_cifar_cnn(conv_init="dirac"), small_cifar_cnn()
    params, default = jax.jit(lambda key, x: (  # both inits in one program, the same key
        dirac.init(key, x)["params"], plain.init(key, x)["params"]))(
        jax.random.key(0, impl="rbg"), jnp.zeros((1, 16, 16, 3)))
    x = normal((2, 4, 4, 12), 1)
    blocks = [(block, conv) for block in ("ConvBlock_0", "ConvBlock_1", "ConvBlock_2")
              for conv in ("Conv_0", "Conv_1")]
    outs = jax.jit(lambda kernels: [conv_same(x[..., :k.shape[2]], k) for k in kernels])(
        [params[block][conv]["kernel"] for block, conv in blocks])  # one program
    for (block, conv), out in zip(blocks, outs):
        kernel = params[block][conv]["kernel"]
        _, _, in_channels, out_channels = kernel.shape
        n = min(in_channels, out_channels)
        np.testing.assert_allclose(out[..., :n], x[..., :n], atol=ELEMENTWISE)
        np.testing.assert_array_equal(kernel[..., n:], default[block][conv]["kernel"][..., n:])
    # ConvBlock_1/Conv_0 maps 8 -> 12 channels: 4 filters keep the default init
    assert params["ConvBlock_1"]["Conv_0"]["kernel"].shape == (3, 3, 8, 12)
    # the stem and the head are not block convs
    np.testing.assert_array_equal(params["Conv_0"]["kernel"], default["Conv_0"]["kernel"])
    np.testing.assert_array_equal(params["Dense_0"]["kernel"], default["Dense_0"]["kernel"])


def test_activation_names_map_to_their_functions():
    assert cnn.ACTIVATIONS == ("gelu_tanh", "gelu", "silu", "relu")
    z = jnp.linspace(-4.0, 4.0, 81)
    erf = jax.scipy.special.erf
    expected = {
        "gelu_tanh": 0.5 * z * (1 + jnp.tanh(np.sqrt(2 / np.pi) * (z + 0.044715 * z ** 3))),
        "gelu": 0.5 * z * (1 + erf(z / np.sqrt(2))),
        "silu": z / (1 + jnp.exp(-z)),
        "relu": jnp.maximum(z, 0.0),
    }
    for name in cnn.ACTIVATIONS:
        np.testing.assert_allclose(cnn.activation_fn(name)(z), expected[name],
                                   atol=ELEMENTWISE, err_msg=name)
    # the two GELUs really differ (by up to ~5e-4)
    assert np.abs(expected["gelu"] - expected["gelu_tanh"]).max() > 1e-4


@pytest.mark.slow
def test_cifar_cnn_activation_option_changes_the_network():
    x = normal((2, 16, 16, 3), 1)
    variables = init(small_cifar_cnn(), x.shape)  # the same params for every name
    logits = jax.jit(lambda variables: {  # the four networks in one compiled program
        name: small_cifar_cnn(activation=name).apply(variables, x)
        for name in cnn.ACTIVATIONS})(variables)
    for i, a in enumerate(cnn.ACTIVATIONS):
        for b in cnn.ACTIVATIONS[i + 1:]:
            assert not np.allclose(logits[a], logits[b]), (a, b)
    assert small_cifar_cnn().activation == "gelu_tanh"  # the default is the old behaviour


def test_unknown_activation_or_conv_init_names_the_key_and_the_choices():
    with pytest.raises(ValueError, match=r"model.activation 'tanh'.*gelu_tanh, gelu, silu, relu"):
        small_cifar_cnn(activation="tanh")
    with pytest.raises(ValueError, match=r"model.conv_init 'orthogonal'.*default, dirac"):
        small_cifar_cnn(conv_init="orthogonal")
    assert cnn.CONV_INITS == ("default", "dirac")


def test_configs_saved_before_the_options_restore_with_the_old_behaviour():
    config = model_config("cifar_cnn").to_dict()
    for key in ("activation", "conv_init", "bn_epsilon", "head_init_std"):
        del config[key]
    model = models.create_model(ml_collections.ConfigDict(config), 10, jnp.float32)
    assert (model.activation, model.conv_init, model.bn_epsilon, model.head_init_std) \
        == ("gelu_tanh", "default", 1e-5, 0.0)


@pytest.mark.slow
def test_bn_epsilon_reaches_every_batch_norm():
    model = small_cifar_cnn(bn_epsilon=1e-3)
    x = normal((2, 16, 16, 3), 1)
    variables = init(model, x.shape)
    epsilons = []

    def record(next_fun, args, kwargs, context):
        if isinstance(context.module, nn.BatchNorm):
            epsilons.append(context.module.epsilon)
        return next_fun(*args, **kwargs)

    with nn.intercept_methods(record):
        jax.eval_shape(model.apply, variables, x)  # traced: the modules are called, nothing runs
    assert epsilons == [1e-3] * 6  # two per block
    # and it is used: a huge epsilon shrinks the normalised activations
    big, usual = jax.jit(lambda variables: [  # one program
        m.apply(variables, x, train=True, mutable=["batch_stats"])[0]
        for m in (small_cifar_cnn(bn_epsilon=1e3), model)])(variables)
    assert not np.allclose(big, usual)


@pytest.mark.slow
def test_head_init_std():
    def heads(*settings):  # the models' inits in one program
        built = [small_cifar_cnn(num_classes=1000, **overrides)  # many weights: a good std
                 for overrides in settings]
        return [np.asarray(kernel) for kernel in jax.jit(lambda key, x: [
            model.init(key, x, train=False)["params"]["Dense_0"]["kernel"] for model in built])(
            jax.random.key(0, impl="rbg"), jnp.zeros((1, 16, 16, 3)))]

    kernel, default = heads({"head_init_std": 1.0}, {})
    assert kernel.shape == (4, 1000)
    assert abs(kernel.std() - 1.0) < 0.05 and abs(kernel.mean()) < 0.05
    # 0 keeps Flax's default (LeCun normal: std 1/sqrt(fan_in) = 1/2)
    assert abs(default.std() - 0.5) < 0.03
    with pytest.raises(ValueError, match="model.head_init_std"):
        heads({"head_init_std": -1.0})


def cifar_stats(images):
    mean = tuple(float(m) for m in images.mean(axis=(0, 1, 2)) / 255)
    std = tuple(float(s) for s in images.std(axis=(0, 1, 2)) / 255)
    return mean, std


def test_whitening_kernel_is_the_same_eager_and_jitted(cifar_subset):
    images = cifar_subset["x_train"]
    mean, std = cifar_stats(images)
    eager = whitening.whitening_kernel(images[:500], mean, std, filters=24)
    jitted = jax.jit(functools.partial(whitening.whitening_kernel, mean=mean, std=std, filters=24,
                                       max_images=500))
    # a device array in, only the first max_images used
    np.testing.assert_allclose(jitted(jnp.asarray(images)), eager, rtol=NETWORK_PASS,
                               atol=NETWORK_PASS)
    assert eager.dtype == jnp.float32 and eager.shape == (2, 2, 3, 24)


def test_whitening_kernel_whitens_the_patches_it_was_fitted_on(cifar_subset):
    images = cifar_subset["x_train"][:500]
    mean, std = cifar_stats(images)
    eps = 5e-4
    kernel = np.asarray(whitening.whitening_kernel(images, mean, std, filters=24, eps=eps))
    x = (images.astype(np.float64) / 255 - np.array(mean)) / np.array(std)
    windows = np.lib.stride_tricks.sliding_window_view(x, (2, 2), axis=(1, 2))
    patches = windows.transpose(0, 1, 2, 4, 5, 3).reshape(-1, 12)  # (kh, kw, c) order
    moment = patches.T @ patches / len(patches)  # uncentred, as the speedruns
    eigenvalues = np.linalg.eigvalsh(moment)[::-1]
    out = patches @ kernel.reshape(12, 24)[:, :12]  # every direction, largest first
    whitened = out.T @ out / len(out)
    # identity, up to eps: direction i has second moment eigenvalue_i / (eigenvalue_i + eps)
    # (float32's kernel against float64's patches: of entries at most 1)
    np.testing.assert_allclose(whitened, np.diag(eigenvalues / (eigenvalues + eps)),
                               atol=WHITENING)
    assert eigenvalues[0] / eigenvalues[-1] > 1e3  # real images: strongly correlated pixels


def test_whitening_kernel_checks_its_arguments():
    images = np.zeros((4, 8, 8, 3), np.uint8)
    with pytest.raises(ValueError, match="filters=26"):
        whitening.whitening_kernel(images, (0.5,) * 3, (0.25,) * 3, filters=26)
    with pytest.raises(ValueError, match="uint8"):
        whitening.whitening_kernel(images.astype(np.float32), (0.5,) * 3, (0.25,) * 3, filters=8)


# ---------------------------------------------------------------- ResNet

# torchvision's parameter counts (1000 classes, the ImageNet stem); BN statistics are not params
TORCHVISION_PARAMS = {"resnet18": 11_689_512, "resnet34": 21_797_672, "resnet50": 25_557_032}
CIFAR_STEM_SAVES = (7 * 7 - 3 * 3) * 3 * 64  # a 3x3 stem conv in place of the 7x7 one


def abstract_variables(model, shape):
    """The variables' shapes and dtypes, without computing them."""
    return jax.eval_shape(functools.partial(model.init, train=False), jax.random.key(0),
                          jnp.zeros(shape))


@pytest.mark.parametrize("name", ["resnet18", "resnet34", "resnet50"])
def test_resnet_parameter_counts_are_torchvisions(name):
    model = models.create_model(model_config(name, stem="imagenet"), 1000, jnp.float32)
    variables = abstract_variables(model, (1, 224, 224, 3))
    assert models.count_params(variables["params"]) == TORCHVISION_PARAMS[name]
    assert models.count_params(variables["batch_stats"]) > 0  # present, and not params
    cifar = models.create_model(model_config(name, stem="cifar"), 1000, jnp.float32)
    count = models.count_params(abstract_variables(cifar, (1, 32, 32, 3))["params"])
    assert count == TORCHVISION_PARAMS[name] - CIFAR_STEM_SAVES


def test_resnet18_cifar_stem_at_10_classes_is_the_usual_cifar_resnet18():
    model = models.create_model(model_config("resnet18", stem="cifar"), 10, jnp.float32)
    assert models.count_params(abstract_variables(model, (1, 32, 32, 3))["params"]) == 11_173_962


def test_resnet_layer_names_and_shapes():
    model = models.create_model(model_config("resnet18", stem="imagenet"), 10, jnp.float32)
    params = abstract_variables(model, (1, 64, 64, 3))["params"]
    assert sorted(params) == ["BatchNorm_0", "Conv_0", "Dense_0"] + [f"ResNetBlock_{i}"
                                                                       for i in range(8)]
    assert params["Conv_0"]["kernel"].shape == (7, 7, 3, 64)
    assert "Conv_2" not in params["ResNetBlock_1"]  # 64 -> 64, stride 1: identity shortcut
    assert params["ResNetBlock_2"]["Conv_2"]["kernel"].shape == (1, 1, 64, 128)  # projection
    assert params["ResNetBlock_2"]["BatchNorm_2"]["scale"].shape == (128,)
    assert params["Dense_0"]["kernel"].shape == (512, 10)
    model = models.create_model(model_config("resnet50", stem="cifar"), 10, jnp.float32)
    params = abstract_variables(model, (1, 32, 32, 3))["params"]
    block = params["BottleneckResNetBlock_0"]  # 64 -> 256 channels: a projection
    assert [block[f"Conv_{i}"]["kernel"].shape for i in range(4)] == [
        (1, 1, 64, 64), (3, 3, 64, 64), (1, 1, 64, 256), (1, 1, 64, 256)]
    assert params["Conv_0"]["kernel"].shape == (3, 3, 3, 64)
    assert params["Dense_0"]["kernel"].shape == (2048, 10)


def block_output_sizes(model, shape):
    """The logits' shape and each block's output (H, W), traced, not computed."""
    sizes = []

    def record(next_fun, args, kwargs, context):
        out = next_fun(*args, **kwargs)
        if isinstance(context.module, (resnet.ResNetBlock, resnet.BottleneckResNetBlock)) \
                and context.method_name == "__call__":
            sizes.append(out.shape[1:3])
        return out

    variables = abstract_variables(model, shape)
    with nn.intercept_methods(record):
        logits = jax.eval_shape(functools.partial(model.apply, train=False), variables,
                                jnp.zeros(shape))
    return logits, sizes


@pytest.mark.parametrize("size,stem,first,last", [
    (224, "imagenet", 56, 7),  # torchvision's sizes: conv1 112, max-pool 56, ... 7
    (64, "imagenet", 16, 2),
    (32, "imagenet", 8, 1),
    (32, "cifar", 32, 4),
    (64, "cifar", 64, 8),
])
def test_resnet_output_shapes(size, stem, first, last):
    model = models.create_model(model_config("resnet18", stem=stem), 10, jnp.float32)
    logits, sizes = block_output_sizes(model, (2, size, size, 3))
    assert logits.shape == (2, 10) and logits.dtype == jnp.float32
    assert sizes[0] == (first, first) and sizes[-1] == (last, last)
    assert [s[0] for s in sizes[::2]] == [first, first // 2, first // 4, last]


def test_resnet_auto_stem_is_cifar_up_to_64_pixels():
    config = model_config("resnet18")
    assert config.stem == "auto"  # the default
    for shape, stem in [((32, 32, 3), "cifar"), ((64, 64, 3), "cifar"), ((28, 28, 1), "cifar"),
                        ((65, 65, 3), "imagenet"), ((224, 224, 3), "imagenet"),
                        ((64, 96, 3), "imagenet")]:
        assert models.create_model(config, 10, jnp.float32, shape).stem == stem, shape
        assert resnet.resnet_stem("auto", shape) == stem
    # without the image shape the model decides from its input, by the same rule
    model = models.create_model(config, 10, jnp.float32)
    assert model.stem == "auto"
    for size, kernel in [(64, (3, 3, 3, 64)), (96, (7, 7, 3, 64))]:
        params = abstract_variables(model, (1, size, size, 3))["params"]
        assert params["Conv_0"]["kernel"].shape == kernel
    # an explicit stem wins; configs saved before model.stem existed mean 'auto'
    assert models.create_model(model_config("resnet18", stem="imagenet"), 10, jnp.float32,
                               (32, 32, 3)).stem == "imagenet"
    old = model_config("resnet18").to_dict()
    del old["stem"]
    assert models.create_model(ml_collections.ConfigDict(old), 10, jnp.float32,
                               (32, 32, 3)).stem == "cifar"
    with pytest.raises(ValueError, match=r"model.stem 'big'.*auto, imagenet, cifar"):
        models.create_model(model_config("resnet18", stem="big"), 10, jnp.float32, (32, 32, 3))
    assert models.is_convolutional("resnet50")


def test_resnet_initialisation_and_mixed_precision():
    # a narrow two-stage ResNet: the same code, cheap to initialise for real (an RBG key
    # compiles in a fraction of the time threefry takes on the CPU)
    model = resnet.ResNet(stage_sizes=(1, 1), num_classes=10, stem="cifar", width=4,
                          dtype=jnp.bfloat16)
    x = jnp.zeros((2, 8, 8, 3))
    variables = jax.jit(functools.partial(model.init, train=False))(
        jax.random.key(0, impl="rbg"), x)
    assert all(v.dtype == jnp.float32 for v in jax.tree_util.tree_leaves(variables))
    for block in ("ResNetBlock_0", "ResNetBlock_1"):
        p = variables["params"][block]
        assert not np.any(p["BatchNorm_1"]["scale"])  # the residual branch's last BN: 0
        assert np.all(p["BatchNorm_0"]["scale"] == 1)
        kernel = p["Conv_0"]["kernel"]
        assert np.any(kernel) and float(jnp.abs(kernel).max()) <= 2 / np.sqrt(
            np.prod(kernel.shape[:3])) / 0.8796 + 1e-6  # lecun_normal: cut at 2 std
    assert np.all(variables["params"]["ResNetBlock_1"]["BatchNorm_2"]["scale"] == 1)  # projection
    assert "bias" not in variables["params"]["Conv_0"]  # BN follows every conv
    # bfloat16 compute, float32 logits and statistics (traced, not run)
    logits, updates = jax.eval_shape(
        functools.partial(model.apply, train=True, mutable=["batch_stats"]), variables, x)
    assert logits.shape == (2, 10) and logits.dtype == jnp.float32
    assert all(s.dtype == jnp.float32 for s in jax.tree_util.tree_leaves(updates))
    hlo = jax.jit(functools.partial(model.apply, train=False)).lower(variables, x).as_text()
    assert "bf16" in hlo


def random_variables(model, shape, seed=0):
    """Variables of `model` drawn with numpy (kernels N(0, 1/fan_in), BN at its identity):
    compiling a full-size ResNet's init takes ~10-20 s on these CPUs, this no time."""
    rng = np.random.default_rng(seed)

    def draw(path, leaf):
        name = path[-1].key
        if name == "kernel":
            return rng.normal(0, np.sqrt(1 / np.prod(leaf.shape[:-1])), leaf.shape)
        return np.ones(leaf.shape) if name in ("scale", "var") else np.zeros(leaf.shape)

    variables = abstract_variables(model, shape)
    return jax.tree_util.tree_map_with_path(lambda path, leaf: draw(path, leaf).astype(np.float32),
                                            variables)


def steps_on_one_batch(model, tx, images, labels, mean, std, steps=3):
    """step.train_step `steps` times on the same batch, from random_variables; the losses."""
    from jaxtrain.training import step as step_lib
    from jaxtrain.training import train_state

    variables = random_variables(model, (1, *images.shape[1:]))
    state = jax.jit(lambda v: train_state.TrainState.create(  # one program, not one per leaf
        apply_fn=model.apply, params=v["params"], tx=tx, batch_stats=v["batch_stats"]))(variables)
    step = jax.jit(functools.partial(step_lib.train_step, spec=step_lib.StepSpec(
        mean=mean, std=std, num_classes=10, label_smoothing=0.0)))
    losses = []
    for i in range(steps):
        state, metrics = step(state, images, labels, jax.random.key(i))
        losses.append(float(metrics["loss"]))
    return losses


@pytest.mark.slow
def test_resnet18_trains_on_32px_images(cifar_batches_dir):
    """prepare.setup builds it from a config (stem 'auto' settled by the 32 px input), then
    step.train_step on 8 real images. setup's abstract state skips compiling the init;
    loop.train_and_evaluate runs the same pieces (measured: ~35 s here, most of it that
    init, so it is not repeated in this test)."""
    import optax

    from configs import cifar
    from jaxtrain.training import optim

    config = cifar.get_config()
    config.data.dir = str(cifar_batches_dir)
    config.data.source = "files"
    config.model.name = "resnet18"
    config.train.batch_size = 8
    config.train.precision = "float32"
    run = prepare.setup(config, abstract_state=True)
    assert models.count_params(run.state.params) == 11_173_962  # the cifar stem
    assert run.state.params["Conv_0"]["kernel"].shape == (3, 3, 3, 64)
    assert models.is_convolutional(config.model.name)
    opt = config.optimizer
    opt.schedule, opt.learning_rate = "constant", 0.01
    tx = optim.create_optimizer(opt, optax.constant_schedule(opt.learning_rate))
    losses = steps_on_one_batch(run.model, tx, run.dataset.x_train[:8],
                                run.dataset.y_train[:8], run.mean, run.std)
    assert all(np.isfinite(losses)) and losses[-1] < losses[0], losses


@pytest.mark.slow
def test_resnet18_trains_on_64px_images():
    import optax

    from jaxtrain.training import optim

    model = models.create_model(model_config("resnet18"), 10, jnp.float32, (64, 64, 3))
    assert model.stem == "cifar"  # 'auto', 64 px
    opt = default.get_config().optimizer
    opt.learning_rate, opt.momentum = 0.01, 0.9
    tx = optim.create_optimizer(opt, optax.constant_schedule(opt.learning_rate))
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (4, 64, 64, 3), dtype=np.uint8)
    labels = np.arange(4, dtype=np.int32)
    losses = steps_on_one_batch(model, tx, images, labels, (0.5,) * 3, (0.25,) * 3)
    assert all(np.isfinite(losses)) and losses[-1] < losses[0], losses
