import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from tolerances import ELEMENTWISE, NETWORK_PASS, TRAINING_STEPS

from configs import default
from jaxtrain.training import optim

pytestmark = pytest.mark.usefixtures("compile_quickly")  # conftest.py


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
                               rtol=ELEMENTWISE)


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
    np.testing.assert_allclose(new["w"], [2.0 - 0.1 * 0.5 * 2.0], rtol=ELEMENTWISE)
    coupled = one_update(opt_config(name="adam", learning_rate=0.1, weight_decay=0.5), params, grads)
    # Adam normalises wd*p: a step of lr, but for its float32 bias corrections (3.6e-7)
    np.testing.assert_allclose(coupled["w"], [2.0 - 0.1], rtol=TRAINING_STEPS)


@pytest.mark.parametrize("key,value", [("name", "loin"), ("schedule", "step")])
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


# ---------------------------------------------------------------- Muon and parameter groups

def newton_schulz_reference(g, coeffs, steps, eps=1e-8):
    """Muon's orthogonalisation, written from its description: Frobenius-normalise, work on
    the wide orientation, X <- aX + (bA + cA^2)X with A = XX^T."""
    a, b, c = coeffs
    x = g / (np.linalg.norm(g) + eps)
    wide = x.shape[0] <= x.shape[1]
    x = x if wide else x.T
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x if wide else x.T


def muon_reference(kernel, grads, *, lr, beta, coeffs, steps, weight_decay, renormalize):
    """NumPy Muon on an HWIO kernel seen as a (H*W*C_in) x C_out matrix, with optax's
    momentum (an average with bias correction, Nesterov form), decoupled weight decay
    and the optional renormalisation to norm sqrt(C_out) after each step."""
    p = kernel.astype(np.float64)
    mu = np.zeros_like(p)
    fan_in, fan_out = int(np.prod(p.shape[:-1])), p.shape[-1]
    for t, g in enumerate(grads, start=1):
        mu = beta * mu + (1 - beta) * g
        nesterov = beta * mu / (1 - beta ** (t + 1)) + (1 - beta) * g / (1 - beta ** t)
        update = newton_schulz_reference(nesterov.reshape(fan_in, fan_out), coeffs, steps)
        update = update.reshape(p.shape) * np.sqrt(max(1.0, fan_out / fan_in))
        p = p - lr * (update + weight_decay * p)
        if renormalize:
            p = p * np.sqrt(fan_out) / np.linalg.norm(p)
    return p


def grouped_config(**groups):
    config = opt_config(learning_rate=1.0, momentum=0.9)
    for name, group in groups.items():
        config.groups[name] = group
    return config


def test_three_muon_steps_match_a_numpy_reference():
    rng = np.random.default_rng(0)
    kernel = rng.normal(size=(3, 3, 4, 8)).astype(np.float32)
    grads = [rng.normal(size=kernel.shape).astype(np.float32) for _ in range(3)]
    coeffs = (3.4445, -4.7750, 2.0315)
    config = grouped_config(filters=default.param_group(
        "conv/kernel", name="muon", lr_scale=0.24, momentum=0.6, nesterov=True, ns_steps=3,
        ns_coeffs=coeffs, weight_decay=0.1, renormalize=True))
    tx = optim.create_optimizer(config, optim.create_schedule(config, 10))
    params = {"conv": {"kernel": jnp.asarray(kernel)}}
    state = tx.init(params)
    for g in grads:
        updates, state = tx.update({"conv": {"kernel": jnp.asarray(g)}}, state, params)
        params = optax.apply_updates(params, updates)
    expected = muon_reference(kernel, grads, lr=0.24, beta=0.6, coeffs=coeffs, steps=3,
                              weight_decay=0.1, renormalize=True)
    np.testing.assert_allclose(params["conv"]["kernel"], expected, rtol=NETWORK_PASS,
                               atol=NETWORK_PASS * 0.1)
    assert np.linalg.norm(params["conv"]["kernel"]) == pytest.approx(np.sqrt(8), rel=NETWORK_PASS)
    # and the reference is not trivially satisfied: without renormalisation it differs
    plain = muon_reference(kernel, grads, lr=0.24, beta=0.6, coeffs=coeffs, steps=3,
                           weight_decay=0.1, renormalize=False)
    assert np.abs(plain - expected).max() > 1e-2


