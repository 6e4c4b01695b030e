"""Vision Transformers (ViT) with timm's architecture, so timm's weights map 1:1.

The layers compute what timm's `VisionTransformer` computes for
vit_{tiny,small,base}_patch16_224, and they are named so a timm state_dict key
becomes a Flax path by one rule (see `torch_paths`): split the key on '.', glue a
number to the piece before it with '_', and call the leaf `weight` `kernel`
(Dense, Conv) or `scale` (LayerNorm). 'blocks.3.attn.qkv.weight' is
params['blocks_3']['attn']['qkv']['kernel'].

Inputs are (N, H, W, C) normalised images with H and W multiples of the patch
size; the number of position embeddings follows the input's grid, and
`resample_pos_embed` resizes a table made for another image size as timm does.
"""
import re
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from jaxtrain.models.ops import onednn

Dtype = Any

# model.name -> (dim, depth, heads): timm's vit_{tiny,small,base}_patch16_224
VITS = {"vit_tiny": (192, 12, 3), "vit_small": (384, 12, 6), "vit_base": (768, 12, 12)}

LAYER_NORM_EPS = 1e-6  # timm's ViT LayerNorm (torch's default is 1e-5)

# timm's init: Linear weights N(0, 0.02) (its trunc_normal_ cuts at +-2, i.e. 100 std:
# no cut), zero biases; the patch conv keeps torch's default; cls_token N(0, 1e-6).
dense_init = nn.initializers.normal(0.02)
pos_embed_init = nn.initializers.normal(0.02)
cls_token_init = nn.initializers.normal(1e-6)


def torch_conv_bias_init(fan_in: int):
    """torch's default Conv2d bias init U(-1/sqrt(fan_in), 1/sqrt(fan_in)), which timm
    keeps for the patch embedding."""
    bound = 1.0 / np.sqrt(fan_in)

    def init(key, shape, dtype=jnp.float32):
        return jax.random.uniform(key, shape, dtype, -bound, bound)

    return init


def layer_norm(name: str, dtype: Dtype) -> nn.LayerNorm:
    # use_fast_variance=False: the mean of squared deviations, as torch computes it
    return nn.LayerNorm(epsilon=LAYER_NORM_EPS, use_fast_variance=False, dtype=dtype, name=name)


def dense(features: int, name: str, dtype: Dtype) -> nn.Dense:
    return nn.Dense(features, kernel_init=dense_init, dtype=dtype, name=name)


class Attention(nn.Module):
    """Multi-head self-attention: one fused qkv projection (timm's q, k, v order, heads
    inside each), softmax(q k^T / sqrt(head_dim)) v in float32, output projection."""
    dim: int
    heads: int
    dropout: float = 0.0
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x, train: bool = False):
        n, tokens, _ = x.shape
        head_dim = self.dim // self.heads
        qkv = dense(3 * self.dim, "qkv", self.dtype)(x)
        q, k, v = qkv.reshape(n, tokens, 3, self.heads, head_dim).transpose(2, 0, 3, 1, 4)
        logits = jnp.einsum("bhqd,bhkd->bhqk", q, k).astype(jnp.float32) * head_dim ** -0.5
        weights = jax.nn.softmax(logits, axis=-1).astype(self.dtype)
        x = jnp.einsum("bhqk,bhkd->bqhd", weights, v).reshape(n, tokens, self.dim)
        x = dense(self.dim, "proj", self.dtype)(x)
        return nn.Dropout(self.dropout, deterministic=not train)(x)


class Mlp(nn.Module):
    """fc1 to hidden features, exact (erf) GELU, fc2 back; dropout after each, as
    timm's Mlp (drop1, drop2)."""
    dim: int
    hidden: int
    dropout: float = 0.0
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.gelu(dense(self.hidden, "fc1", self.dtype)(x), approximate=False)
        x = nn.Dropout(self.dropout, deterministic=not train)(x)
        x = dense(self.dim, "fc2", self.dtype)(x)
        return nn.Dropout(self.dropout, deterministic=not train)(x)


