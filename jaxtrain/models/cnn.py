"""The CIFAR-style convolutional nets (the speedrun's SeedCNN and CifarCNN) and an MLP,
with the initialisers and activations their configs name."""
import functools
from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxtrain.models.ops import batchnorm, onednn, pooling

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
    freeze_batch_stats: bool = False  # BatchNorm normalises with its running statistics
    pool_impl: str = "xla"  # how max-pooling is computed (jaxtrain/models/ops/pooling.py)
    conv_impl: str = "xla"  # how convolutions are computed (jaxtrain/models/ops/onednn.py)
    bn_impl: str = "flax"  # which BatchNorm (jaxtrain/models/ops/batchnorm.py)

    @nn.compact
    def __call__(self, x, train: bool = False):
        train = train and not self.freeze_batch_stats  # BatchNorm is its only train-mode layer
        batch_norm = batchnorm.module(self.bn_impl)
        x = x.astype(self.dtype)
        in_channels = x.shape[-1]
        for features, fan_in in ((6, 25 * in_channels), (16, 25 * 6)):
            x = nn.Conv(features, (5, 5), padding="VALID", dtype=self.dtype,
                        conv_general_dilated=onednn.conv_function(self.conv_impl),
                        kernel_init=torch_default_kernel_init(),
                        bias_init=torch_default_bias_init(fan_in))(x)
            if self.batch_norm:
                x = batch_norm(use_running_average=not train, momentum=0.9,
                               dtype=self.dtype)(x)
            x = pooling.max_pool_2x2(nn.relu(x), self.pool_impl)
        x = x.reshape((x.shape[0], -1))
        for features in (120, 84, self.num_classes):
            dense = nn.Dense(features, dtype=self.dtype,
                             kernel_init=torch_default_kernel_init(),
                             bias_init=torch_default_bias_init(x.shape[-1]))
            x = dense(x)
            if features != self.num_classes:
                if self.batch_norm:
                    x = batch_norm(use_running_average=not train, momentum=0.9,
                                   dtype=self.dtype)(x)
                x = nn.relu(x)
        return x.astype(jnp.float32)


ACTIVATIONS = ("gelu_tanh", "gelu", "silu", "relu")
CONV_INITS = ("default", "dirac")


def activation_fn(name: str):
    """The activation `model.activation` names; 'gelu_tanh' (Flax's nn.gelu default) was
    cifar_cnn's only activation before the option, so it stays the default."""
    functions = {"gelu_tanh": nn.gelu,
                 "gelu": functools.partial(nn.gelu, approximate=False),
                 "silu": nn.silu,
                 "relu": nn.relu}
    if name not in functions:
        raise ValueError(f"unknown model.activation {name!r}; choose one of: "
                         + ", ".join(ACTIVATIONS))
    return functions[name]


