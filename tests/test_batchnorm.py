"""model.bn_impl='lean' (jaxtrain/models/ops/batchnorm.py) against Flax's nn.BatchNorm: the same
forward numbers and running averages, gradients within rounding, the same variables,
and no float32 activation-sized tensor kept for a bfloat16 backward pass."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from tolerances import (BFLOAT16, BFLOAT16_PASS, BFLOAT16_STEPS, ELEMENTWISE, NETWORK_PASS,
                        TRAINING_STEPS, assert_close, rounding)

from jaxtrain import models
from jaxtrain.config import checks, defaults
from jaxtrain.models.ops import batchnorm

pytestmark = pytest.mark.usefixtures("compile_quickly")  # conftest.py


KEY = jax.random.key(0)
FLAVOURS = [dict(), dict(use_scale=False), dict(use_bias=False)]


def features(shape, dtype):
    """Conv-like activations with a channel-dependent offset and spread (E[x^2] - mean^2
    loses digits to the offset, as Flax's fast variance does in both)."""
    k1, k2, k3 = jax.random.split(jax.random.key(1), 3)
    offset = jax.random.normal(k1, shape[-1:]) * 2
    spread = jnp.exp(jax.random.normal(k2, shape[-1:]))
    return (jax.random.normal(k3, shape) * spread + offset).astype(dtype)


def perturbed(variables):
    """Variables away from their init (scale 1, bias 0, statistics 0 and 1), so that each
    one's use shows."""
    leaves, tree = jax.tree.flatten(variables)
    keys = jax.random.split(jax.random.key(2), len(leaves))
    return jax.tree.unflatten(tree, [leaf + jax.random.uniform(k, leaf.shape, minval=0.1)
                                     for leaf, k in zip(leaves, keys)])


def loss_and_grads(module, variables, x, running, quadratic=0.1):
    """A loss that weighs every output element differently, its updated statistics and
    its gradients with respect to the params and x."""
    # bfloat16 values: the incoming gradient is the same in bfloat16 and float32
    weights = jax.random.normal(jax.random.key(3), x.shape).astype(jnp.bfloat16).astype(
        jnp.float32)

    def loss(params, x):
        y, updates = module.apply({"params": params, "batch_stats": variables["batch_stats"]},
                                  x, use_running_average=running, mutable=["batch_stats"])
        y = y.astype(jnp.float32)
        return jnp.sum(y * weights + quadratic * y ** 2), (y, updates["batch_stats"])

    (value, (y, stats)), grads = jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))(
        variables["params"], x)
    return y, stats, grads


@pytest.mark.parametrize("running", [False, True], ids=["batch", "running"])
@pytest.mark.parametrize("flavour", FLAVOURS, ids=["scale_bias", "no_scale", "no_bias"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_forward_statistics_and_gradients_match_flax(dtype, flavour, running):
    x = features((16, 6, 6, 8), dtype)
    options = dict(momentum=0.6, epsilon=1e-5, dtype=dtype, **flavour)
    flax_bn, lean_bn = nn.BatchNorm(**options), batchnorm.BatchNorm(**options)
    variables = perturbed(flax_bn.init(KEY, x, use_running_average=False))
    assert jax.tree.map(jnp.shape, lean_bn.init(KEY, x, use_running_average=False)) == \
        jax.tree.map(jnp.shape, variables)
    y_flax, stats_flax, (dparams_flax, dx_flax) = loss_and_grads(flax_bn, variables, x, running)
    y_lean, stats_lean, (dparams_lean, dx_lean) = loss_and_grads(lean_bn, variables, x, running)
    # Flax's arithmetic in Flax's order: the same numbers (up to XLA's fusion choices)
    np.testing.assert_allclose(y_lean, y_flax, rtol=ELEMENTWISE, atol=ELEMENTWISE)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=ELEMENTWISE,
                                                         atol=ELEMENTWISE * 0.1),
                 stats_lean, stats_flax)
    moved = not np.allclose(stats_lean["mean"], variables["batch_stats"]["mean"])
    assert moved != running  # by momentum 0.6 from the batch's statistics, else not at all
    # scale's and bias's gradients are float32 sums in both (of 576 terms: 8 to 4,000 here)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=NETWORK_PASS,
                                                         atol=NETWORK_PASS * 100),
                 dparams_lean, dparams_flax)
    assert dx_lean.dtype == dx_flax.dtype == dtype
    dx_flax, dx_lean = (np.asarray(g, np.float32) for g in (dx_flax, dx_lean))
    if dtype == jnp.float32:
        assert_close(dx_lean, dx_flax, NETWORK_PASS, floor=NETWORK_PASS)
    else:
        # within bfloat16 rounding of Flax's: both round float32 arithmetic to bfloat16
        # (Flax rounds its two paths into x separately, then adds them)
        assert_close(dx_lean, dx_flax, BFLOAT16_PASS, floor=BFLOAT16_PASS)


