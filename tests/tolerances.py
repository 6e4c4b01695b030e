"""How far apart the tests let two computations of the same numbers be, in one place.

Two programs that compute the same function round differently: a sum taken in another
order (XLA's fusion and its split over threads, oneDNN's kernels against XLA's, torch's
against JAX's, an AVX-512 CPU's 16-wide vectors against an AVX2 CPU's 8-wide ones), a
fused multiply-add for a multiply and an add. Each rounding is off by at most the
precision's unit roundoff of the value it rounds, and those errors add at most
linearly along the operations between the inputs and the value compared. So each
tolerance below is the unit roundoff times the operations it covers (counted on the
longest chain: a sum of n terms in a vector unit is about log2(n) + n/16 roundings
deep), and so holds whichever CPU decides the order.

A comparison that must be exact (a resume, the same program twice, a copy) asserts
equality, not one of these. Statistical checks (an initialiser's spread, an
accuracy within a few images) state their own bound where they make it.

Measured on an AMD EPYC with AVX2 (the CPU whose kernels differ most from the AVX-512
Xeon's the literals were fitted on): every difference the tests measure is under half
its tolerance, nearly all under a quarter. None of these is looser than the literal it
replaced, which the Xeon passed.
"""
import numpy as np

FLOAT32 = 2.0 ** -24   # float32's unit roundoff: 24 significant bits
FLOAT64 = 2.0 ** -53
BFLOAT16 = 2.0 ** -8   # 8 significant bits


def rounding(unit: float, operations: int) -> float:
    """The relative difference `operations` roundings of `unit` can make, at most."""
    return unit * operations


# An elementwise function or one normalisation (BatchNorm, pooling, MixUp, a softmax)
# computed in another order or fused differently: ~20 operations.
ELEMENTWISE = rounding(FLOAT32, 20)                  # 1.2e-6
# One forward and backward pass of a small network (a few layers, each a sum of up to
# ~10^3 terms) in another order: oneDNN against XLA, a jitted step against the same
# ops one by one, a vmapped replica against its own run, 1 device against 8.
NETWORK_PASS = rounding(FLOAT32, 200)                # 1.2e-5
# A few training steps in float32 (each step's differences feed the next), a deep
# network's pass (a ResNet, a ViT), or two frameworks' kernels (torch against XLA).
TRAINING_STEPS = rounding(FLOAT32, 2000)             # 1.2e-4
# A value computed in bfloat16 against float32: a few roundings of 2^-8.
BFLOAT16_PASS = rounding(BFLOAT16, 4)                # 1.6e-2
# A chain of bfloat16 roundings against float32: a network's backward pass in bfloat16
# (of the gradient's norm), Newton-Schulz's iterations (of the largest entry): ~16.
BFLOAT16_STEPS = rounding(BFLOAT16, 16)              # 6.2e-2
# A float32 whitening kernel (the eigenvectors of a 12x12 patch covariance, divided by
# the square roots of their eigenvalues) against float64's: a direction's rounding grows
# with the covariance's condition number, 10^4-10^5 on CIFAR-10 patches.
WHITENING = rounding(FLOAT32, 2 ** 15)               # 2.0e-3
# A float64 statistic of a dataset split (a channel's mean or spread over up to 10^7
# values) summed in any order: one rounding a value, at most.
FLOAT64_DATASET = rounding(FLOAT64, 10 ** 7)         # 1.1e-9


def assert_close(got, want, relative: float, *, floor: float = 0.0, err_msg: str = ""):
    """|got - want| <= relative * |want| + floor * max|want|, elementwise.

    `floor` is for values near zero whose error comes from larger neighbours (a
    gradient that is zero in exact arithmetic, a probability of 1e-9): it bounds
    their difference by the largest entry's size instead of their own."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    scale = float(np.max(np.abs(want))) if want.size else 0.0
    np.testing.assert_allclose(got, want, rtol=relative, atol=floor * scale, err_msg=err_msg)
