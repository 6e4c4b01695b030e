"""On-device data augmentation: pure jnp functions of (images, key).

They work on uint8 batches (N, H, W, C) before normalisation, so the gathers
move bytes, not floats, and run inside the compiled epoch with no host work.
MixUp and CutMix (mix_batch) come after normalisation instead: their blends and
soft targets are floats.
"""
import jax
import jax.numpy as jnp


def flip(images):
    """Horizontal mirror of every image."""
    return images[:, :, ::-1, :]


def flip_where(images, mirror):
    """Mirrors the images whose bit in `mirror` (bool, one per image) is set."""
    return jnp.where(mirror[:, None, None, None], flip(images), images)


def random_flip(images, key):
    """Mirrors each image with probability 1/2."""
    mirror = jax.random.bernoulli(key, 0.5, (images.shape[0], 1, 1, 1))
    return jnp.where(mirror, flip(images), images)


# fold_in data for the per-run flip bits: far above any epoch number, so the bits never
# share a key with an epoch's (order, augmentation) stream.
FLIP_STREAM = 0x464C4950  # "FLIP"


def alternating_flips(key, epoch, num_examples: int):
    """Which training images to mirror in `epoch`: base_i XOR (epoch is odd).

    Each image's base bit is drawn once per run from `key` alone, so every image
    is seen both ways in any two consecutive epochs (the speedruns' alternating
    flip), and a resumed run recomputes the same bits from (key, epoch).
    """
    base = jax.random.bernoulli(jax.random.fold_in(key, FLIP_STREAM), 0.5, (num_examples,))
    return base ^ (epoch % 2 == 1)


def _pad(images, amount, pad_mode):
    widths = ((0, 0), (amount, amount), (amount, amount), (0, 0))
    return jnp.pad(images, widths, mode="reflect" if pad_mode == "reflect" else "constant")


def shift(images, dy: int, dx: int, pad_mode: str = "reflect"):
    """Translates every image by (dy, dx) pixels; the uncovered border is padded."""
    if dy == 0 and dx == 0:
        return images
    amount = max(abs(dy), abs(dx))
    padded = _pad(images, amount, pad_mode)
    h, w = images.shape[1:3]
    return padded[:, amount - dy:amount - dy + h, amount - dx:amount - dx + w, :]


def random_translate(images, key, max_shift: int, pad_mode: str = "reflect"):
    """Translates each image by an independent offset in [-max_shift, max_shift]^2.

    Pad + random crop, as torchvision's RandomCrop(size, padding) does.
    """
    if max_shift == 0:
        return images
    n, h, w, c = images.shape
    padded = _pad(images, max_shift, pad_mode)
    corners = jax.random.randint(key, (n, 2), 0, 2 * max_shift + 1)

    def crop(image, corner):
        return jax.lax.dynamic_slice(image, (corner[0], corner[1], 0), (h, w, c))

    return jax.vmap(crop)(padded, corners)


def rotate(images, angles_degrees):
    """Rotates image i counter-clockwise by angles_degrees[i] about its centre.

    Nearest-neighbour sampling with black fill, like torchvision's
    RandomRotation defaults. An angle of 0 returns the images unchanged.
    """
    n, h, w, _ = images.shape
    theta = jnp.deg2rad(angles_degrees.astype(jnp.float32))[:, None, None]
    cos, sin = jnp.cos(theta), jnp.sin(theta)
    cy, cx = (h - 1) / 2.0, (w - 1) / 2.0
    rows, cols = jnp.meshgrid(jnp.arange(h, dtype=jnp.float32),
                              jnp.arange(w, dtype=jnp.float32), indexing="ij")
    u, v = cols - cx, cy - rows                      # y axis pointing up
    src_cols = jnp.round(cos * u + sin * v + cx).astype(jnp.int32)
    src_rows = jnp.round(cy - (-sin * u + cos * v)).astype(jnp.int32)
    inside = (src_rows >= 0) & (src_rows < h) & (src_cols >= 0) & (src_cols < w)
    src_rows = jnp.clip(src_rows, 0, h - 1)
    src_cols = jnp.clip(src_cols, 0, w - 1)
    batch = jnp.arange(n)[:, None, None]
    rotated = images[batch, src_rows, src_cols]
    return jnp.where(inside[..., None], rotated, jnp.zeros_like(rotated))


