"""Flax (Linen) image classifiers.

Every model takes float images (N, H, W, C) that are already normalised, and
returns float32 logits. `dtype` is the compute dtype (bfloat16 for mixed
precision); parameters and BatchNorm statistics stay float32.
"""
from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

Dtype = Any


def torch_default_kernel_init():
    """PyTorch's default Conv/Linear weight init: U(-1/sqrt(fan_in), 1/sqrt(fan_in)).

    Used by `seed_cnn` so the seed recipe starts where the PyTorch article starts.
    """
    return nn.initializers.variance_scaling(1.0 / 3.0, "fan_in", "uniform")


def torch_default_bias_init(fan_in: int):
    """PyTorch's default bias init, which depends on the layer's fan-in."""
    bound = 1.0 / np.sqrt(fan_in)

    def init(key, shape, dtype=jnp.float32):
        return jax.random.uniform(key, shape, dtype, -bound, bound)

    return init


class SeedCNN(nn.Module):
    """The seed article's LeNet-style network, optionally with BatchNorm.

    conv 6@5x5 - pool 2 - conv 16@5x5 - pool 2 - dense 120 - 84 - classes.
    """
    num_classes: int = 10
    batch_norm: bool = False
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = x.astype(self.dtype)
        in_channels = x.shape[-1]
        for features, fan_in in ((6, 25 * in_channels), (16, 25 * 6)):
            x = nn.Conv(features, (5, 5), padding="VALID", dtype=self.dtype,
                        kernel_init=torch_default_kernel_init(),
                        bias_init=torch_default_bias_init(fan_in))(x)
            if self.batch_norm:
                x = nn.BatchNorm(use_running_average=not train, momentum=0.9,
                                 dtype=self.dtype)(x)
            x = nn.relu(x)
            x = nn.max_pool(x, (2, 2), strides=(2, 2))
        x = x.reshape((x.shape[0], -1))
        for features in (120, 84, self.num_classes):
            dense = nn.Dense(features, dtype=self.dtype,
                             kernel_init=torch_default_kernel_init(),
                             bias_init=torch_default_bias_init(x.shape[-1]))
            x = dense(x)
            if features != self.num_classes:
                if self.batch_norm:
                    x = nn.BatchNorm(use_running_average=not train, momentum=0.9,
                                     dtype=self.dtype)(x)
                x = nn.relu(x)
        return x.astype(jnp.float32)


class ConvBlock(nn.Module):
    """conv - max-pool 2 - BN - GELU - conv - BN - GELU: one resolution stage."""
    features: int
    bn_momentum: float
    dtype: Dtype

    @nn.compact
    def __call__(self, x, train: bool):
        def bn(y):
            # No learned scale: with a following conv it is redundant, and it
            # saves a multiply per activation.
            return nn.BatchNorm(use_running_average=not train, momentum=self.bn_momentum,
                                use_scale=False, dtype=self.dtype)(y)

        x = nn.Conv(self.features, (3, 3), padding="SAME", use_bias=False, dtype=self.dtype)(x)
        x = nn.max_pool(x, (2, 2), strides=(2, 2))
        x = nn.gelu(bn(x))
        x = nn.Conv(self.features, (3, 3), padding="SAME", use_bias=False, dtype=self.dtype)(x)
        x = nn.gelu(bn(x))
        return x


class CifarCNN(nn.Module):
    """A fast VGG-style CNN with BatchNorm for time-to-accuracy on 32x32 images.

    stem conv 2x2 (no padding) -> three conv blocks, each halving the resolution
    -> global max-pool -> linear head scaled down by `head_scale`. The shape
    follows the public CIFAR-10 speedruns: few, wide layers keep the GPU busy,
    pooling early keeps FLOPs low, and a scaled-down head acts like a softmax
    temperature that speeds up early training.
    """
    num_classes: int = 10
    widths: Sequence[int] = (64, 256, 256)
    stem_width: int = 24
    bn_momentum: float = 0.6
    head_scale: float = 1.0 / 9.0
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = x.astype(self.dtype)
        x = nn.Conv(self.stem_width, (2, 2), padding="VALID", dtype=self.dtype)(x)
        x = nn.gelu(x)
        for width in self.widths:
            x = ConvBlock(width, self.bn_momentum, self.dtype)(x, train)
        x = jnp.max(x, axis=(1, 2))
        x = nn.Dense(self.num_classes, use_bias=False, dtype=self.dtype)(x)
        return x.astype(jnp.float32) * self.head_scale