def test_muon_treats_a_tall_kernel_as_one_matrix_even_when_it_is_wide():
    # C_out > H*W*C_in: the matrix is transposed for the iteration, and scaled by shape
    rng = np.random.default_rng(1)
    kernel = rng.normal(size=(1, 1, 3, 16)).astype(np.float32)
    grads = [rng.normal(size=kernel.shape).astype(np.float32) for _ in range(3)]
    config = grouped_config(w=default.param_group("w", name="muon", lr_scale=0.1, momentum=0.5,
                                                  nesterov=True, ns_steps=5))
    tx = optim.create_optimizer(config, optim.create_schedule(config, 10))
    params, state = {"w": jnp.asarray(kernel)}, None
    state = tx.init(params)
    for g in grads:
        updates, state = tx.update({"w": jnp.asarray(g)}, state, params)
        params = optax.apply_updates(params, updates)
    expected = muon_reference(kernel, grads, lr=0.1, beta=0.5, coeffs=(3.4445, -4.7750, 2.0315),
                              steps=5, weight_decay=0.0, renormalize=False)
    np.testing.assert_allclose(params["w"], expected, rtol=NETWORK_PASS, atol=NETWORK_PASS * 0.1)


@functools.cache
def speedrun_shapes():
    """cifar_cnn's parameter tree at the narrow speedrun's widths: its paths and shapes,
    traced (jax.eval_shape), with no init program compiled or run."""
    from jaxtrain import models
    model = models.create_model(narrow_speedrun_config().model, 10, jnp.float32)
    images = jax.ShapeDtypeStruct((1, 32, 32, 3), jnp.float32)
    return jax.eval_shape(lambda x: model.init(jax.random.key(0), x, train=False), images)[
        "params"]


def narrow_speedrun_config():
    from configs import cifar_speedrun
    config = cifar_speedrun.get_config()
    config.model.widths = (8, 16, 16)
    return config


def speedrun_params():
    """(the speedrun's config, narrow; cifar_cnn's parameter tree of its layers with random
    values: weights at 1/sqrt(fan-in), vectors N(0, 0.2^2))."""
    rng = np.random.default_rng(0)

    def draw(leaf):
        if len(leaf.shape) > 1:
            return rng.standard_normal(leaf.shape) / np.sqrt(np.prod(leaf.shape[:-1]))
        return 0.2 * rng.standard_normal(leaf.shape)
    params = jax.tree.map(lambda leaf: jnp.asarray(draw(leaf), leaf.dtype), speedrun_shapes())
    return narrow_speedrun_config(), params


def run_steps(config, params, steps, total=10, frozen=("Conv_0/kernel",), seed=0):
    tx = optim.create_optimizer(config.optimizer, optim.create_schedule(config.optimizer, total),
                                frozen)
    state, history = tx.init(params), [params]
    rng = np.random.default_rng(seed)  # NumPy's draws: no random-number program to compile
    update = jax.jit(tx.update)
    for _ in range(steps):
        grads = jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape), p.dtype), params)
        updates, state = update(grads, state, params)
        params = optax.apply_updates(params, updates)
        history.append(params)
    return history


def changed(before, after):
    return {optim.param_path(path) for (path, a), b in zip(
        jax.tree_util.tree_leaves_with_path(before), jax.tree.leaves(after))
        if not np.array_equal(a, b)}


def test_the_speedrun_groups_cover_every_parameter_once():
    config, params = speedrun_params()
    labels = optim.param_labels(config.optimizer, params, ("Conv_0/kernel",))
    by_path = {optim.param_path(p): label for p, label in
               jax.tree_util.tree_leaves_with_path(labels)}
    assert by_path["Conv_0/kernel"] == "frozen" and by_path["Conv_0/bias"] == "stem_bias"
    assert by_path["Dense_0/kernel"] == "head"
    assert by_path["ConvBlock_2/Conv_1/kernel"] == "filters"
    assert by_path["ConvBlock_0/BatchNorm_1/bias"] == "norm_biases"
    assert "default" not in by_path.values()


@pytest.mark.slow  # compiles the optimiser's update (Muon and the groups)
def test_each_group_gets_its_own_learning_rate():
    config, params = speedrun_params()
    config.optimizer.groups.filters.renormalize = False  # a renormalisation is not an lr step
    for name in ("filters", "norm_biases", "stem_bias"):
        config.optimizer.groups[name].lr_scale = 0.0
    before, after = run_steps(config, params, 1)
    assert changed(before, after) == {"Dense_0/kernel"}
    config.optimizer.groups.head.lr_scale = 0.0
    config.optimizer.groups.norm_biases.lr_scale = 1.0
    before, after = run_steps(config, params, 1)
    assert changed(before, after) == {f"ConvBlock_{i}/BatchNorm_{j}/bias"
                                      for i in range(3) for j in range(2)}


