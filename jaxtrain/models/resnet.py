"""ResNets (18/34 basic blocks, 50/101/152 bottlenecks) with torchvision's layout, so that
torchvision's and timm's weights map onto them; an ImageNet stem or a CIFAR one."""
from typing import Any, Sequence

import flax.linen as nn
import jax.numpy as jnp

from jaxtrain.models import cnn
from jaxtrain.models.ops import batchnorm, onednn

RESNET_STEMS = ("auto", "imagenet", "cifar")
AUTO_CIFAR_STEM_MAX_SIDE = 64  # model.stem 'auto': the cifar stem up to this many pixels a side


def resnet_stem(stem: str, image_size=None) -> str:
    """The stem `model.stem` names for images of `image_size` ((H, W) or (H, W, C)).

    'imagenet' and 'cifar' are taken as they are. 'auto' is 'cifar' when neither
    side is over AUTO_CIFAR_STEM_MAX_SIDE (64) pixels (CIFAR's 32 px, Tiny
    ImageNet's 64 px), else 'imagenet': the ImageNet stem shrinks its input 4x
    before the first stage, which leaves a 32 px image 1x1 before the last stage.
    """
    if stem not in RESNET_STEMS:
        raise ValueError(f"unknown model.stem {stem!r}; choose one of: " + ", ".join(RESNET_STEMS))
    if stem != "auto":
        return stem
    if image_size is None:
        raise ValueError("model.stem='auto' needs the image size")
    height, width = image_size[:2]
    return "cifar" if max(height, width) <= AUTO_CIFAR_STEM_MAX_SIDE else "imagenet"


def resnet_conv(features: int, size: int, strides: int, dtype: cnn.Dtype,
                conv_impl: str = "xla") -> nn.Conv:
    """A bias-free size x size conv padded by size // 2 on every side, as torchvision's
    ResNet pads (Flax's 'SAME' pads a stride-2 conv on one side only)."""
    pad = size // 2
    return nn.Conv(features, (size, size), (strides, strides), padding=[(pad, pad), (pad, pad)],
                   use_bias=False, dtype=dtype,
                   conv_general_dilated=onednn.conv_function(conv_impl))


def resnet_norm(train: bool, dtype: cnn.Dtype, zero_scale: bool = False,
                bn_impl: str = "flax") -> nn.Module:
    """BatchNorm as torchvision's defaults (Flax momentum 0.9 = torch momentum 0.1,
    epsilon 1e-5); zero_scale starts a residual branch's last BN at scale 0, so each
    block starts as its shortcut (the Flax ImageNet example's choice)."""
    scale_init = nn.initializers.zeros_init() if zero_scale else nn.initializers.ones_init()
    return batchnorm.module(bn_impl)(use_running_average=not train, momentum=0.9, epsilon=1e-5,
                                     scale_init=scale_init, dtype=dtype)


class ResNetBlock(nn.Module):
    """ResNet-18/34's block: 3x3 conv (with the stride) - BN - ReLU - 3x3 conv - BN,
    plus the shortcut (1x1 conv - BN where the shape changes), then ReLU."""
    filters: int
    strides: int = 1
    dtype: cnn.Dtype = jnp.float32
    conv_impl: str = "xla"
    bn_impl: str = "flax"
    expansion = 1  # output channels / filters

    @nn.compact
    def __call__(self, x, train: bool = False):
        y = resnet_conv(self.filters, 3, self.strides, self.dtype, self.conv_impl)(x)
        y = nn.relu(resnet_norm(train, self.dtype, bn_impl=self.bn_impl)(y))
        y = resnet_conv(self.filters, 3, 1, self.dtype, self.conv_impl)(y)
        y = resnet_norm(train, self.dtype, zero_scale=True, bn_impl=self.bn_impl)(y)
        return nn.relu(resnet_shortcut(x, y, self.strides, train, self.dtype, self.conv_impl,
                                       self.bn_impl) + y)


