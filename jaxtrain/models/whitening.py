"""model.stem_init='whiten': the stem's filters computed from the training images
(patch whitening, as the CIFAR-10 speedruns do) and held fixed."""
import jax
import jax.numpy as jnp
import numpy as np

STEM_KERNEL = ("Conv_0", "kernel")  # where cifar_cnn keeps its stem's weights
STEM_INITS = ("default", "whiten")
WHITENING_IMAGES = 5000  # training images the whitened stem's filters are computed from


def whitening_kernel(images, mean, std, filters: int, eps: float = 5e-4,
                     max_images: int = WHITENING_IMAGES) -> jax.Array:
    """A 2x2 stem kernel that whitens the images' 2x2 patches, float32 (2, 2, C, filters).

    The filters are the top filters/2 eigenvectors of the patches' second
    moment (of the first `max_images` normalised uint8 images), each with its
    first entry positive and scaled by 1/sqrt(eigenvalue + eps), and their
    negations (so a following GELU keeps both signs). The first layer then
    starts decorrelated and needs no training, as in the public CIFAR-10
    speedruns.

    The moment is uncentred (patches^T patches / count), as in the speedruns;
    this used to be the centred covariance. Normalised patches have means near
    zero, so the two nearly agree.

    Written in jax.numpy so the benchmark can compute it inside its timed
    program (as the speedruns count it); `mean`, `std`, `filters`, `eps` and
    `max_images` are static Python values (bind them with functools.partial).
    """
    channels = images.shape[-1]
    if filters % 2 or not 0 < filters <= 8 * channels:
        raise ValueError(f"whitening_kernel: filters={filters} must be even and at most "
                         f"{8 * channels} for {channels}-channel images")
    if images.dtype != np.uint8:
        raise ValueError(f"whitening_kernel: images must be uint8, not {images.dtype}")
    # In float32 the smallest eigenvectors move by ~1e-3 when the moment moves by
    # one rounding, so every step up to eigh must round the same eagerly, jitted
    # or fused into a larger program. Normalising by table look-up (not on-the-fly
    # arithmetic that XLA may fuse differently) and leaving out the division by
    # the count (applied to the eigenvalues instead) keeps it so on the CPU.
    table = (np.arange(256.0)[:, None] / 255.0 - np.asarray(mean, np.float64)) \
        / np.asarray(std, np.float64)  # (256, C): pixel value, channel -> normalised
    x = jnp.asarray(images[:max_images]).astype(jnp.int32)  # slice first: convert only these
    x = jnp.asarray(table.reshape(-1), jnp.float32)[x * channels + jnp.arange(channels)]
    # The four shifted views side by side are the 2x2 patches in (kh, kw, c) order,
    # the row order of an HWIO kernel's (2, 2, C) input dimensions.
    height, width = x.shape[1:3]
    patches = jnp.concatenate([x[:, i:height - 1 + i, j:width - 1 + j]
                               for i in (0, 1) for j in (0, 1)], axis=-1)
    patches = patches.reshape(-1, 4 * channels)
    moment = jax.lax.dot_general(patches, patches, (((0,), (0,)), ((), ())),
                                 precision=jax.lax.Precision.HIGHEST)  # times the count
    eigenvalues, eigenvectors = jnp.linalg.eigh(moment)  # ascending
    eigenvalues = eigenvalues[::-1] / patches.shape[0]
    eigenvectors = eigenvectors[:, ::-1]
    # eigh's signs are arbitrary, and filters i and i + filters/2 swap with them: make
    # each vector's first entry (the patch's top-left pixel, first channel) positive.
    # Natural images' patch eigenvectors are a 2x2 pattern of +-1 (a gradient, a
    # corner) times a colour, and the top-left pixel weighs +-1/2 in every pattern, so
    # that entry stays far from zero (tests/test_compare.py checks it on CIFAR-10).
    # "Largest entry positive" was decided by rounding: the patterns' symmetry makes
    # two entries equal in magnitude to 0.1%.
    eigenvectors = eigenvectors * jnp.where(eigenvectors[0] < 0, -1.0, 1.0)
    top = filters // 2
    half = eigenvectors[:, :top] / jnp.sqrt(eigenvalues[:top] + eps)
    kernel = jnp.concatenate([half, -half], axis=1)
    return kernel.reshape(2, 2, channels, filters).astype(jnp.float32)


def has_whitened_stem(model_config) -> bool:
    return model_config.name == "cifar_cnn" and model_config.stem_init == "whiten"


def check_stem(model_config, channels: int) -> None:
    """A whitened stem needs an even width of at most two filters per patch dimension."""
    width, most = model_config.stem_width, 2 * 4 * channels
    if width % 2 or not 0 < width <= most:
        raise ValueError(f"config.model.stem_width={width}: a whitened stem needs an even width "
                         f"of at most {most} for {channels}-channel images")


def with_stem_kernel(params, kernel):
    """params with cifar_cnn's stem kernel replaced (e.g. by whitening_kernel's)."""
    layer, name = STEM_KERNEL
    return {**params, layer: {**params[layer], name: kernel}}