@pytest.mark.slow
@pytest.mark.parametrize("use_scale", [True, False])
def test_bfloat16_input_gradient_is_as_close_to_float32_as_flaxs(use_scale):
    """Against the float32 gradient at the same (bfloat16-valued) input and the same
    incoming gradient (a linear loss): the lean one, rounded once, is at least as close
    as Flax's bfloat16 one."""
    x = features((32, 8, 8, 16), jnp.bfloat16)
    errors = {}
    exact = None
    for name, cls, dtype in (("exact", nn.BatchNorm, jnp.float32),
                             ("flax", nn.BatchNorm, jnp.bfloat16),
                             ("lean", batchnorm.BatchNorm, jnp.bfloat16)):
        module = cls(use_scale=use_scale, dtype=dtype)
        variables = perturbed(module.init(KEY, x, use_running_average=False))
        dx = np.asarray(loss_and_grads(module, variables, x.astype(dtype), False,
                                       quadratic=0.0)[2][1], np.float32)
        if exact is None:
            exact = dx
        errors[name] = np.abs(dx - exact) / np.abs(exact).max()
    # one rounding to bfloat16 (8 significant bits): at most 2^-8 of the largest element
    assert errors["lean"].max() <= rounding(BFLOAT16, 1)
    assert errors["lean"].max() <= errors["flax"].max() * 1.01
    assert errors["lean"].mean() <= errors["flax"].mean() * 1.01


def reference_batch_normalize(x, scale, bias, epsilon):
    """Flax's computation in plain jnp (what autodiff differentiates for nn.BatchNorm)."""
    x32 = x.astype(jnp.float32)
    mean = x32.mean((0, 1, 2))
    var = jnp.maximum(0.0, jnp.square(x32).mean((0, 1, 2)) - jnp.square(mean))
    y = (x32 - mean) * (jax.lax.rsqrt(var + epsilon) * scale) + bias
    return y, mean, var


@pytest.mark.slow
def test_the_custom_vjps_are_the_gradients_of_every_output():
    """Cotangents on the batch statistics and on the running statistics too (zero in
    training, where only the loss is differentiated, but part of a correct VJP)."""
    x = features((8, 5, 5, 6), jnp.float32)
    scale, bias = jnp.linspace(0.5, 2.0, 6), jnp.linspace(-1.0, 1.0, 6)
    cotangents = tuple(jax.random.normal(jax.random.fold_in(KEY, i), shape) for i, shape in
                       enumerate((x.shape, (6,), (6,))))

    @jax.jit
    def vjps(x, scale, bias, cotangents):
        lean = jax.vjp(lambda *a: batchnorm.batch_normalize(*a, 1e-5, jnp.float32), x, scale,
                       bias)[1](cotangents)
        return lean, jax.vjp(lambda *a: reference_batch_normalize(*a, 1e-5), x, scale,
                             bias)[1](cotangents)

    lean, want = vjps(x, scale, bias, cotangents)
    for got, expected in zip(lean, want):
        np.testing.assert_allclose(got, expected, rtol=NETWORK_PASS, atol=NETWORK_PASS)
    # Nearly constant channels: E[x^2] - mean^2 rounds to below 0 in some (clipped: no
    # gradient through the variance, as jnp.maximum's) and above 0 in others
    x = 300.0 + 1e-3 * jax.random.normal(jax.random.key(5), x.shape)
    unclipped = jax.jit(batchnorm._statistics)(x)[2]
    assert (unclipped < 0).any() and (unclipped > 0).any()
    lean, want = vjps(x, scale, bias, cotangents)
    for got, expected in zip(lean, want):  # E[x^2] - mean^2 cancels: more rounding shows
        assert_close(got, expected, TRAINING_STEPS, floor=TRAINING_STEPS)

    mean, var = jnp.linspace(-1.0, 1.0, 6), jnp.linspace(0.5, 3.0, 6)

    def plain(x, mean, var, scale, bias):
        return (x - mean) * (jax.lax.rsqrt(var + 1e-5) * scale) + bias

    @jax.jit
    def running_vjps(args, cotangent):
        lean = jax.vjp(lambda *a: batchnorm.running_normalize(*a, 1e-5, jnp.float32), *args)[1]
        return lean(cotangent), jax.vjp(plain, *args)[1](cotangent)

    lean, want = running_vjps((x, mean, var, scale, bias), cotangents[0])
    for got, expected in zip(lean, want):
        np.testing.assert_allclose(got, expected, rtol=NETWORK_PASS, atol=NETWORK_PASS)


