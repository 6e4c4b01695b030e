"""model.pool_impl: 'corners' is nn.max_pool's 2x2 pool, forward and gradient, to the bit."""
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tolerances import ELEMENTWISE

from jaxtrain import models
from jaxtrain.config import checks, defaults
from jaxtrain.models.ops import pooling


@pytest.mark.parametrize("shape", [(3, 8, 8, 5), (2, 27, 27, 4), (2, 13, 6, 3), (1, 2, 3, 1)])
def test_corners_is_lax_max_pool_forward_and_gradient_ties_included(shape):
    rng = np.random.default_rng(0)  # numpy's: no random program to compile
    x = np.round(rng.normal(size=shape) * 2).astype(np.float32) / 2  # many windows hold the
    # same maximum more than once; every output's gradient differs:
    incoming = rng.normal(size=(shape[0], shape[1] // 2, shape[2] // 2, shape[3])).astype(
        np.float32)

    def pooled_and_gradient(pool, x):
        pooled, vjp = jax.vjp(pool, x)
        return pooled, vjp(incoming)[0]

    want, got = jax.jit(lambda x: [  # both in one compiled program
        pooled_and_gradient(pool, x) for pool in (
            functools.partial(nn.max_pool, window_shape=(2, 2), strides=(2, 2)),
            pooling.corners_max_pool)])(x)
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
    assert np.any(np.asarray(want[1]) == 0) and np.any(np.asarray(want[1]) != 0)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["seed_cnn", "cifar_cnn"])
def test_the_built_in_cnns_train_to_the_same_numbers_with_either_pool(name):
    config = defaults.get_config().model
    config.name, config.widths, config.stem_width = name, (8, 16, 8), 4
    images = np.random.default_rng(0).normal(size=(4, 32, 32, 3)).astype(np.float32)
    labels = np.eye(10, dtype=np.float32)[np.arange(4) % 10]
    built = {}
    for impl in ("xla", "corners"):
        config.pool_impl = impl
        built[impl] = models.create_model(config, 10, jnp.float32)
    # one compiled init, with an RBG key: op by op, or with threefry, a CNN's init compiles
    # several times slower on a CPU
    variables = jax.jit(functools.partial(built["xla"].init, train=False))(
        jax.random.key(1, impl="rbg"), images)

    def loss(params, model):
        logits, updates = model.apply({**variables, "params": params}, images, train=True,
                                      mutable=["batch_stats"])
        return -jnp.mean(jnp.sum(labels * jax.nn.log_softmax(logits), -1)), updates

    step = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)
    want, got = (step(variables["params"], built[impl]) for impl in ("xla", "corners"))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=ELEMENTWISE, atol=ELEMENTWISE * 0.1)


def test_auto_is_corners_on_the_cpu_and_a_wrong_name_is_one_line():
    assert jax.default_backend() == "cpu" and pooling.resolve("auto") == "corners"
    config = defaults.get_config()
    config.model.name = "cifar_cnn"
    assert models.create_model(config.model, 10, jnp.float32).pool_impl == "corners"
    config.model.pool_impl = "max"
    with pytest.raises(checks.ConfigError, match=r"^config.model.pool_impl='max': must be "
                                                 r"one of auto, xla, corners$"):
        checks.check_config(config)