class BottleneckResNetBlock(nn.Module):
    """ResNet-50's block: 1x1 conv - BN - ReLU - 3x3 conv (with the stride, as
    torchvision's v1.5) - BN - ReLU - 1x1 conv to 4x filters - BN, plus the
    shortcut, then ReLU."""
    filters: int
    strides: int = 1
    dtype: cnn.Dtype = jnp.float32
    conv_impl: str = "xla"
    bn_impl: str = "flax"
    expansion = 4

    @nn.compact
    def __call__(self, x, train: bool = False):
        y = resnet_conv(self.filters, 1, 1, self.dtype, self.conv_impl)(x)
        y = nn.relu(resnet_norm(train, self.dtype, bn_impl=self.bn_impl)(y))
        y = resnet_conv(self.filters, 3, self.strides, self.dtype, self.conv_impl)(y)
        y = nn.relu(resnet_norm(train, self.dtype, bn_impl=self.bn_impl)(y))
        y = resnet_conv(self.filters * self.expansion, 1, 1, self.dtype,
                        self.conv_impl)(y)
        y = resnet_norm(train, self.dtype, zero_scale=True, bn_impl=self.bn_impl)(y)
        return nn.relu(resnet_shortcut(x, y, self.strides, train, self.dtype, self.conv_impl,
                                       self.bn_impl) + y)


def resnet_shortcut(x, y, strides: int, train: bool, dtype: cnn.Dtype, conv_impl: str = "xla",
                    bn_impl: str = "flax"):
    """x itself, or where the block changes the shape, a strided 1x1 conv and BN of x.
    Called inside a block's __call__, after the branch, so Flax names the projection
    after the branch's layers (Conv_2 and BatchNorm_2 in ResNetBlock)."""
    if x.shape == y.shape:
        return x
    x = resnet_conv(y.shape[-1], 1, strides, dtype, conv_impl)(x)
    return resnet_norm(train, dtype, bn_impl=bn_impl)(x)


class ResNet(nn.Module):
    """ResNet v1.5 (torchvision's layers and parameter counts), after the Flax
    ImageNet example.

    Stem ('imagenet': 7x7 stride-2 conv - BN - ReLU - 3x3 stride-2 max-pool;
    'cifar': 3x3 conv - BN - ReLU; 'auto': resnet_stem's rule on the input's
    size), stages of `stage_sizes` blocks at width, 2x, 4x, 8x width (each stage
    after the first starts with a stride-2 block), global average pool, dense
    head. Convs have no bias (a BN follows each). Computes in `dtype`; params,
    BN statistics and logits are float32.
    """
    stage_sizes: Sequence[int] = (2, 2, 2, 2)
    block_cls: Any = ResNetBlock
    num_classes: int = 1000
    stem: str = "auto"
    width: int = 64
    dtype: cnn.Dtype = jnp.float32
    freeze_batch_stats: bool = False  # BatchNorm normalises with its running statistics
    remat: bool = False  # recompute each block's activations in the backward pass
    conv_impl: str = "xla"  # how convolutions are computed (jaxtrain/models/ops/onednn.py)
    bn_impl: str = "flax"  # which BatchNorm (jaxtrain/models/ops/batchnorm.py)

    @nn.compact
    def __call__(self, x, train: bool = False):
        train = train and not self.freeze_batch_stats  # BatchNorm is its only train-mode layer
        stem = resnet_stem(self.stem, x.shape[1:3])
        x = x.astype(self.dtype)
        if stem == "imagenet":
            x = resnet_conv(self.width, 7, 2, self.dtype, self.conv_impl)(x)
            x = nn.relu(resnet_norm(train, self.dtype, bn_impl=self.bn_impl)(x))
            x = nn.max_pool(x, window_shape=(3, 3), strides=(2, 2), padding=((1, 1), (1, 1)))
        else:
            x = resnet_conv(self.width, 3, 1, self.dtype, self.conv_impl)(x)
            x = nn.relu(resnet_norm(train, self.dtype, bn_impl=self.bn_impl)(x))
        block = cnn.rematted(self.block_cls, self.remat)
        for i, blocks in enumerate(self.stage_sizes):
            for j in range(blocks):
                strides = 2 if i > 0 and j == 0 else 1
                index = sum(self.stage_sizes[:i]) + j
                x = block(self.width * 2 ** i, strides, self.dtype, conv_impl=self.conv_impl,
                          bn_impl=self.bn_impl,
                          name=f"{self.block_cls.__name__}_{index}")(x, train)
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(self.num_classes, dtype=self.dtype)(x).astype(jnp.float32)


# model.name -> (blocks per stage, block): torchvision's resnet18, resnet34, resnet50
RESNETS = {"resnet18": ((2, 2, 2, 2), ResNetBlock),
           "resnet34": ((3, 4, 6, 3), ResNetBlock),
           "resnet50": ((3, 4, 6, 3), BottleneckResNetBlock)}