def stochastic_depth(x, rate: float, train: bool):
    """Stochastic depth: drops a residual branch for whole samples, scaling the kept
    ones by 1 / (1 - rate), as timm's DropPath."""
    return nn.Dropout(rate, broadcast_dims=tuple(range(1, x.ndim)), deterministic=not train)(x)


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm1(x)), then x + mlp(norm2(x)), each
    branch under its own stochastic-depth mask."""
    dim: int
    heads: int
    mlp_ratio: float = 4
    dropout: float = 0.0
    drop_path: float = 0.0
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x, train: bool = False):
        y = layer_norm("norm1", self.dtype)(x)
        y = Attention(self.dim, self.heads, self.dropout, self.dtype, name="attn")(y, train)
        x = x + stochastic_depth(y, self.drop_path, train)
        y = layer_norm("norm2", self.dtype)(x)
        y = Mlp(self.dim, int(self.dim * self.mlp_ratio), self.dropout, self.dtype,
                name="mlp")(y, train)
        return x + stochastic_depth(y, self.drop_path, train)


class PatchEmbed(nn.Module):
    """Non-overlapping patch_size x patch_size patches, each projected to `dim` by one
    strided conv (with bias): (N, H, W, C) -> (N, H/p * W/p, dim), row-major."""
    dim: int
    patch_size: int = 16
    dtype: Dtype = jnp.float32
    conv_impl: str = "xla"  # how the patch conv is computed (jaxtrain/models/ops/onednn.py)

    @nn.compact
    def __call__(self, x):
        p = self.patch_size
        x = nn.Conv(self.dim, (p, p), strides=(p, p), padding="VALID", dtype=self.dtype,
                    conv_general_dilated=onednn.conv_function(self.conv_impl),
                    kernel_init=nn.initializers.variance_scaling(1 / 3, "fan_in", "uniform"),
                    bias_init=torch_conv_bias_init(p * p * x.shape[-1]), name="proj")(x)
        return x.reshape(x.shape[0], -1, self.dim)


class ViT(nn.Module):
    """timm's VisionTransformer (class token, position embeddings that include the
    class token's, pre-norm blocks, final LayerNorm, a dense head on the class token).

    `dropout` is timm's proj_drop_rate (after the attention projection and after
    each MLP layer); `drop_path` the last block's stochastic-depth rate, rising
    linearly from 0 at the first block. Both act only with train=True (and a
    'dropout' rng). Computes in `dtype`; params are float32, logits float32.
    """
    num_classes: int
    dim: int
    depth: int
    heads: int
    patch_size: int = 16
    mlp_ratio: float = 4
    dropout: float = 0.0
    drop_path: float = 0.0
    dtype: Dtype = jnp.float32
    remat: bool = False  # recompute each block's activations in the backward pass
    conv_impl: str = "xla"  # how the patch conv is computed (jaxtrain/models/ops/onednn.py)

    @nn.compact
    def __call__(self, x, train: bool = False):
        height, width = x.shape[1:3]
        if height % self.patch_size or width % self.patch_size:
            raise ValueError(f"ViT: image size {height}x{width} is not a multiple of the "
                             f"patch size {self.patch_size}")
        x = PatchEmbed(self.dim, self.patch_size, self.dtype, self.conv_impl,
                       name="patch_embed")(
            x.astype(self.dtype))
        n, tokens, _ = x.shape
        cls_token = self.param("cls_token", cls_token_init, (1, 1, self.dim))
        pos_embed = self.param("pos_embed", pos_embed_init, (1, 1 + tokens, self.dim))
        x = jnp.concatenate([jnp.broadcast_to(cls_token.astype(self.dtype), (n, 1, self.dim)),
                             x], axis=1)
        x = x + pos_embed.astype(self.dtype)
        # timm's torch.linspace(0, drop_path, depth): block i's rate
        rates = np.linspace(0.0, self.drop_path, self.depth)
        # nn.remat (cnn.rematted; vit.py does not import models): train stays static
        block = nn.remat(Block, static_argnums=(2,)) if self.remat else Block
        for i in range(self.depth):
            x = block(self.dim, self.heads, self.mlp_ratio, self.dropout, float(rates[i]),
                      self.dtype, name=f"blocks_{i}")(x, train)
        x = layer_norm("norm", self.dtype)(x)
        x = dense(self.num_classes, "head", self.dtype)(x[:, 0])
        return x.astype(jnp.float32)


# ---------------------------------------------------------------- timm's names

LEAF_NAMES = {"kernel": "weight", "scale": "weight", "bias": "bias"}


def torch_key(path) -> str:
    """The timm state_dict key of a Flax param path: ('blocks_0', 'attn', 'qkv', 'kernel')
    -> 'blocks.0.attn.qkv.weight'; top-level params (cls_token, pos_embed) keep their name."""
    *scopes, leaf = path
    pieces = [re.sub(r"_(\d+)$", r".\1", scope) for scope in scopes]
    return ".".join(pieces + [LEAF_NAMES[leaf] if scopes else leaf])


def torch_paths(params) -> dict[str, tuple[str, ...]]:
    """Every timm state_dict key of this model -> its Flax param path, from a params tree
    (arrays or jax.ShapeDtypeStructs, e.g. jax.eval_shape(model.init, ...)['params']).

    A Dense kernel is the torch weight transposed, a Conv kernel (HWIO) the torch
    weight (OIHW) transposed by (2, 3, 1, 0); every other param has timm's shape.
    """
    return {torch_key(path): path for path in traverse_util.flatten_dict(params)}


# ---------------------------------------------------------------- position embeddings

def _cubic(x, a: float):
    """Keys' cubic convolution kernel; torch's bicubic uses a=-0.75, its antialiased
    bicubic (as PIL) a=-0.5."""
    x = np.abs(x)
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return np.where(x <= 1, near, np.where(x < 2, far, 0.0))


def cubic_weights(size_in: int, size_out: int, antialias: bool) -> np.ndarray:
    """(size_out, size_in) float64 matrix of torch's F.interpolate(mode='bicubic',
    align_corners=False) along one axis.

    Without antialias: 4 taps a=-0.75 around the source point, indices clamped to
    the edge. With antialias (torch's separable AA path, PIL's filter): a=-0.5
    stretched by the downscale factor, the taps outside the image dropped and the
    rest renormalised to sum to 1.
    """
    scale = size_in / size_out
    weights = np.zeros((size_out, size_in))
    for i in range(size_out):
        if antialias:
            support = 2.0 * scale if scale >= 1 else 2.0
            inverse = 1.0 / scale if scale >= 1 else 1.0
            center = scale * (i + 0.5)
            low = max(int(center - support + 0.5), 0)  # int(): C++'s cast, toward zero
            high = min(int(center + support + 0.5), size_in)
            taps = np.arange(low, high)
            w = _cubic((taps - center + 0.5) * inverse, -0.5)
            weights[i, taps] = w / w.sum() if w.sum() != 0 else w
        else:
            source = scale * (i + 0.5) - 0.5
            first = int(np.floor(source))
            t = source - first
            for offset, distance in zip(range(-1, 3), (t + 1, t, 1 - t, 2 - t)):
                weights[i, min(max(first + offset, 0), size_in - 1)] += _cubic(distance, -0.75)
    return weights


def resample_pos_embed(pos_embed: np.ndarray, grid: tuple[int, int],
                       antialias: bool = True) -> np.ndarray:
    """A (1, 1 + h0*w0, D) position table (square grid h0 = w0) for a (h, w) patch grid:
    (1, 1 + h*w, D), the class token's row kept, the grid resized by bicubic
    interpolation.

    This is timm's resample_abs_pos_embed as timm's checkpoint_filter_fn calls it
    (bicubic, antialias=True, align_corners=False) when it loads weights for
    another image size; antialias=False is its plain bicubic (a=-0.75).
    """
    pos_embed = np.asarray(pos_embed)
    tokens = pos_embed.shape[1] - 1
    side = int(round(np.sqrt(tokens)))
    if pos_embed.ndim != 3 or pos_embed.shape[0] != 1 or side * side != tokens:
        raise ValueError(f"resample_pos_embed: expected (1, 1 + n*n, D) with a class token "
                         f"and a square grid, got shape {pos_embed.shape}")
    height, width = grid
    if (height, width) == (side, side):
        return pos_embed
    table = pos_embed[0, 1:].reshape(side, side, -1).astype(np.float64)
    table = np.einsum("ih,hwd,jw->ijd", cubic_weights(side, height, antialias), table,
                      cubic_weights(side, width, antialias))
    table = table.reshape(1, height * width, -1).astype(pos_embed.dtype)
    return np.concatenate([pos_embed[:, :1], table], axis=1)
