"""jaxtrain/models/ops/onednn.py: float32 2-D convolutions through oneDNN compute lax's function,
forward and both gradients, for every geometry the built-in models use and every
built-in convolutional model; what it does not cover stays lax's; it batches under vmap
(replicas); an explicit 'onednn' that cannot be built is one line, exit 2, nothing written."""
import functools
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from conftest import missing, normal
from tolerances import NETWORK_PASS
import fork_server

from jaxtrain import models
from jaxtrain.config import checks, defaults
from jaxtrain.models.ops import onednn

REPO = Path(__file__).resolve().parents[1]

if not onednn.available()[0]:
    missing(f"oneDNN's convolutions are unavailable: {onednn.available()[1]} "
            f"(pip install -e '.[cpu]', and g++)")


def relative_error(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30)


def value_and_grads(conv_fn, x, kernel, strides, padding, dilation):
    def loss(x, kernel):
        y = conv_fn(x, kernel, strides, padding, rhs_dilation=dilation,
                    dimension_numbers=onednn.NHWC)
        return jnp.sum(jnp.tanh(y) * jnp.arange(y.shape[-1], dtype=y.dtype)), y
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(x, kernel)


# (x shape, kernel shape, strides, padding, kernel dilation): the stems and blocks of
# cifar_cnn, seed_cnn, the ResNets (both stems, strided 3x3 and 1x1 shortcuts) and the
# ViT's patch conv, and an uneven explicit padding
GEOMETRIES = [
    ((4, 28, 28, 1), (2, 2, 1, 8), (1, 1), "VALID", (1, 1)),
    ((4, 27, 27, 8), (3, 3, 8, 16), (1, 1), "SAME", (1, 1)),
    ((3, 32, 32, 3), (5, 5, 3, 6), (1, 1), "VALID", (1, 1)),
    ((2, 32, 32, 3), (7, 7, 3, 16), (2, 2), ((3, 3), (3, 3)), (1, 1)),
    ((2, 16, 16, 8), (3, 3, 8, 16), (2, 2), ((1, 1), (1, 1)), (1, 1)),
    ((2, 16, 16, 8), (1, 1, 8, 16), (2, 2), ((0, 0), (0, 0)), (1, 1)),
    ((2, 32, 32, 3), (16, 16, 3, 24), (16, 16), "VALID", (1, 1)),
    ((2, 10, 11, 5), (3, 3, 5, 6), (1, 1), ((1, 2), (0, 1)), (1, 1)),
    ((2, 9, 9, 4), (3, 3, 4, 4), (1, 1), "SAME", (2, 2)),
    # big enough (>= 8M multiply-adds) to be split over XLA's two threads, unevenly
    ((7, 32, 32, 16), (3, 3, 16, 32), (1, 1), "SAME", (1, 1)),
    ((5, 33, 33, 16), (3, 3, 16, 32), (2, 2), ((1, 1), (1, 1)), (1, 1)),
]


@pytest.mark.parametrize("x_shape,kernel_shape,strides,padding,dilation", GEOMETRIES)
def test_forward_and_both_gradients_are_lax_s(x_shape, kernel_shape, strides, padding,
                                              dilation):
    seed = sum(x_shape) + sum(kernel_shape)
    x = normal(x_shape, seed)
    kernel = normal(kernel_shape, seed + 1) / np.sqrt(np.prod(kernel_shape[:3]))
    (want_loss, want_y), want_grads = value_and_grads(lax.conv_general_dilated, x, kernel,
                                                      strides, padding, dilation)
    (got_loss, got_y), got_grads = value_and_grads(onednn.conv_general_dilated, x, kernel,
                                                   strides, padding, dilation)
    assert got_y.shape == want_y.shape
    assert relative_error(got_y, want_y) < NETWORK_PASS
    assert relative_error(got_loss, want_loss) < NETWORK_PASS
    for got, want in zip(got_grads, want_grads):
        assert relative_error(got, want) < NETWORK_PASS
    # and it is oneDNN that computed them: three custom calls in the program
    text = jax.jit(jax.value_and_grad(lambda x, k: jnp.sum(onednn.conv_general_dilated(
        x, k, strides, padding, rhs_dilation=dilation, dimension_numbers=onednn.NHWC)),
        argnums=(0, 1))).lower(x, kernel).as_text()
    assert all(f"{onednn.FFI_PREFIX}{kind}" in text for kind in onednn.TARGETS)


