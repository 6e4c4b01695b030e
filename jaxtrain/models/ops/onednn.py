"""2-D convolutions on the CPU through oneDNN (model.conv_impl).

XLA:CPU runs a convolution's weight gradient slowly and puts layout copies around it
(BENCHMARKS.md, "Convolutional nets on the CPU", has the figures). 'onednn' hands the forward
pass and both gradients of each float32 2-D convolution to oneDNN (the library PyTorch
uses on a CPU) as XLA FFI custom calls (jax.ffi): jaxtrain/models/ops/onednn_conv.cc, compiled on
first use, once per machine, against the oneDNN wheel of the `cpu` extra and jaxlib's
FFI headers. Each call runs on XLA's own threads (a batch slice each), so no second
thread pool competes with XLA's. The same function as lax's to float32 rounding
(tests/test_onednn.py); anything it does not cover (another dtype, grouped or
input-dilated convolutions, other layouts) stays lax's. 'auto' takes it on a single CPU
device when it builds; a program sharded over devices, an export and GPUs keep lax's.
"""
import ctypes
import functools
import hashlib
import logging
import math
import os
import subprocess
import sys
import sysconfig
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxtrain.errors import ConfigError

CONV_IMPLS = ("auto", "xla", "onednn")
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "onednn_conv.cc")
TARGETS = {"forward": "JaxtrainConvForward", "input_grad": "JaxtrainConvInputGrad",
           "kernel_grad": "JaxtrainConvKernelGrad"}
FFI_PREFIX = "jaxtrain_onednn_conv_"
INSTALL_HINT = "pip install 'jaxtrain[cpu]' (onednn-devel-cpu-gomp) and a C++ compiler (g++)"
BUILD_DIR = "~/.cache/jaxtrain/onednn"  # beside train.compilation_cache's default


class Unavailable(ConfigError):
    """oneDNN's convolutions cannot be built or loaded here; the message says why."""


def _prefixes():
    """Where a pip-installed oneDNN puts include/ and lib/: this environment's prefix
    (a virtualenv's too), then the base and user installs."""
    seen = []
    for prefix in (sys.prefix, sys.base_prefix, sysconfig.get_config_var("userbase") or ""):
        if prefix and prefix not in seen:
            seen.append(prefix)
    return seen


def _find_onednn():
    """(include folder, lib folder) of the first prefix holding oneDNN's C++ header and
    its shared library."""
    for prefix in _prefixes():
        include, lib = os.path.join(prefix, "include"), os.path.join(prefix, "lib")
        header = os.path.join(include, "oneapi", "dnnl", "dnnl.hpp")
        libraries = os.listdir(lib) if os.path.isdir(lib) else []
        if os.path.isfile(header) and any(name.startswith("libdnnl.so") for name in libraries):
            return include, lib
    raise Unavailable(f"oneDNN 3's headers and library were not found under {sys.prefix}; "
                      f"{INSTALL_HINT}")


def build() -> str:
    """The compiled library's path: built on first use into BUILD_DIR, named by a hash
    of the source, the jaxlib and the command it was built with; written atomically, so
    parallel processes building at once are safe."""
    include, lib = _find_onednn()
    compiler = os.environ.get("CXX", "g++")
    flags = ["-O2", "-std=c++17", "-shared", "-fPIC", "-fopenmp", "-w",
             f"-I{jax.ffi.include_dir()}", f"-I{include}", f"-L{lib}", "-ldnnl",
             f"-Wl,-rpath,{lib}"]
    with open(SOURCE, "rb") as source:
        digest = hashlib.sha256(source.read() + jax.__version__.encode()
                                + " ".join([compiler, *flags]).encode()).hexdigest()[:16]
    directory = os.path.expanduser(BUILD_DIR)
    target = os.path.join(directory, f"onednn_conv-{digest}.so")
    if os.path.isfile(target):
        return target
    try:
        os.makedirs(directory, exist_ok=True)
        handle, partial = tempfile.mkstemp(suffix=".so", dir=directory)
    except OSError as error:
        raise Unavailable(f"cannot build oneDNN's convolutions in {directory}: "
                          f"{error.strerror}") from None
    os.close(handle)
    try:
        done = subprocess.run([compiler, SOURCE, *flags, "-o", partial], capture_output=True,
                              text=True)
    except FileNotFoundError:
        os.unlink(partial)
        raise Unavailable(f"no C++ compiler ({compiler}) to build oneDNN's convolutions; "
                          f"{INSTALL_HINT}") from None
    if done.returncode:
        os.unlink(partial)
        first = next((line for line in done.stderr.splitlines() if "error" in line),
                     done.stderr.strip()[:200] or f"{compiler} exited with {done.returncode}")
        raise Unavailable(f"building {os.path.basename(SOURCE)} failed: {first}")
    os.replace(partial, target)
    return target


