"""BatchNorm that keeps its input, not float32 copies of it, for the backward pass
(model.bn_impl='lean').

Flax's nn.BatchNorm computes in float32 by promoting its input: with bfloat16
activations, JAX's autodiff keeps two float32 tensors the size of the input for the
backward pass (x - mean, and 2x: the derivative of E[x^2]), 8 bytes an element
where the input itself is 2. This BatchNorm computes the same forward numbers in the
same float32 arithmetic, but its gradient is written out (a jax.custom_vjp): it keeps
the input in its own dtype plus per-channel float32 statistics, and recomputes the
rest in the backward pass. The speedrun's cifar_cnn at batch 2000 (the VJP's
residuals, before XLA, which may fuse some away on its own): 892.6 MiB of float32
activations kept with Flax's; with this one none, and 223.2 MiB of bfloat16 inputs
(docs/models.md).

Variables, their names, shapes and dtypes are nn.BatchNorm's (params 'scale' and
'bias', batch_stats 'mean' and 'var'), and the running averages move as Flax's do, so
checkpoints and model.init_from weights load into either. Normalises over every axis
but the last; no axis_name or mask (what jaxtrain's built-in models use).
"""
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

BN_IMPLS = ("flax", "lean")


def module(bn_impl: str):
    """The BatchNorm class `model.bn_impl` names: Flax's nn.BatchNorm or this one."""
    if bn_impl == "flax":
        return nn.BatchNorm
    if bn_impl == "lean":
        return BatchNorm
    raise ValueError(f"unknown model.bn_impl {bn_impl!r}; choose one of: " + ", ".join(BN_IMPLS))


def _channel_axes(x):
    return tuple(range(x.ndim - 1))


def _normalize(x, mean, var, scale, bias, epsilon, dtype):
    """Flax's arithmetic in Flax's order: (x - mean) * (rsqrt(var + eps) * scale) + bias in
    float32, then `dtype`. scale and bias may be None (not used)."""
    y = x.astype(jnp.float32) - mean
    multiplier = lax.rsqrt(var + epsilon)
    if scale is not None:
        multiplier = multiplier * scale
    y = y * multiplier
    if bias is not None:
        y = y + bias
    return y.astype(dtype)


def _statistics(x):
    """Flax's batch statistics (use_fast_variance): the mean and E[x^2] - mean^2, clipped
    at 0, in float32; and the clipped value before clipping (the gradient's switch)."""
    x = x.astype(jnp.float32)
    axes = _channel_axes(x)
    mean = x.mean(axes)
    unclipped = lax.square(x).mean(axes) - lax.square(mean)
    return mean, jnp.maximum(0.0, unclipped), unclipped


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def batch_normalize(x, scale, bias, epsilon: float, dtype):
    """(normalised x in `dtype`, batch mean, batch variance) by the batch's own statistics."""
    mean, var, _ = _statistics(x)
    return _normalize(x, mean, var, scale, bias, epsilon, dtype), mean, var


def _batch_forward(x, scale, bias, epsilon, dtype):
    mean, var, unclipped = _statistics(x)
    inverse_std = lax.rsqrt(var + epsilon)
    # jnp.maximum's gradient: 1 above the clip, 1/2 at a tie, 0 below
    var_switch = jnp.where(unclipped > 0, 1.0, jnp.where(unclipped == 0, 0.5, 0.0))
    saved = (x, mean, inverse_std, var_switch, scale, bias)  # bias: per-channel, for its dtype
    return (_normalize(x, mean, var, scale, bias, epsilon, dtype), mean, var), saved