@pytest.mark.parametrize("case", ["bfloat16", "grouped", "input_dilation", "nchw"])
def test_what_onednn_does_not_cover_is_lax_s_own(case):
    x = normal((2, 8, 8, 4), 0)
    kernel = normal((3, 3, 4, 4), 1)
    kwargs, padding = dict(dimension_numbers=onednn.NHWC), "SAME"
    if case == "bfloat16":
        x, kernel = x.astype(jnp.bfloat16), kernel.astype(jnp.bfloat16)
    elif case == "grouped":
        kernel, kwargs["feature_group_count"] = kernel[:, :, :2], 2
    elif case == "input_dilation":
        kwargs["lhs_dilation"], padding = (2, 2), ((1, 1), (1, 1))
    else:
        x, kwargs["dimension_numbers"] = x.transpose(0, 3, 1, 2), ("NCHW", "HWIO", "NCHW")

    def conv(fn):
        return jax.jit(lambda x, k: fn(x, k, (1, 1), padding, **kwargs))
    text = conv(onednn.conv_general_dilated).lower(x, kernel).as_text()
    assert onednn.FFI_PREFIX not in text
    np.testing.assert_array_equal(conv(onednn.conv_general_dilated)(x, kernel),
                                  conv(lax.conv_general_dilated)(x, kernel))


def test_vmap_runs_one_convolution_per_replica():
    x = normal((3, 2, 9, 9, 4), 0)
    kernels = normal((3, 3, 3, 4, 5), 1)

    def loss(x, kernel):
        return jnp.sum(onednn.conv_general_dilated(x, kernel, (1, 1), "SAME",
                                                   dimension_numbers=onednn.NHWC) ** 2)
    grads = jax.jit(jax.vmap(jax.grad(loss, argnums=1)))(x, kernels)
    wants = jax.jit(lambda x, kernels: [  # lax's, replica by replica, in one program
        jax.grad(lambda k: jnp.sum(lax.conv_general_dilated(
            x[i], k, (1, 1), "SAME", dimension_numbers=onednn.NHWC) ** 2))(kernels[i])
        for i in range(3)])(x, kernels)
    for i in range(3):
        assert relative_error(grads[i], wants[i]) < NETWORK_PASS


CONV_MODELS = [
    # (model.names, overrides, image shape)
    (("seed_cnn",), {"batch_norm": True}, (32, 32, 3)),
    (("cifar_cnn",), {"widths": (8, 16, 8), "stem_width": 4}, (28, 28, 1)),
    # the CIFAR stem; basic blocks, one a stage (see below): there ResNet-34 is ResNet-18
    (("resnet18", "resnet34"), {}, (32, 32, 3)),
    (("resnet50",), {}, (64, 64, 3)),     # the ImageNet stem (7x7 stride 2, max-pool), bottlenecks
    (("vit_tiny",), {}, (32, 32, 3)),     # the patch conv (one block of twelve: see below)
]


@pytest.mark.slow
@pytest.mark.parametrize("names,overrides,image_shape", CONV_MODELS,
                         ids=["+".join(case[0]) for case in CONV_MODELS])
def test_every_built_in_conv_model_computes_the_same_loss_and_gradients(names, overrides,
                                                                        image_shape):
    config = defaults.get_config().model
    for key, value in overrides.items():
        config[key] = value
    built = {}
    for name in names:
        config.name = name
        for impl in ("xla", "onednn"):
            config.conv_impl = impl
            model = models.create_model(config, 10, jnp.float32, image_shape)
            assert model.conv_impl == impl
            if name.startswith("vit"):  # its only conv is in front; one block compiles 12x faster
                model = model.clone(depth=1)
            if name.startswith("resnet"):  # its stem and blocks, one block a stage (2-4x faster)
                model = model.clone(stage_sizes=(1, 1, 1, 1))
            assert built.setdefault(impl, model) == model, name  # ResNet-34's is ResNet-18's
    # 8 images: over 2, BatchNorm after a dense layer normalises each feature's two values
    # to +-1, dividing by their difference, which magnifies any rounding (8.8e-5 of the
    # loss between oneDNN's AVX2 kernels and XLA's; 0 over 8)
    images = normal((8, *image_shape), 0)
    labels = np.eye(10, dtype=np.float32)[np.arange(8) % 10]
    # the model's own init (a residual branch's last BatchNorm starts at scale 0), compiled
    # as one program with an RBG key: op by op, or with threefry, it compiles several times
    # slower on a CPU
    variables = jax.jit(functools.partial(built["xla"].init, train=False))(
        jax.random.key(1, impl="rbg"), images)

    def loss(params, model):
        logits, _ = model.apply({**variables, "params": params}, images, train=True,
                                mutable=["batch_stats"], rngs={"dropout": jax.random.key(2)})
        return -jnp.mean(jnp.sum(labels * jax.nn.log_softmax(logits), -1))

    step = jax.jit(jax.value_and_grad(loss), static_argnums=1)
    (want_loss, want), (got_loss, got) = (step(variables["params"], built[impl])
                                          for impl in ("xla", "onednn"))
    assert abs(float(got_loss) - float(want_loss)) <= NETWORK_PASS * abs(float(want_loss))
    # each gradient within NETWORK_PASS of its own size; one that is zero in exact arithmetic
    # (a conv's bias before BatchNorm) within NETWORK_PASS of the largest gradient. (Compared
    # in numpy: an eager jnp op compiles once per leaf shape.)
    want, got = jax.device_get((want, got))
    largest = max(float(np.max(np.abs(leaf))) for leaf in jax.tree.leaves(want))
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        scale = float(np.max(np.abs(b)))
        scale = scale if scale > 1e-3 * largest else largest
        assert float(np.max(np.abs(a - b))) <= NETWORK_PASS * scale, jax.tree_util.keystr(path)