@functools.lru_cache(maxsize=None)
def _load() -> str:
    """Builds and registers the three FFI targets once per process; '' when it worked,
    else the reason it did not (cached too: one failed build is not retried per layer)."""
    try:
        path = build()
    except Unavailable as error:
        return str(error)
    try:
        library = ctypes.cdll.LoadLibrary(path)
    except OSError as error:
        return f"loading {path} failed ({error}); delete it to build it again"
    for kind, symbol in TARGETS.items():
        handler = jax.ffi.pycapsule(getattr(library, symbol))
        jax.ffi.register_ffi_target(FFI_PREFIX + kind, handler, platform="cpu")
    return ""


def available() -> tuple[bool, str]:
    """(True, '') when oneDNN's convolutions are built and registered, else (False, why)."""
    reason = _load()
    return not reason, reason


def resolve(conv_impl: str) -> str:
    """model.conv_impl 'auto' as this machine's choice: 'onednn' on a single CPU device
    where it builds (a program sharded over devices keeps lax's, which XLA's partitioner
    splits), else 'xla', saying once why a CPU goes without. An explicit 'onednn' that
    cannot be had is an Unavailable error (one line)."""
    if conv_impl not in CONV_IMPLS:
        raise ConfigError(f"config.model.conv_impl={conv_impl!r}: choose one of "
                          + ", ".join(CONV_IMPLS))
    if conv_impl == "xla":
        return "xla"
    if jax.default_backend() != "cpu":
        if conv_impl == "onednn":
            raise Unavailable(f"config.model.conv_impl='onednn' runs on a CPU only; this "
                              f"backend is {jax.default_backend()} (use 'auto' or 'xla')")
        return "xla"
    if jax.device_count() > 1:
        if conv_impl == "onednn":
            raise Unavailable(f"config.model.conv_impl='onednn' runs on one device; this run "
                              f"has {jax.device_count()} (use 'auto' or 'xla')")
        return "xla"
    ok, reason = available()
    if ok:
        return "onednn"
    if conv_impl == "onednn":
        raise Unavailable(f"config.model.conv_impl='onednn': {reason}")
    _say_once(f"model.conv_impl='auto' uses XLA's convolutions, about 2x slower on a CPU: "
              f"{reason}")
    return "xla"


@functools.lru_cache(maxsize=None)
def _say_once(message: str) -> None:
    logging.warning(message)


def _call(kind: str, out_shape, a, b, strides, dilation, padding):
    reason = _load()  # registers the targets in this process, once
    if reason:
        raise Unavailable(f"config.model.conv_impl='onednn': {reason}")
    return jax.ffi.ffi_call(FFI_PREFIX + kind, jax.ShapeDtypeStruct(out_shape, jnp.float32),
                            vmap_method="sequential")(
        a, b, strides=np.asarray(strides, np.int64), dilation=np.asarray(dilation, np.int64),
        padding=np.asarray(padding, np.int64))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def onednn_conv(x, kernel, strides, dilation, padding):
    """NHWC x, HWIO kernel, float32: lax.conv_general_dilated's result through oneDNN.
    padding: (top, bottom, left, right); dilation: the kernel's."""
    return _call("forward", _out_shape(x.shape, kernel.shape, strides, dilation, padding),
                 x, kernel, strides, dilation, padding)