def _batch_backward(epsilon, dtype, saved, cotangents):
    """dL/dx = g * a + c0 + c1 * (x - mean) with per-channel a, c0, c1 (float32), where g
    is dL/dy; the statistics' own cotangents (zero when only the loss is differentiated)
    enter through c0 and c1."""
    del epsilon, dtype
    x, mean, inverse_std, var_switch, scale, bias = saved
    g, g_mean, g_var = cotangents
    axes = _channel_axes(x)
    count = x.size // x.shape[-1]
    g = g.astype(jnp.float32)
    centred = x.astype(jnp.float32) - mean
    sum_g = g.sum(axes)
    sum_g_normalised = (g * (centred * inverse_std)).sum(axes)  # dL/dscale
    a = inverse_std if scale is None else inverse_std * scale
    # dL/dvar through y (rsqrt's derivative) plus the variance's own cotangent
    d_var = var_switch * (g_var - 0.5 * a * inverse_std * sum_g_normalised)
    c0 = (g_mean - a * sum_g) / count
    c1 = 2.0 * d_var / count
    d_x = (g * a + c0 + c1 * centred).astype(x.dtype)
    d_scale = None if scale is None else sum_g_normalised.astype(scale.dtype)
    d_bias = None if bias is None else sum_g.astype(bias.dtype)
    return d_x, d_scale, d_bias


batch_normalize.defvjp(_batch_forward, _batch_backward)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def running_normalize(x, mean, var, scale, bias, epsilon: float, dtype):
    """x normalised by given statistics (the running averages), in `dtype`."""
    return _normalize(x, mean, var, scale, bias, epsilon, dtype)


def _running_forward(x, mean, var, scale, bias, epsilon, dtype):
    saved = (x, mean, lax.rsqrt(var + epsilon), scale, bias)
    return _normalize(x, mean, var, scale, bias, epsilon, dtype), saved


def _running_backward(epsilon, dtype, saved, g):
    del epsilon, dtype
    x, mean, inverse_std, scale, bias = saved
    axes = _channel_axes(x)
    g = g.astype(jnp.float32)
    sum_g = g.sum(axes)
    sum_g_normalised = (g * ((x.astype(jnp.float32) - mean) * inverse_std)).sum(axes)
    a = inverse_std if scale is None else inverse_std * scale
    d_x = (g * a).astype(x.dtype)
    d_mean = -a * sum_g
    d_var = -0.5 * a * inverse_std * sum_g_normalised
    d_scale = None if scale is None else sum_g_normalised.astype(scale.dtype)
    d_bias = None if bias is None else sum_g.astype(bias.dtype)
    return d_x, d_mean, d_var, d_scale, d_bias


running_normalize.defvjp(_running_forward, _running_backward)


class BatchNorm(nn.Module):
    """nn.BatchNorm (last-axis features) with a backward pass that keeps only its input
    in its dtype and per-channel float32 statistics. The fields mean what nn.BatchNorm's
    do; its name (BatchNorm_N) and variables are the same."""
    use_running_average: bool | None = None
    momentum: float = 0.99
    epsilon: float = 1e-5
    dtype: Any = None
    param_dtype: Any = jnp.float32
    use_bias: bool = True
    use_scale: bool = True
    bias_init: Any = nn.initializers.zeros
    scale_init: Any = nn.initializers.ones

    @nn.compact
    def __call__(self, x, use_running_average: bool | None = None):
        use_running_average = nn.merge_param(
            "use_running_average", self.use_running_average, use_running_average)
        features = (x.shape[-1],)
        ra_mean = self.variable("batch_stats", "mean",
                                lambda s: jnp.zeros(s, jnp.float32), features)
        ra_var = self.variable("batch_stats", "var",
                               lambda s: jnp.ones(s, jnp.float32), features)
        scale = (self.param("scale", self.scale_init, features, self.param_dtype)
                 if self.use_scale else None)
        bias = (self.param("bias", self.bias_init, features, self.param_dtype)
                if self.use_bias else None)
        # nn.BatchNorm's output dtype: `dtype`, else what x, scale and bias promote to
        dtype = self.dtype or jnp.result_type(*(v for v in (x, scale, bias) if v is not None))
        if use_running_average:
            return running_normalize(x, ra_mean.value, ra_var.value, scale, bias,
                                     self.epsilon, dtype)
        y, mean, var = batch_normalize(x, scale, bias, self.epsilon, dtype)
        if not self.is_initializing():
            ra_mean.value = self.momentum * ra_mean.value + (1 - self.momentum) * mean
            ra_var.value = self.momentum * ra_var.value + (1 - self.momentum) * var
        return y