def cifar_config(bn_impl, **model):
    config = defaults.get_config()
    config.model.update({"name": "cifar_cnn", "widths": (8, 16, 16), "stem_width": 8,
                         "bn_impl": bn_impl, "pool_impl": "xla", "conv_impl": "xla", **model})
    return config


def float32_activation_residuals(bn_impl, batch=8):
    """(count, bytes) of the float32 tensors with the batch's leading dimension that a
    bfloat16 cifar_cnn loss's VJP keeps for the backward pass: jax.vjp's residuals (the
    jaxpr's, before any backend's compiler), traced for their shapes only."""
    model = models.create_model(cifar_config(bn_impl).model, 10, jnp.bfloat16)
    images = jax.ShapeDtypeStruct((batch, 32, 32, 3), jnp.float32)

    def residuals(images):
        variables = model.init(KEY, images, train=False)

        def loss(params):
            logits, _ = model.apply({"params": params, "batch_stats": variables["batch_stats"]},
                                    images, train=True, mutable=["batch_stats"])
            return optax.softmax_cross_entropy_with_integer_labels(
                logits, jnp.arange(batch) % 10).mean()

        return jax.tree.leaves(jax.vjp(loss, variables["params"])[1])

    kept = [leaf for leaf in jax.eval_shape(residuals, images) if leaf.dtype == jnp.float32
            and len(leaf.shape) == 4 and leaf.shape[0] == batch]
    return len(kept), sum(leaf.size * 4 for leaf in kept)


def test_lean_keeps_no_float32_activations_for_a_bfloat16_backward_pass():
    count, nbytes = float32_activation_residuals("flax")
    # Flax's: x - mean and the normalised x, for each of the 6 BatchNorms
    assert count == 12
    batch_elements = 8 * (15 * 15 * 8 + 7 * 7 * 16 + 3 * 3 * 16)  # each block's BN input
    assert nbytes == 2 * 2 * 4 * batch_elements
    assert float32_activation_residuals("lean") == (0, 0)


@pytest.mark.parametrize("name", ["cifar_cnn", "seed_cnn", "mlp", "resnet18"])
def test_variables_are_the_same_for_both(name):
    """The same names, shapes and dtypes: checkpoints and model.init_from weights load
    into either (the step test below runs Flax's variables through both)."""
    images = jax.ShapeDtypeStruct((2, 32, 32, 3), jnp.float32)
    built = {}
    for bn_impl in batchnorm.BN_IMPLS:
        config = cifar_config(bn_impl, batch_norm=True)
        config.model.name = name
        model = models.create_model(config.model, 10, jnp.bfloat16, image_shape=(32, 32, 3))
        called = set()

        def record(call, args, kwargs, context):
            called.add(type(context.module))
            return call(*args, **kwargs)

        with nn.intercept_methods(record):
            built[bn_impl] = jax.eval_shape(lambda x: model.init(KEY, x, train=False), images)
        assert batchnorm.module(bn_impl) in called  # the option took effect
        assert {nn.BatchNorm, batchnorm.BatchNorm} - called == {batchnorm.module("lean" if
                                                                bn_impl == "flax" else "flax")}
    assert built["lean"] == built["flax"]  # the same tree of ShapeDtypeStructs