def _out_shape(x_shape, kernel_shape, strides, dilation, padding):
    n, h, w, _ = x_shape
    kh, kw, _, o = kernel_shape
    span_h, span_w = (kh - 1) * dilation[0] + 1, (kw - 1) * dilation[1] + 1
    return (n, (h + padding[0] + padding[1] - span_h) // strides[0] + 1,
            (w + padding[2] + padding[3] - span_w) // strides[1] + 1, o)


def _forward(x, kernel, strides, dilation, padding):
    return onednn_conv(x, kernel, strides, dilation, padding), (x, kernel)


def _backward(strides, dilation, padding, saved, grad):
    x, kernel = saved
    dx = _call("input_grad", x.shape, grad, kernel, strides, dilation, padding)
    dkernel = _call("kernel_grad", kernel.shape, x, grad, strides, dilation, padding)
    return dx, dkernel


onednn_conv.defvjp(_forward, _backward)


def call_flops(target_name: str, operand_shapes, result_shapes) -> int | None:
    """FLOPs (2 x multiply-adds) of one of these FFI calls, from its shapes; None for
    another target. Each of the three does the forward convolution's multiply-adds: one
    per element of the output (or its gradient) and kernel element over output channels."""
    kind = target_name[len(FFI_PREFIX):] if target_name.startswith(FFI_PREFIX) else None
    if kind not in TARGETS:
        return None
    output, kernel = {"forward": (result_shapes[0], operand_shapes[1]),
                      "input_grad": (operand_shapes[0], operand_shapes[1]),
                      "kernel_grad": (operand_shapes[1], result_shapes[0])}[kind]
    return 2 * math.prod(output) * math.prod(kernel) // kernel[-1]


NHWC = ("NHWC", "HWIO", "NHWC")


def _covered(lhs, rhs, lhs_dilation, dimension_numbers, feature_group_count,
             batch_group_count, preferred_element_type) -> bool:
    """Whether oneDNN takes this convolution: 2-D, float32, NHWC/HWIO, ungrouped."""
    if lhs.ndim != 4 or rhs.ndim != 4:
        return False
    if lhs.dtype != jnp.float32 or rhs.dtype != jnp.float32:
        return False
    if preferred_element_type not in (None, jnp.float32):
        return False
    if feature_group_count != 1 or batch_group_count != 1:
        return False
    if lhs_dilation is not None and tuple(lhs_dilation) != (1, 1):
        return False
    expected = lax.conv_dimension_numbers(lhs.shape, rhs.shape, NHWC)
    given = lax.conv_dimension_numbers(lhs.shape, rhs.shape, dimension_numbers)
    return given == expected


def conv_general_dilated(lhs, rhs, window_strides, padding, lhs_dilation=None,
                         rhs_dilation=None, dimension_numbers=None, feature_group_count=1,
                         batch_group_count=1, precision=None, preferred_element_type=None):
    """lax.conv_general_dilated, through oneDNN where it covers the case (flax.linen.Conv
    takes this as its `conv_general_dilated`)."""
    if not _covered(lhs, rhs, lhs_dilation, dimension_numbers, feature_group_count,
                    batch_group_count, preferred_element_type):
        return lax.conv_general_dilated(
            lhs, rhs, window_strides, padding, lhs_dilation=lhs_dilation,
            rhs_dilation=rhs_dilation, dimension_numbers=dimension_numbers,
            feature_group_count=feature_group_count, batch_group_count=batch_group_count,
            precision=precision, preferred_element_type=preferred_element_type)
    dilation = tuple(rhs_dilation or (1, 1))
    if isinstance(padding, str):
        span = [(k - 1) * d + 1 for k, d in zip(rhs.shape[:2], dilation)]
        pads = lax.padtype_to_pads(lhs.shape[1:3], span, window_strides, padding)
    else:
        pads = padding
    (top, bottom), (left, right) = pads
    if min(top, bottom, left, right) < 0:  # a cropping "padding": lax's
        return lax.conv_general_dilated(lhs, rhs, window_strides, padding,
                                        rhs_dilation=rhs_dilation,
                                        dimension_numbers=dimension_numbers, precision=precision)
    return onednn_conv(lhs, rhs, tuple(window_strides), dilation, (top, bottom, left, right))


def conv_function(conv_impl: str):
    """What flax.linen.Conv's `conv_general_dilated` should be for a resolved conv_impl."""
    return conv_general_dilated if conv_impl == "onednn" else lax.conv_general_dilated
