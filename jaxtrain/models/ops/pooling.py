"""2x2 max-pooling whose gradient XLA:CPU runs fast (model.pool_impl).

lax's max-pool (nn.max_pool) is a windowed reduction whose gradient is
select-and-scatter. XLA:CPU expands that into index arithmetic (iotas, another windowed
reduction and a scatter), many times its forward pass (BENCHMARKS.md, "Convolutional nets
on the CPU"). 'corners' computes the same
2x2 pool as the maximum of the four strided views of its windows' corners, and its
gradient as four masked copies of the incoming gradient, each window's first maximum
taking it, in select-and-scatter's own scan order: the same numbers to the bit, ties
included (tests/test_pooling.py), and faster there. GPUs keep lax's ('auto' chooses
'corners' on a CPU only).
"""
import flax.linen as nn
import jax
import jax.numpy as jnp

POOL_IMPLS = ("auto", "xla", "corners")


def resolve(pool_impl: str) -> str:
    """model.pool_impl 'auto' as this backend's choice."""
    if pool_impl == "auto":
        return "corners" if jax.default_backend() == "cpu" else "xla"
    if pool_impl not in POOL_IMPLS:
        raise ValueError(f"unknown model.pool_impl {pool_impl!r}; choose one of: "
                         + ", ".join(POOL_IMPLS))
    return pool_impl


def max_pool_2x2(x, pool_impl: str = "xla"):
    """nn.max_pool(x, (2, 2), strides=(2, 2)) of NHWC x (an odd last row or column is
    dropped), computed as model.pool_impl says."""
    if resolve(pool_impl) == "corners":
        return corners_max_pool(x)
    return nn.max_pool(x, window_shape=(2, 2), strides=(2, 2))


def window_corners(x):
    """The four (N, H // 2, W // 2, C) views of x's 2x2 windows, in select-and-scatter's
    scan order: (0, 0), (0, 1), (1, 0), (1, 1)."""
    height, width = x.shape[1] // 2 * 2, x.shape[2] // 2 * 2
    return [x[:, i:height:2, j:width:2] for i in (0, 1) for j in (0, 1)]


@jax.custom_vjp
def corners_max_pool(x):
    top_left, top_right, bottom_left, bottom_right = window_corners(x)
    return jnp.maximum(jnp.maximum(top_left, top_right), jnp.maximum(bottom_left, bottom_right))


def _forward(x):
    pooled = corners_max_pool(x)
    return pooled, (x, pooled)


def _backward(saved, grad):
    x, pooled = saved
    taken = jnp.zeros(pooled.shape, bool)
    parts = []
    for corner in window_corners(x):  # each window's first maximum takes its gradient
        hit = (corner == pooled) & ~taken
        taken = taken | hit
        parts.append(jnp.where(hit, grad, jnp.zeros((), grad.dtype)))
    n, height, width, channels = pooled.shape
    windows = jnp.stack(parts, axis=3).reshape(n, height, width, 2, 2, channels)
    windows = windows.transpose(0, 1, 3, 2, 4, 5).reshape(n, 2 * height, 2 * width, channels)
    dropped = ((0, 0), (0, x.shape[1] - 2 * height), (0, x.shape[2] - 2 * width), (0, 0))
    return (jnp.pad(windows, dropped),)


corners_max_pool.defvjp(_forward, _backward)
