import jax
import numpy as np
import pytest

from jaxtrain.training import augment


@pytest.fixture(scope="module")
def images(cifar_subset):
    return cifar_subset["x_train"][:64]


def test_flip_is_an_exact_mirror(images):
    flipped = np.asarray(augment.flip(images))
    np.testing.assert_array_equal(flipped, images[:, :, ::-1, :])
    np.testing.assert_array_equal(np.asarray(augment.flip(flipped)), images)


def test_random_flip_mirrors_some_images_and_keeps_the_rest(images):
    out = np.asarray(augment.random_flip(images, jax.random.key(0)))
    same = np.all(out == images, axis=(1, 2, 3))
    mirrored = np.all(out == images[:, :, ::-1], axis=(1, 2, 3))
    assert np.all(same | mirrored)
    assert 10 < mirrored.sum() < 54  # about half of 64


def test_translation_by_zero_is_the_identity(images):
    np.testing.assert_array_equal(np.asarray(augment.shift(images, 0, 0)), images)
    out = augment.random_translate(images, jax.random.key(0), 0)
    np.testing.assert_array_equal(np.asarray(out), images)


def test_shift_moves_content_and_pads_the_border(images):
    down_right = np.asarray(augment.shift(images, 1, 2, "constant"))
    np.testing.assert_array_equal(down_right[:, 1:, 2:], images[:, :-1, :-2])
    assert np.all(down_right[:, 0] == 0) and np.all(down_right[:, :, :2] == 0)
    reflected = np.asarray(augment.shift(images, -1, 0, "reflect"))
    np.testing.assert_array_equal(reflected[:, :-1], images[:, 1:])
    np.testing.assert_array_equal(reflected[:, -1], images[:, -2])  # reflect, not edge


def test_random_translate_is_one_of_the_allowed_shifts(images):
    out = np.asarray(augment.random_translate(images, jax.random.key(3), 1, "constant"))
    assert out.shape == images.shape and out.dtype == np.uint8
    candidates = np.stack([np.asarray(augment.shift(images, dy, dx, "constant"))
                           for dy in (-1, 0, 1) for dx in (-1, 0, 1)])
    matches = np.all(candidates == out[None], axis=(2, 3, 4))  # (9, N)
    assert np.all(matches.any(axis=0))
    assert len(set(np.argmax(matches, axis=0))) > 4  # offsets really vary


def test_rotation_by_zero_is_the_identity(images):
    np.testing.assert_array_equal(np.asarray(augment.rotate(images, np.zeros(len(images)))), images)
    np.testing.assert_array_equal(
        np.asarray(augment.random_rotate(images, jax.random.key(0), 0.0)), images)


def test_rotation_by_90_degrees_is_rot90_counter_clockwise(images):
    out = np.asarray(augment.rotate(images, np.full(len(images), 90.0)))
    np.testing.assert_array_equal(out, np.rot90(images, k=1, axes=(1, 2)))


def test_small_random_rotation_keeps_shape_dtype_and_centre(images):
    out = np.asarray(augment.random_rotate(images, jax.random.key(1), 10.0))
    assert out.shape == images.shape and out.dtype == np.uint8
    assert not np.array_equal(out, images)
    # Pixels near the centre move by less than a pixel for |angle| <= 10 degrees.
    np.testing.assert_array_equal(out[:, 15:17, 15:17], images[:, 15:17, 15:17])


def test_cutout_blacks_out_at_most_one_square(images):
    out = np.asarray(augment.random_cutout(images, jax.random.key(0), 8))
    changed = np.any(out != images, axis=-1)
    assert np.all(out[changed] == 0)
    assert np.all(changed.sum(axis=(1, 2)) <= 64)
    assert changed.sum() > 0
    np.testing.assert_array_equal(np.asarray(augment.random_cutout(images, jax.random.key(0), 0)),
                                  images)


def test_augment_batch_is_deterministic_per_key_and_keeps_dtype(images):
    kwargs = dict(flip=True, translate=2, rotate=10.0, cutout=4, pad_mode="reflect")
    a = np.asarray(augment.augment_batch(images, jax.random.key(7), **kwargs))
    b = np.asarray(augment.augment_batch(images, jax.random.key(7), **kwargs))
    c = np.asarray(augment.augment_batch(images, jax.random.key(8), **kwargs))
    assert a.shape == images.shape and a.dtype == np.uint8
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    off = augment.augment_batch(images, jax.random.key(7))
    np.testing.assert_array_equal(np.asarray(off), images)


@pytest.mark.parametrize("mode,count", [("none", 1), ("flip", 2), ("flip_translate", 6)])
def test_tta_views_and_weights(images, mode, count):
    views, weights = augment.tta_views(images, mode)
    assert len(views) == len(weights) == count
    assert sum(weights) == pytest.approx(1.0)
    np.testing.assert_array_equal(np.asarray(views[0]), images)


def test_unknown_tta_mode_is_refused(images):
    with pytest.raises(ValueError, match="eval.tta"):
        augment.tta_views(images, "rotate")


def test_alternating_flips_are_a_base_bit_xor_odd_epoch_from_the_key_alone():
    key = jax.random.key(3)
    epochs = [np.asarray(augment.alternating_flips(key, epoch, 1000)) for epoch in range(4)]
    assert epochs[0].dtype == bool and 400 < epochs[0].sum() < 600  # a coin per image
    np.testing.assert_array_equal(epochs[0], epochs[2])
    np.testing.assert_array_equal(epochs[1], ~epochs[0])  # every image mirrored the other way
    np.testing.assert_array_equal(epochs[3], epochs[1])
    again = augment.alternating_flips(jax.random.key(3), np.int32(2), 1000)  # traced epoch
    np.testing.assert_array_equal(np.asarray(again), epochs[0])
    other = np.asarray(augment.alternating_flips(jax.random.key(4), 0, 1000))
    assert not np.array_equal(other, epochs[0])


def test_alternate_flip_mirrors_exactly_the_given_images(images):
    mirror = np.arange(len(images)) % 3 == 0
    kwargs = dict(flip=True, alternate_flip=True, translate=0)
    out = np.asarray(augment.augment_batch(images, jax.random.key(0), mirror=mirror, **kwargs))
    np.testing.assert_array_equal(out[mirror], images[mirror][:, :, ::-1])
    np.testing.assert_array_equal(out[~mirror], images[~mirror])
    with pytest.raises(ValueError, match="alternate_flip"):
        augment.augment_batch(images, jax.random.key(0), **kwargs)
    # without flip the bits do nothing; without alternate_flip the coin is random, as before
    unflipped = augment.augment_batch(images, jax.random.key(0), alternate_flip=True, mirror=mirror)
    np.testing.assert_array_equal(np.asarray(unflipped), images)
    np.testing.assert_array_equal(
        np.asarray(augment.augment_batch(images, jax.random.key(0), flip=True, mirror=mirror)),
        np.asarray(augment.random_flip(images, jax.random.split(jax.random.key(0), 4)[0])))
