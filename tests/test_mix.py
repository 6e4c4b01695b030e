"""MixUp and CutMix (augment.mix_batch): a NumPy reference from the same random draws,
CutMix's corrected weight, runs that do not mix left bitwise alone, exact resume."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from overrides import with_overrides
from tolerances import ELEMENTWISE

from configs import cifar_seed_cnn, default
from jaxtrain import ConfigError, models
from jaxtrain.baselines import runner
from jaxtrain.config import checks, defaults
from jaxtrain.run import loop
from jaxtrain.training import augment, train_state
from jaxtrain.training import step as step_lib

pytestmark = pytest.mark.usefixtures("compile_quickly")  # conftest.py


B, H, W, C, K = 8, 7, 6, 3, 10  # labels 0..7: partners (i, B-1-i) differ
KEYS = tuple(range(12))


def batch(label_smoothing=0.1):
    """Random normalised-looking floats (no two pixels equal) and smoothed one-hot targets."""
    rng = np.random.default_rng(0)
    images = rng.normal(size=(B, H, W, C)).astype(np.float32)
    labels = np.arange(B)
    targets = optax.smooth_labels(jax.nn.one_hot(labels, K), label_smoothing)
    return images, np.asarray(targets), labels


def reference_mix(images, targets, key, *, mixup=0.0, cutmix=0.0, mix_prob=1.0,
                  switch_prob=0.5):
    """timm's Mixup (mode='batch') in NumPy, from mix_batch's own draws of `key`;
    also returns (mode, Beta draw, corrected lam)."""
    gate_key, switch_key, lam_key, box_key = jax.random.split(key, 4)
    if not float(jax.random.uniform(gate_key)) < mix_prob:
        return images, targets, ("none", None, 1.0)
    if mixup and cutmix:
        use_cutmix = float(jax.random.uniform(switch_key)) < switch_prob
    else:
        use_cutmix = bool(cutmix)
    alpha = cutmix if use_cutmix else mixup
    drawn = lam = float(jax.random.beta(lam_key, alpha, alpha))
    partner = images[::-1]
    if use_cutmix:
        cy, cx = (int(v) for v in jax.random.randint(box_key, (2,), 0, jnp.array([H, W])))
        ratio = np.sqrt(1 - lam)
        cut_h, cut_w = int(H * ratio), int(W * ratio)
        top, bottom = np.clip(cy - cut_h // 2, 0, H), np.clip(cy + (cut_h + 1) // 2, 0, H)
        left, right = np.clip(cx - cut_w // 2, 0, W), np.clip(cx + (cut_w + 1) // 2, 0, W)
        mixed = images.copy()
        mixed[:, top:bottom, left:right] = partner[:, top:bottom, left:right]
        lam = 1 - (bottom - top) * (right - left) / (H * W)
    else:
        mixed = lam * images + (1 - lam) * partner
    return mixed, lam * targets + (1 - lam) * targets[::-1], (
        "cutmix" if use_cutmix else "mixup", drawn, lam)


@pytest.mark.slow
@pytest.mark.parametrize("settings, modes", [
    (dict(mixup=0.8), {"mixup"}),
    (dict(cutmix=1.0), {"cutmix"}),
    (dict(mixup=0.8, cutmix=1.0, switch_prob=0.0), {"mixup"}),
    (dict(mixup=0.8, cutmix=1.0, switch_prob=1.0), {"cutmix"}),
    (dict(mixup=0.8, cutmix=1.0), {"mixup", "cutmix"}),
    (dict(mixup=0.8, cutmix=1.0, mix_prob=0.5), {"none", "mixup", "cutmix"}),
    (dict(mixup=0.8, cutmix=1.0, mix_prob=0.0), {"none"}),
])
def test_mix_batch_equals_a_numpy_reference_of_the_same_draws(settings, modes):
    images, targets, _ = batch()
    mix = jax.jit(functools.partial(augment.mix_batch, **settings))
    seen, clipped = set(), False
    for seed in KEYS:
        key = jax.random.key(seed)
        got_images, got_targets = jax.device_get(mix(images, targets, key))
        want_images, want_targets, (mode, drawn, lam) = reference_mix(images, targets, key,
                                                                      **settings)
        seen.add(mode)
        if mode == "mixup":
            np.testing.assert_allclose(got_images, want_images, rtol=ELEMENTWISE,
                                       atol=ELEMENTWISE)
        else:  # pasted or untouched pixels: the very floats
            np.testing.assert_array_equal(got_images, want_images)
        np.testing.assert_allclose(got_targets, want_targets, rtol=ELEMENTWISE,
                                   atol=ELEMENTWISE * 0.1)
        np.testing.assert_allclose(got_targets.sum(-1), 1.0, rtol=ELEMENTWISE)
        clipped |= mode == "cutmix" and abs(lam - (1 - int(H * np.sqrt(1 - drawn))
                                                   * int(W * np.sqrt(1 - drawn)) / (H * W))) > 1e-9
    assert seen == modes
    assert clipped or "cutmix" not in modes  # the box met the border: lam was corrected


def test_cutmix_lambda_is_the_uncovered_share_of_each_image():
    images, targets, labels = batch(label_smoothing=0.0)
    for seed in KEYS:
        mixed, mixed_targets = jax.device_get(
            augment.mix_batch(images, targets, jax.random.key(seed), cutmix=1.0))
        covered = np.all(mixed == images[::-1], axis=-1).mean(axis=(1, 2))  # (B,)
        kept = np.all(mixed == images, axis=-1).mean(axis=(1, 2))
        np.testing.assert_allclose(kept + covered, 1.0)  # each pixel its own or its partner's
        lam = mixed_targets[np.arange(B), labels]  # partners have other labels (B-1-i)
        np.testing.assert_allclose(lam, 1 - covered, rtol=ELEMENTWISE)
        assert np.ptp(covered) == 0  # one box for the whole batch
        np.testing.assert_allclose(mixed_targets.sum(-1), 1.0, rtol=ELEMENTWISE)


def test_no_alphas_return_the_very_arrays():
    images, targets, _ = batch()
    images, targets = jnp.asarray(images), jnp.asarray(targets)
    off = augment.mix_kwargs(defaults.get_config().augment)
    assert off == dict(mixup=0.0, cutmix=0.0, mix_prob=1.0, switch_prob=0.5)
    out = augment.mix_batch(images, targets, jax.random.key(0), **off)
    assert out[0] is images and out[1] is targets


def test_the_mix_keys_are_not_augment_batchs():
    config = defaults.get_config().augment
    config.mixup, config.cutmix = 0.8, 1.0
    assert not set(augment.device_kwargs(config)) & set(augment.MIX_KEYS)
    assert augment.mix_kwargs(config)["cutmix"] == 1.0


# ---------------------------------------------------------------- through train_step

@functools.cache
def initial_state():
    model_config = default.get_config().model
    model_config.name, model_config.hidden_sizes, model_config.dropout = "mlp", (16,), 0.5
    model = models.create_model(model_config, K, jnp.float32)
    return train_state.create_train_state(jax.random.key(0), model, optax.sgd(0.1, momentum=0.9),
                                          (H, W, C))


def step_results(**mix):
    """Two train_steps of a dropout MLP on flipped, translated batches: (params, metrics);
    `mix`: augment.mix_kwargs's settings, or none passed."""
    state = initial_state()
    rng = np.random.default_rng(1)
    images = rng.integers(0, 256, (B, H, W, C), dtype=np.uint8)
    labels = rng.integers(0, K, B).astype(np.int32)
    spec = step_lib.StepSpec(mean=(0.5,), std=(0.25,), num_classes=K, label_smoothing=0.1,
                             augment=dict(flip=True, translate=1), mix=mix)
    step = jax.jit(functools.partial(step_lib.train_step, spec=spec))
    metrics = []
    for seed in (1, 2):
        state, step_metrics = step(state, images, labels, jax.random.key(seed))
        metrics.append(step_metrics)
    return jax.device_get((state.params, metrics))