@pytest.mark.slow  # compiles the optimiser's update (Muon and the groups)
def test_the_stem_bias_is_trained_for_its_first_steps_only():
    config, params = speedrun_params()
    config.optimizer.groups.stem_bias.train_steps = 2
    history = run_steps(config, params, 4)
    bias = [np.asarray(p["Conv_0"]["bias"]) for p in history]
    assert not np.array_equal(bias[0], bias[1]) and not np.array_equal(bias[1], bias[2])
    np.testing.assert_array_equal(bias[2], bias[3])
    np.testing.assert_array_equal(bias[2], bias[4])
    np.testing.assert_array_equal(history[4]["Conv_0"]["kernel"], params["Conv_0"]["kernel"])
    assert not np.array_equal(history[3]["Dense_0"]["kernel"], history[4]["Dense_0"]["kernel"])
    # its rate decays over its own steps: lr_scale x (1, 1/2) for a linear schedule
    schedule = optim.group_schedule(optim.group_settings(config.optimizer, "stem_bias"),
                                    optim.create_schedule(config.optimizer, 10))
    assert [float(schedule(s)) for s in range(4)] == pytest.approx([106.0, 53.0, 0.0, 0.0])


@pytest.mark.slow  # compiles the optimiser's update (Muon and the groups)
def test_renormalized_filters_keep_norm_sqrt_output_channels():
    config, params = speedrun_params()
    last = run_steps(config, params, 2)[-1]
    for i, width in enumerate((8, 16, 16)):
        for j in range(2):
            kernel = last[f"ConvBlock_{i}"][f"Conv_{j}"]["kernel"]
            assert float(jnp.linalg.norm(kernel)) == pytest.approx(np.sqrt(width),
                                                                   rel=NETWORK_PASS)


@pytest.mark.parametrize("groups,message", [
    ({"fc": default.param_group("Dense_1/kernel")},
     r"groups.fc.params='Dense_1/kernel' matches no parameter \(trainable: .*Dense_0/kernel"),
    ({"a": default.param_group(".*/bias"), "b": default.param_group("Conv_0/.*")},
     "parameter Conv_0/bias is in two optimizer groups: a and b"),
    ({"m": default.param_group(".*bias", name="muon")},
     r"groups.m: muon needs parameters of 2 or more dimensions, not .*Conv_0/bias"),
    ({"r": default.param_group("Conv_0/bias", renormalize=True)}, "renormalize needs"),
    ({"x": default.param_group("(unclosed")}, "groups.x.params='\\(unclosed' is not a regular"),
    ({"x": default.param_group("Conv_0/bias", lr=0.1)}, r"groups.x: unknown key\(s\) lr"),
    ({"x": default.param_group("Conv_0/bias", learning_rate=0.1)}, "unknown key"),
    ({"default": default.param_group("Conv_0/bias")}, "'default' is reserved"),
    ({"x": default.param_group("Conv_0/bias", name="loin")},
     r"groups.x.name='loin': unknown optimiser \(did you mean 'lion'"),
    ({"x": default.param_group("Conv_0/bias", train_steps=-1)}, "train_steps must be >= 0"),
])
def test_bad_groups_are_config_errors_naming_them(groups, message):
    from jaxtrain.errors import ConfigError
    _, params = speedrun_params()
    config = grouped_config(**groups)
    with pytest.raises(ConfigError, match=message):
        optim.check_groups(config, params, ("Conv_0/kernel",))


def test_lookahead_pulls_the_weights_toward_a_slow_copy():
    config = opt_config(learning_rate=0.1, momentum=0.0, lookahead_steps=2, lookahead_alpha=0.5)
    tx = optim.create_optimizer(config, optim.create_schedule(config, 10))
    params, grads = {"w": jnp.array([1.0])}, {"w": jnp.array([1.0])}
    state, values = tx.init(params), []
    for _ in range(4):
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
        values.append(float(params["w"][0]))
    # fast: 0.9, 0.8 -> sync: 1 + 0.5 (0.8 - 1) = 0.9; 0.8, 0.7 -> 0.9 + 0.5 (0.7 - 0.9) = 0.8
    assert values == pytest.approx([0.9, 0.9, 0.8, 0.8])