def random_rotate(images, key, max_degrees: float):
    """Rotates each image by an angle drawn uniformly from [-max_degrees, max_degrees]."""
    if max_degrees == 0:
        return images
    angles = jax.random.uniform(key, (images.shape[0],), minval=-max_degrees, maxval=max_degrees)
    return rotate(images, angles)


def random_cutout(images, key, size: int):
    """Blacks out one size x size square per image at a random position (may be clipped)."""
    if size == 0:
        return images
    n, h, w, _ = images.shape
    centres = jax.random.randint(key, (n, 2), 0, jnp.array([h, w]))
    rows = jnp.arange(h)[None, :, None]
    cols = jnp.arange(w)[None, None, :]
    top = centres[:, 0, None, None] - size // 2
    left = centres[:, 1, None, None] - size // 2
    hole = (rows >= top) & (rows < top + size) & (cols >= left) & (cols < left + size)
    return jnp.where(hole[..., None], jnp.zeros_like(images), images)


HOST_CROPS = ("none", "random_resized")  # augment.crop
DEVICE_KEYS = ("flip", "alternate_flip", "translate", "rotate", "cutout", "pad_mode")


def device_kwargs(augment_config) -> dict:
    """The `augment` block's on-device part, as augment_batch's keyword arguments.

    A host crop (augment.crop='random_resized', streamed image folders) also
    mirrors on the host, so the device then does not flip again.
    """
    kwargs = {key: augment_config[key] for key in DEVICE_KEYS}
    if augment_config.get("crop", "none") != "none":
        kwargs.update(flip=False, alternate_flip=False)
    return kwargs


# fold_in data for a step's MixUp/CutMix key (step.train_step): the step key's split
# into (augment, dropout) keys stays as it was, so a run that does not mix is unchanged.
MIX_STREAM = 0x4D495820  # "MIX "
USER_STREAM = 0x55534552  # "USER": the key of the user's augmentation (step.train_step)
MIX_KEYS = ("mixup", "cutmix", "mix_prob", "switch_prob")


def mix_kwargs(augment_config) -> dict:
    """The `augment` block's batch-mixing part, as mix_batch's keyword arguments: it works
    on the normalised batch and its targets, so it is not augment_batch's."""
    return {key: augment_config[key] for key in MIX_KEYS}