@pytest.mark.slow
def test_train_steps_that_do_not_mix_are_bitwise_unchanged():
    """The mix's key is folded in, not split off: the augmentation and dropout keys, and
    so a run without mixing (alphas 0, or no batch drawn to mix), stay as they were."""
    plain = step_results()
    off = augment.mix_kwargs(defaults.get_config().augment)
    for same in (step_results(**off), step_results(**dict(off, mixup=0.8, mix_prob=0.0))):
        jax.tree.map(np.testing.assert_array_equal, same, plain)
    mixed = step_results(**dict(off, mixup=0.8, cutmix=1.0))
    assert mixed[1][0]["loss"] != plain[1][0]["loss"]


# ---------------------------------------------------------------- a whole run

def mix_config(data_dir, **overrides):
    """A small MLP with MixUp and CutMix, 10 steps of 100 (an epoch is 20), a checkpoint
    every 5 (chunks of 5: one compiled program for every run here)."""
    config = cifar_seed_cnn.get_config()
    config.data.dir = str(data_dir)
    config.data.source = "files"
    config.model.name = "mlp"
    config.model.hidden_sizes = (32,)
    config.optimizer.learning_rate = 0.05
    config.augment.mixup = 0.8
    config.augment.cutmix = 1.0
    config.train.batch_size = 100
    config.train.num_steps = 10
    config.checkpoint.every_steps = 5
    config.eval.every_epochs = 0
    config.eval.batch_size = 250
    return with_overrides(config, overrides)