def dirac_kernel_init(base_init=nn.linear.default_kernel_init):
    """`base_init`, then the first min(C_in, C_out) filters set to the identity.

    Such a conv starts by passing its first input channels through unchanged
    (like torch.nn.init.dirac_ in the public CIFAR-10 speedruns), so a deep
    stack starts close to a shallow one; the other filters keep `base_init`.
    Kernels are HWIO.
    """
    def init(key, shape, dtype=jnp.float32):
        kernel = base_init(key, shape, dtype)
        height, width, in_channels, out_channels = shape
        n = min(in_channels, out_channels)
        identity = jnp.zeros((height, width, in_channels, n), dtype)
        identity = identity.at[height // 2, width // 2].set(jnp.eye(in_channels, n, dtype=dtype))
        return kernel.at[..., :n].set(identity)

    return init


def conv_kernel_init(name: str):
    """The kernel init `model.conv_init` names."""
    if name == "default":
        return nn.linear.default_kernel_init
    if name == "dirac":
        return dirac_kernel_init()
    raise ValueError(f"unknown model.conv_init {name!r}; choose one of: " + ", ".join(CONV_INITS))


def rematted(block_cls, remat: bool):
    """block_cls, or with remat its nn.remat: the block's activations are recomputed in
    the backward pass instead of kept from the forward one (memory for compute).
    `train` (the call's second argument) stays a Python bool. Callers name the blocks
    themselves, so that the parameters keep their paths (Flax would name a remat'd
    block 'CheckpointConvBlock_0'): checkpoints and weights load either way."""
    return nn.remat(block_cls, static_argnums=(2,)) if remat else block_cls


class ConvBlock(nn.Module):
    """conv - max-pool 2 - BN - act - conv - BN - act: one resolution stage."""
    features: int
    bn_momentum: float
    dtype: Dtype
    activation: str = "gelu_tanh"
    conv_init: str = "default"
    bn_epsilon: float = 1e-5
    pool_impl: str = "xla"
    conv_impl: str = "xla"
    bn_impl: str = "flax"

    @nn.compact
    def __call__(self, x, train: bool):
        act = activation_fn(self.activation)

        def bn(y):
            # No learned scale: with a following conv it is redundant, and it
            # saves a multiply per activation.
            return batchnorm.module(self.bn_impl)(
                use_running_average=not train, momentum=self.bn_momentum,
                epsilon=self.bn_epsilon, use_scale=False, dtype=self.dtype)(y)

        def conv(y):
            return nn.Conv(self.features, (3, 3), padding="SAME", use_bias=False,
                           kernel_init=conv_kernel_init(self.conv_init), dtype=self.dtype,
                           conv_general_dilated=onednn.conv_function(self.conv_impl))(y)

        x = pooling.max_pool_2x2(conv(x), self.pool_impl)
        x = act(bn(x))
        x = act(bn(conv(x)))
        return x


class CifarCNN(nn.Module):
    """A fast VGG-style CNN with BatchNorm for time-to-accuracy on 32x32 images.

    stem conv 2x2 (no padding) -> three conv blocks, each halving the resolution
    -> global max-pool -> linear head scaled down by `head_scale`. The shape
    follows the public CIFAR-10 speedruns: few, wide layers keep the GPU busy,
    pooling early keeps FLOPs low, and a scaled-down head acts like a softmax
    temperature that speeds up early training. `head_init_std` > 0 draws the
    head from N(0, std^2) (the speedruns' large init, paired with a small
    head_scale); 0 keeps Flax's default init.
    """
    num_classes: int = 10
    widths: Sequence[int] = (64, 256, 256)
    stem_width: int = 24
    bn_momentum: float = 0.6
    head_scale: float = 1.0 / 9.0
    dtype: Dtype = jnp.float32
    activation: str = "gelu_tanh"
    conv_init: str = "default"
    bn_epsilon: float = 1e-5
    head_init_std: float = 0.0
    freeze_batch_stats: bool = False  # BatchNorm normalises with its running statistics
    remat: bool = False  # recompute each block's activations in the backward pass
    pool_impl: str = "xla"  # how max-pooling is computed (jaxtrain/models/ops/pooling.py)
    conv_impl: str = "xla"  # how convolutions are computed (jaxtrain/models/ops/onednn.py)
    bn_impl: str = "flax"  # which BatchNorm (jaxtrain/models/ops/batchnorm.py)

    @nn.compact
    def __call__(self, x, train: bool = False):
        train = train and not self.freeze_batch_stats  # BatchNorm is its only train-mode layer
        x = x.astype(self.dtype)
        x = nn.Conv(self.stem_width, (2, 2), padding="VALID", dtype=self.dtype,
                    conv_general_dilated=onednn.conv_function(self.conv_impl))(x)
        x = activation_fn(self.activation)(x)
        block = rematted(ConvBlock, self.remat)
        for i, width in enumerate(self.widths):
            x = block(width, self.bn_momentum, self.dtype, activation=self.activation,
                      conv_init=self.conv_init, bn_epsilon=self.bn_epsilon,
                      pool_impl=self.pool_impl, conv_impl=self.conv_impl,
                      bn_impl=self.bn_impl, name=f"ConvBlock_{i}")(x, train)
        x = jnp.max(x, axis=(1, 2))
        head_init = (nn.initializers.normal(self.head_init_std) if self.head_init_std > 0
                     else nn.linear.default_kernel_init)
        x = nn.Dense(self.num_classes, use_bias=False, kernel_init=head_init,
                     dtype=self.dtype)(x)
        return x.astype(jnp.float32) * self.head_scale


class MLP(nn.Module):
    """A multilayer perceptron ("BP network") on flattened images: dense - BatchNorm -
    ReLU (- dropout) per hidden layer, then a dense classifier."""
    num_classes: int = 10
    hidden_sizes: Sequence[int] = (256, 128, 100)
    batch_norm: bool = True
    dropout: float = 0.0
    dtype: Dtype = jnp.float32
    freeze_batch_stats: bool = False  # BatchNorm normalises with its running statistics
    bn_impl: str = "flax"  # which BatchNorm (jaxtrain/models/ops/batchnorm.py)

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = x.astype(self.dtype).reshape((x.shape[0], -1))
        for features in self.hidden_sizes:
            x = nn.Dense(features, dtype=self.dtype)(x)
            if self.batch_norm:
                # momentum 0.9 here is PyTorch's BatchNorm1d default (its momentum=0.1)
                x = batchnorm.module(self.bn_impl)(
                    use_running_average=not train or self.freeze_batch_stats, momentum=0.9,
                    dtype=self.dtype)(x)
            x = nn.relu(x)
            if self.dropout > 0:
                x = nn.Dropout(self.dropout, deterministic=not train)(x)
        return nn.Dense(self.num_classes, dtype=self.dtype)(x).astype(jnp.float32)