def made_up_variables(model, images):
    """Variables of model.init's shapes, drawn with NumPy (no init program to compile):
    weights at 1/sqrt(fan-in), statistics away from 0 and 1 as a trained model's are."""
    shapes = jax.eval_shape(lambda x: model.init(KEY, x, train=False), images)
    rng = np.random.default_rng(4)

    def draw(path, leaf):
        if len(leaf.shape) > 1:
            return rng.standard_normal(leaf.shape) / np.sqrt(np.prod(leaf.shape[:-1]))
        if "'var'" in jax.tree_util.keystr(path):
            return rng.uniform(0.5, 2.0, leaf.shape)
        return 0.2 * rng.standard_normal(leaf.shape)

    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: jnp.asarray(draw(path, leaf), leaf.dtype), shapes)


def global_norm(tree):
    return np.sqrt(sum(np.sum(np.square(leaf, dtype=np.float64))
                       for leaf in jax.tree.leaves(tree)))


@pytest.mark.slow
@pytest.mark.parametrize("dtype,frozen", [(jnp.float32, False), (jnp.bfloat16, False),
                                          (jnp.bfloat16, True)],
                         ids=["f32", "bf16", "bf16-freeze_batch_stats"])
def test_a_cifar_cnn_step_matches_flaxs(cifar_subset, dtype, frozen):
    """Real images through a one-block cifar_cnn with the speedrun's block options, from
    the same (Flax's) variables: the same logits and statistics; the same gradients in
    float32, and in bfloat16 within a sixteenth in norm (they differ by 1% here, and each
    by 13% from the float32 gradient: bfloat16's own error is the larger). Frozen
    statistics: the running-average path, which evaluation (train=False) takes too."""
    images = jnp.asarray(cifar_subset["x_train"][:32], jnp.float32) / 255 - 0.5
    labels = jnp.asarray(cifar_subset["y_train"][:32])
    results, variables = {}, None
    for bn_impl in ("flax", "lean"):
        config = cifar_config(bn_impl, widths=(16,), activation="gelu", bn_epsilon=1e-12,
                              bn_momentum=0.4, freeze_batch_stats=frozen)
        model = models.create_model(config.model, 10, dtype)
        if variables is None:  # Flax's, for both: what loading a checkpoint does
            variables = made_up_variables(model, images[:2])

        def loss(params):
            logits, updates = model.apply({"params": params,
                                           "batch_stats": variables["batch_stats"]},
                                          images, train=True, mutable=["batch_stats"])
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
            return loss, (logits, updates["batch_stats"])

        (_, results[bn_impl]), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(
            variables["params"])
        results[bn_impl] = jax.tree.map(np.asarray, results[bn_impl] + (grads,))
    (logits, stats, grads), (want_logits, want_stats, want_grads) = \
        results["lean"], results["flax"]
    np.testing.assert_allclose(logits, want_logits, rtol=NETWORK_PASS, atol=NETWORK_PASS * 0.1)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=NETWORK_PASS,
                                                         atol=NETWORK_PASS * 0.1),
                 stats, want_stats)
    if frozen:
        assert all(jax.tree.leaves(jax.tree.map(np.array_equal, stats,
                                                variables["batch_stats"])))
    difference = global_norm(jax.tree.map(np.subtract, grads, want_grads))
    assert difference <= (NETWORK_PASS if dtype == jnp.float32 else BFLOAT16_STEPS) * \
        global_norm(want_grads)


def test_the_option_is_checked_in_one_line():
    config = defaults.get_config()
    assert config.model.bn_impl == "flax"
    config.model.bn_impl = "fast"
    with pytest.raises(checks.ConfigError, match=r"^config.model.bn_impl='fast': must be one "
                                                 r"of flax, lean$"):
        checks.check_config(config)
    config.model.update(bn_impl="lean", name="vit_tiny")
    with pytest.raises(checks.ConfigError, match=r"^config.model.bn_impl='lean': applies to "
                                                 r"seed_cnn, cifar_cnn, mlp, resnet18"):
        checks.check_config(config)
