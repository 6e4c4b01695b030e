"""Less LLVM optimisation for the programs the tests compile: in their subprocesses
(XLA_FLAGS, `env`) and while a module's tests run in this process (`in_process`, the
`compile_quickly` fixture of conftest.py).

On the CPU most of a model's compile time is LLVM optimising the generated code, the
threefry kernels of a random init most of all: ResNet-18's init compiles in 13 s at
XLA's default (-O2) and in 2.6 s at -O0, the seed CNN recipe's whole main.py run takes
12 s of CPU instead of 7.5. At -O0 the programs run about 2x slower, which runs of a few
small steps do not notice; at -O1 they compile almost as fast and run as fast as at -O2
(ResNet-18's steps on 8 CPU devices: -O0 would cost more than it saves). XLA's own passes
(SPMD partitioning, fusion, collectives) are the same at every level, and so is what the
tests check; results differ from -O2's by float rounding only (like those of another
device count), so every run a test compares with another is compiled at the same level.
Two different programs a test holds to 1e-5 of each other (1 and 8 devices, a replica
and its single run) compile at -O1: at -O0 a Xeon with AVX-512 rounds them apart by more
than that within their 10 and 24 steps (tests/test_parallel.py, tests/test_replicas.py).
"""
import contextlib
import os

LEVEL = 0  # XLA's LLVM optimisation level (--xla_backend_optimization_level) here

# At -O0, also XLA:CPU's fusions through its LLVM IR emitters rather than its newer MLIR
# fusion emitters: a program compiles in a third less CPU time or better (a CNN's init:
# half) and runs no slower (BENCHMARKS.md, "The test suite on two cores"). Not at -O1, where
# runs that a test holds bit for bit to another program compile (a replica and its single
# run, streamed and device-resident input): the old emitters round some of those pairs apart.
OLD_EMITTERS = "--xla_cpu_use_fusion_emitters=false"


def xla_flags(level: int = LEVEL) -> str:
    """The XLA_FLAGS of a test's compile at LLVM -O`level`."""
    return f"--xla_backend_optimization_level={level}" + (f" {OLD_EMITTERS}" if level == 0
                                                          else "")


def env(level: int = LEVEL, base=None) -> dict:
    """`base` (default: this process's environment) with XLA's LLVM backend at -O`level`
    added to its XLA_FLAGS: -O1 for a child's runs of hundreds of steps (compiled almost as
    fast as at -O0, run as fast as at -O2), -O0 for a few steps."""
    base = dict(os.environ if base is None else base)
    base["XLA_FLAGS"] = " ".join(filter(None, [base.get("XLA_FLAGS"), xla_flags(level)]))
    return base


@contextlib.contextmanager
def in_process():
    """JAX's jax_disable_most_optimizations (-O0, LLVM's expensive passes off) for what
    this process compiles meanwhile. The flag is no part of the keys of JAX's in-memory
    caches (it is of the persistent cache's), so they are cleared afterwards: no program
    compiled so is reused by other tests in this process."""
    import jax
    before = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", True)
    try:
        yield
    finally:
        jax.config.update("jax_disable_most_optimizations", before)
        jax.clear_caches()