@pytest.mark.slow
def test_a_mixed_run_resumed_mid_epoch_ends_where_the_whole_run_did(cifar_batches_dir,
                                                                     tmp_path):
    whole = loop.train_and_evaluate(mix_config(cifar_batches_dir), str(tmp_path / "whole"))
    loop.train_and_evaluate(mix_config(cifar_batches_dir, train__num_steps=5),
                            str(tmp_path / "parts"))
    resumed = loop.train_and_evaluate(mix_config(cifar_batches_dir), str(tmp_path / "parts"))
    assert resumed["resumed_from_step"] == 5
    assert resumed["params_sha256"] == whole["params_sha256"]
    plain = loop.train_and_evaluate(
        mix_config(cifar_batches_dir, augment__mixup=0.0, augment__cutmix=0.0),
        str(tmp_path / "plain"))
    assert plain["params_sha256"] != whole["params_sha256"]  # the loop does mix


# ---------------------------------------------------------------- config

@pytest.mark.parametrize("key, value, message", [
    ("mixup", -0.5, "config.augment.mixup=-0.5: must be >= 0 (Beta(alpha, alpha)'s alpha; "
                    "0: off)"),
    ("cutmix", -1.0, "config.augment.cutmix=-1.0: must be >= 0 (Beta(alpha, alpha)'s alpha; "
                     "0: off)"),
    ("mix_prob", 1.5, "config.augment.mix_prob=1.5: must be in [0, 1] (the share of batches "
                      "mixed)"),
    ("switch_prob", -0.1, "config.augment.switch_prob=-0.1: must be in [0, 1] (the share of "
                          "mixed batches cut)"),
])
def test_a_bad_mix_setting_is_a_one_line_config_error(key, value, message):
    config = defaults.get_config()
    config.augment[key] = value
    with pytest.raises(ConfigError) as error:
        checks.check_config(config)
    assert str(error.value) == message


def test_compare_refuses_mixing_for_the_pytorch_twins():
    config = defaults.get_config()
    config.augment.mixup, config.augment.cutmix = 0.8, 1.0
    assert runner.torch_unsupported(config) == ["augment.mixup=0.8", "augment.cutmix=1.0"]
    assert runner.torch_unsupported(defaults.get_config()) == []