def test_auto_is_onednn_on_one_cpu_device_and_a_wrong_name_is_one_line():
    assert jax.default_backend() == "cpu" and jax.device_count() == 1
    assert onednn.resolve("auto") == "onednn" and onednn.resolve("xla") == "xla"
    config = defaults.get_config()
    config.model.name = "cifar_cnn"
    assert models.create_model(config.model, 10, jnp.float32).conv_impl == "onednn"
    config.model.name = "mlp"
    assert models.create_model(config.model, 10, jnp.float32).__class__.__name__ == "MLP"
    config.model.conv_impl = "mkl"
    with pytest.raises(checks.ConfigError, match=r"^config.model.conv_impl='mkl': must be "
                                                 r"one of auto, xla, onednn$"):
        checks.check_config(config)


def without_a_compiler(tmp_path):
    """An environment where the library was never built and cannot be: a fresh HOME (no
    built copy) and a compiler that fails."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    env.update(HOME=str(tmp_path / "home"), CXX="false")
    return env


@pytest.mark.slow
def test_without_onednn_auto_says_so_once_and_uses_xla(tmp_path):
    script = ("from jaxtrain.models.ops import onednn\n"
              "print(onednn.resolve('auto'), onednn.resolve('auto'))\n")
    done = fork_server.run([sys.executable, "-c", script], cwd=REPO, capture_output=True,
                           text=True, env=without_a_compiler(tmp_path), timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["xla", "xla"]
    lines = [line for line in done.stderr.splitlines() if "conv_impl" in line]
    assert len(lines) == 1 and "XLA's convolutions" in lines[0]
    assert "building onednn_conv.cc failed" in lines[0]


@pytest.mark.slow
def test_an_explicit_onednn_that_cannot_be_built_is_one_line_exit_2(tmp_path):
    workdir = tmp_path / "run"
    done = fork_server.run(
        [sys.executable, "main.py", "--config=configs/fashion_mnist_cnn.py",
         f"--workdir={workdir}", "--config.model.conv_impl=onednn",
         "--config.train.num_steps=2"],
        cwd=REPO, capture_output=True, text=True, env=without_a_compiler(tmp_path),
        timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: config.model.conv_impl='onednn': building onednn_conv.cc "
                           "failed"), done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert not workdir.exists() or not any(workdir.iterdir())


@pytest.mark.slow
def test_several_devices_keep_xla_s_and_an_explicit_onednn_there_is_one_line(tmp_path):
    script = ("from jaxtrain.models.ops import onednn\n"
              "print(onednn.resolve('auto'))\n"
              "try:\n"
              "    onednn.resolve('onednn')\n"
              "except onednn.ConfigError as error:\n"
              "    print(error)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    done = fork_server.run([sys.executable, "-c", script], cwd=REPO, capture_output=True,
                           text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == [
        "xla", "config.model.conv_impl='onednn' runs on one device; this run has 2 "
               "(use 'auto' or 'xla')"]


def test_convolutional_models_through_onednn_scan_on_the_cpu_and_xla_s_step_by_step():
    from jaxtrain.training import chunks
    config = defaults.get_config().model
    for name, conv_impl, kind in [("cifar_cnn", "auto", "scan"), ("seed_cnn", "onednn", "scan"),
                                  ("resnet18", "xla", "python"), ("mlp", "auto", "scan"),
                                  ("mlp", "xla", "scan")]:
        config.name, config.conv_impl = name, conv_impl
        xla_convolutions = models.xla_convolutions(name, models.conv_choice(config))
        assert chunks.resolve_loop("auto", xla_convolutions) == kind, name
        assert chunks.resolve_loop("python", xla_convolutions) == "python"