def cutmix_box(key, height: int, width: int, lam):
    """CutMix's box (top, bottom, left, right) for mixing weight `lam`: sides sqrt(1 - lam)
    of the image's, a uniform centre, clipped to the image (so it may cover less)."""
    ratio = jnp.sqrt(1.0 - lam)
    cut_h = jnp.floor(height * ratio).astype(jnp.int32)
    cut_w = jnp.floor(width * ratio).astype(jnp.int32)
    cy, cx = jax.random.randint(key, (2,), 0, jnp.array([height, width]))
    return (jnp.clip(cy - cut_h // 2, 0, height), jnp.clip(cy + (cut_h + 1) // 2, 0, height),
            jnp.clip(cx - cut_w // 2, 0, width), jnp.clip(cx + (cut_w + 1) // 2, 0, width))


def box_mask(height: int, width: int, box):
    """(height, width) bools: True inside box = (top, bottom, left, right), ends excluded."""
    top, bottom, left, right = box
    rows = jnp.arange(height)[:, None]
    cols = jnp.arange(width)[None, :]
    return (rows >= top) & (rows < bottom) & (cols >= left) & (cols < right)


def mix_batch(images, targets, key, *, mixup: float = 0.0, cutmix: float = 0.0,
              mix_prob: float = 1.0, switch_prob: float = 0.5):
    """MixUp or CutMix of a batch with itself reversed (image i with image B-1-i), one
    mixing weight lam for the whole batch (timm's Mixup, mode='batch'); the targets
    become lam * targets + (1 - lam) * reversed targets.

    `images`: normalised floats (blends are not rounded to bytes); `targets`: (B, K)
    floats. A share mix_prob of batches is mixed; with both alphas set, a share
    switch_prob of those by CutMix, whose lam is then the share of each image left
    uncovered by the (clipped) box. Both alphas 0: the same arrays, untouched.
    """
    if not mixup and not cutmix:
        return images, targets
    gate_key, switch_key, lam_key, box_key = jax.random.split(key, 4)
    mixed = jax.random.uniform(gate_key) < mix_prob
    if mixup and cutmix:
        use_cutmix = jax.random.uniform(switch_key) < switch_prob
        alpha = jnp.where(use_cutmix, cutmix, mixup)
    else:
        use_cutmix, alpha = jnp.asarray(bool(cutmix)), cutmix or mixup
    lam = jax.random.beta(lam_key, alpha, alpha)
    height, width = images.shape[1:3]
    box = cutmix_box(box_key, height, width, lam)
    area = ((box[1] - box[0]) * (box[3] - box[2])).astype(jnp.float32)
    lam = jnp.where(mixed, jnp.where(use_cutmix, 1.0 - area / (height * width), lam), 1.0)

    partner = images[::-1]
    weight = lam.astype(images.dtype)
    cut = jnp.where(box_mask(height, width, box)[None, :, :, None], partner, images)
    blended = weight * images + (1 - weight) * partner
    images = jnp.where(mixed, jnp.where(use_cutmix, cut, blended), images)
    weight = lam.astype(targets.dtype)  # lam = 1 when not mixed: the targets as they were
    return images, weight * targets + (1 - weight) * targets[::-1]


def augment_batch(images, key, *, flip: bool = False, alternate_flip: bool = False,
                  translate: int = 0, rotate: float = 0.0, cutout: int = 0,
                  pad_mode: str = "reflect", mirror=None):
    """Applies the configured augmentations (the `augment` config block) in a fixed order.

    With flip and alternate_flip, `mirror` (bool, one per image: the batch's
    alternating_flips) says which images to mirror instead of a coin per image.
    """
    if pad_mode not in ("reflect", "constant"):
        raise ValueError(f"augment.pad_mode must be 'reflect' or 'constant', got {pad_mode!r}")
    flip_key, translate_key, rotate_key, cutout_key = jax.random.split(key, 4)
    if rotate:
        images = random_rotate(images, rotate_key, rotate)
    if flip and alternate_flip:
        if mirror is None:
            raise ValueError("augment.alternate_flip needs the batch's mirror bits "
                             "(augment.alternating_flips)")
        images = flip_where(images, mirror)
    elif flip:
        images = random_flip(images, flip_key)
    images = random_translate(images, translate_key, translate, pad_mode)
    images = random_cutout(images, cutout_key, cutout)
    return images


def tta_views(images, mode: str, pad_mode: str = "reflect"):
    """Test-time-augmentation views and their weights (they sum to 1).

    'none': the images; 'flip': images and mirrors, equally weighted;
    'flip_translate': half the weight on (images, mirrors), half on both of
    them shifted one pixel up-left and one pixel down-right.
    """
    if mode == "none":
        return [images], [1.0]
    if mode == "flip":
        return [images, flip(images)], [0.5, 0.5]
    if mode == "flip_translate":
        mirrored = flip(images)
        shifted = [shift(v, d, d, pad_mode) for v in (images, mirrored) for d in (-1, 1)]
        return [images, mirrored] + shifted, [0.25, 0.25] + [0.125] * 4
    raise ValueError(f"eval.tta must be 'none', 'flip' or 'flip_translate', got {mode!r}")

