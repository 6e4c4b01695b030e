import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from configs import default
from jaxtrain import optim


def opt_config(**overrides):
    config = default.get_config().optimizer
    config.update(overrides)
    return config


def test_constant_and_linear_schedules():
    assert optim.create_schedule(opt_config(learning_rate=0.3), 100)(77) == pytest.approx(0.3)
    linear = optim.create_schedule(opt_config(learning_rate=1.0, schedule="linear",
                                              end_lr_fraction=0.1), 100)
    assert [float(linear(s)) for s in (0, 50, 100)] == pytest.approx([1.0, 0.55, 0.1])


def test_onecycle_warms_up_then_decays():
    schedule = optim.create_schedule(opt_config(
        learning_rate=1.0, schedule="onecycle", warmup_fraction=0.2, start_lr_fraction=0.1,
        end_lr_fraction=0.0), 100)
    assert [float(schedule(s)) for s in (0, 10, 20, 60, 100)] == pytest.approx(
        [0.1, 0.55, 1.0, 0.5, 0.0], abs=1e-6)


def test_warmup_cosine_peaks_after_warmup():
    schedule = optim.create_schedule(opt_config(
        learning_rate=2.0, schedule="warmup_cosine", warmup_fraction=0.1), 100)
    values = [float(schedule(s)) for s in range(101)]
    assert values[0] == 0.0 and values[10] == pytest.approx(2.0)
    assert max(values) == pytest.approx(2.0) and values[100] == pytest.approx(0.0, abs=1e-6)


def one_update(config, params, grads):
    tx = optim.create_optimizer(config, optim.create_schedule(config, 10))
    updates, _ = tx.update(grads, tx.init(params), params)
    return optax.apply_updates(params, updates)


def test_sgd_weight_decay_is_coupled_like_torch():
    params, grads = {"w": jnp.array([1.0, -2.0])}, {"w": jnp.array([0.5, 0.5])}
    new = one_update(opt_config(learning_rate=0.1, momentum=0.9, weight_decay=0.01), params, grads)
    # torch.optim.SGD first step: p - lr * (g + wd * p)
    np.testing.assert_allclose(new["w"], [1.0 - 0.1 * (0.5 + 0.01), -2.0 - 0.1 * (0.5 - 0.02)],
                               rtol=1e-6)


def test_nesterov_differs_from_heavy_ball_after_two_steps():
    params = {"w": jnp.array([1.0])}
    grads = {"w": jnp.array([1.0])}
    results = []
    for nesterov in (False, True):
        config = opt_config(learning_rate=0.1, momentum=0.9, nesterov=nesterov)
        tx = optim.create_optimizer(config, optim.create_schedule(config, 10))
        state, p = tx.init(params), params
        for _ in range(2):
            updates, state = tx.update(grads, state, p)
            p = optax.apply_updates(p, updates)
        results.append(float(p["w"][0]))
    # heavy ball: 1 - 0.1 - 0.19 ; Nesterov: 1 - 0.19 - 0.271
    assert results == pytest.approx([0.71, 0.539])


def test_adamw_decays_weights_without_touching_the_gradient_statistics():
    params, grads = {"w": jnp.array([2.0])}, {"w": jnp.array([0.0])}
    new = one_update(opt_config(name="adamw", learning_rate=0.1, weight_decay=0.5), params, grads)
    np.testing.assert_allclose(new["w"], [2.0 - 0.1 * 0.5 * 2.0], rtol=1e-6)
    coupled = one_update(opt_config(name="adam", learning_rate=0.1, weight_decay=0.5), params, grads)
    np.testing.assert_allclose(coupled["w"], [2.0 - 0.1], rtol=1e-4)  # Adam normalises wd*p


@pytest.mark.parametrize("key,value", [("name", "lion"), ("schedule", "step")])
def test_unknown_names_are_refused(key, value):
    config = opt_config(**{key: value})
    with pytest.raises(ValueError, match=f"optimizer.{key}"):
        optim.create_optimizer(config, optim.create_schedule(config, 10))


def test_frozen_parameters_get_no_step_and_no_decay():
    config = opt_config(learning_rate=0.1, weight_decay=0.5, momentum=0.9)
    tx = optim.create_optimizer(config, optim.create_schedule(config, 10), frozen=("a/kernel",))
    params = {"a": {"kernel": jnp.ones(3), "bias": jnp.ones(3)}, "b": {"kernel": jnp.ones(2)}}
    grads = jax.tree.map(jnp.ones_like, params)
    state = tx.init(params)
    for _ in range(2):
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    np.testing.assert_array_equal(params["a"]["kernel"], 1.0)
    assert (params["a"]["bias"] < 1.0).all() and (params["b"]["kernel"] < 1.0).all()