class MLP(nn.Module):
    """A multilayer perceptron ("BP network") on flattened images: dense - BatchNorm -
    ReLU (- dropout) per hidden layer, then a dense classifier."""
    num_classes: int = 10
    hidden_sizes: Sequence[int] = (256, 128, 100)
    batch_norm: bool = True
    dropout: float = 0.0
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = x.astype(self.dtype).reshape((x.shape[0], -1))
        for features in self.hidden_sizes:
            x = nn.Dense(features, dtype=self.dtype)(x)
            if self.batch_norm:
                # momentum 0.9 here is PyTorch's BatchNorm1d default (its momentum=0.1)
                x = nn.BatchNorm(use_running_average=not train, momentum=0.9,
                                 dtype=self.dtype)(x)
            x = nn.relu(x)
            if self.dropout > 0:
                x = nn.Dropout(self.dropout, deterministic=not train)(x)
        return nn.Dense(self.num_classes, dtype=self.dtype)(x).astype(jnp.float32)


def create_model(model_config, num_classes: int, dtype: Dtype) -> nn.Module:
    """Builds the model that `model_config.name` names."""
    name = model_config.name
    if name == "seed_cnn":
        return SeedCNN(num_classes=num_classes, batch_norm=model_config.batch_norm, dtype=dtype)
    if name == "cifar_cnn":
        return CifarCNN(num_classes=num_classes, widths=tuple(model_config.widths),
                        stem_width=model_config.stem_width,
                        bn_momentum=model_config.bn_momentum,
                        head_scale=model_config.head_scale, dtype=dtype)
    if name == "mlp":
        return MLP(num_classes=num_classes, hidden_sizes=tuple(model_config.hidden_sizes),
                   batch_norm=model_config.batch_norm, dropout=model_config.dropout, dtype=dtype)
    raise ValueError(f"unknown model.name {name!r}; choose one of: seed_cnn, cifar_cnn, mlp")


STEM_KERNEL = ("Conv_0", "kernel")  # where cifar_cnn keeps its stem's weights
STEM_INITS = ("default", "whiten")


def whitening_kernel(images, mean, std, filters: int, eps: float = 5e-4,
                     max_images: int = 5000) -> np.ndarray:
    """A 2x2 stem kernel that whitens the images' 2x2 patches, (2, 2, C, filters).

    The filters are the top filters/2 eigenvectors of the patch covariance (of
    the first `max_images` normalised images), each scaled by 1/sqrt(eigenvalue
    + eps), and their negations (so a following GELU keeps both signs). The
    first layer then starts decorrelated and needs no training, as in the
    public CIFAR-10 speedruns.
    """
    x = (np.asarray(images[:max_images], np.float32) / 255.0 - np.asarray(mean, np.float32)) \
        / np.asarray(std, np.float32)
    channels = x.shape[-1]
    windows = np.lib.stride_tricks.sliding_window_view(x, (2, 2), axis=(1, 2))  # N,H-1,W-1,C,2,2
    patches = windows.transpose(0, 1, 2, 4, 5, 3).reshape(-1, 4 * channels)  # (kh, kw, c) order
    eigenvalues, eigenvectors = np.linalg.eigh(np.cov(patches, rowvar=False))
    top = np.argsort(eigenvalues)[::-1][:filters // 2]
    half = eigenvectors[:, top] / np.sqrt(eigenvalues[top] + eps)
    kernel = np.concatenate([half, -half], axis=1)
    return kernel.reshape(2, 2, channels, filters).astype(np.float32)


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


def frozen_params(model_config) -> tuple:
    """'/'-joined paths of the parameters the optimiser must leave as initialised."""
    if has_whitened_stem(model_config):
        return ("/".join(STEM_KERNEL),)
    return ()


def is_convolutional(name: str) -> bool:
    return name in ("seed_cnn", "cifar_cnn")


def count_params(params) -> int:
    return int(sum(np.prod(p.shape) for p in jax.tree_util.tree_leaves(params)))
