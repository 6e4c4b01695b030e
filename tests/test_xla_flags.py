"""train.xla_flags (jaxtrain/runtime/xla_flags.py): XLA's flags from the config, in effect in every
command that reads a config, checked against this jaxlib before JAX starts.

XLA:CPU parses the GPU flags as well (one flag table for every backend) and ignores them;
what it read shows in the debug options it dumps beside each module
(--xla_dump_to): that is how these tests see a GPU flag take effect on the CPU."""
import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
import fork_server

from jaxtrain.config import checks, defaults
from jaxtrain.errors import ConfigError
from jaxtrain.runtime import xla_flags

REPO = Path(__file__).resolve().parents[1]
TINY = ("--config=configs/cifar_seed_cnn.py", "--config.model.name=mlp",
        "--config.model.hidden_sizes=(32,)", "--config.train.batch_size=64",
        "--config.train.num_steps=4", "--config.eval.batch_size=250")
# The compile A/B's GPU flags (benchmarks/gpu.py), and one whose effect a CPU shows.
GPU_FLAGS = "--xla_gpu_autotune_level=2 --xla_gpu_enable_triton_gemm=false " \
    "--xla_gpu_enable_llvm_module_compilation_parallelism=true"


def dump_flags(folder) -> str:
    """XLA_FLAGS that dump only a tiny module's debug options into `folder` (the random
    seed's, which every run compiles)."""
    return f"--xla_dump_to={folder} --xla_dump_hlo_module_re=threefry_seed"


def debug_options(folder) -> str:
    files = sorted(Path(folder).glob("*.debug_options"))
    assert files, f"XLA dumped no debug options into {folder}"
    return files[0].read_text()


def run(args, env_flags=None):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    if env_flags is not None:
        env["XLA_FLAGS"] = env_flags
    return fork_server.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True,
                           timeout=600, env=env)


def test_flags_are_read_checked_and_merged():
    assert xla_flags.parse("--xla_a=1  --xla_b") == [("xla_a", "--xla_a=1"), ("xla_b", "--xla_b")]
    for bad in ("xla_gpu_autotune_level=2", "--xla_a = 1", "-xla_a=1", "--XLA_A=1"):
        assert not xla_flags.well_formed(bad)
    assert xla_flags.well_formed("") and not xla_flags.well_formed(None)
    # The config's value replaces the environment's for the same flag; applied twice, the same.
    once = xla_flags.merged("--xla_x=1 --xla_gpu_autotune_level=4", "--xla_gpu_autotune_level=0")
    assert once == "--xla_x=1 --xla_gpu_autotune_level=0"
    assert xla_flags.merged(once, "--xla_gpu_autotune_level=0") == once
    config = defaults.get_config()
    assert config.train.xla_flags == ""  # the default changes nothing
    config.train.xla_flags = "--xla_gpu_autotune_level 2"
    with pytest.raises(ConfigError, match=r"^config.train.xla_flags='--xla_gpu_autotune_level 2'"
                       r": must be '' or XLA flags"):
        checks.check_config(config)


@pytest.mark.slow
def test_names_are_looked_up_in_this_jaxlib():
    spec = importlib.util.spec_from_file_location("gpu", REPO / "benchmarks" / "gpu.py")
    gpu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu)
    planned = [name for text in gpu.XLA_SETTINGS.values() for name, _ in xla_flags.parse(text)]
    assert {"xla_gpu_autotune_level", "xla_gpu_enable_triton_gemm"} <= set(planned)
    assert xla_flags.unknown_names([*planned, "xla_force_host_platform_device_count",
                                    "xla_dump_to"]) == []
    # A misspelling, and a flag's tail (a linker may store 'xla_gpu_x' to end another string).
    assert xla_flags.unknown_names(["xla_gpu_autotune_levle", "xla_enable_triton_gemm"]) == [
        "xla_gpu_autotune_levle", "xla_enable_triton_gemm"]
    # JAX started in this process: a flag that is not in effect yet can no longer be.
    import jax
    jax.devices()
    with pytest.raises(ConfigError, match="JAX has started in this process already"):
        xla_flags.apply("--xla_gpu_autotune_level=1")
    assert xla_flags.apply("") == os.environ.get("XLA_FLAGS", "")


@pytest.mark.slow
def test_an_unknown_flag_is_a_one_line_usage_error_not_xlas_abort(tmp_path):
    result = run(["-m", "jaxtrain.bench", *TINY, f"--config.data.dir={tmp_path}", "--runs=0",
                  "--config.train.xla_flags=--xla_gpu_autotune_levle=2"])
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines() == [
        "error: config.train.xla_flags='--xla_gpu_autotune_levle=2': XLA (jaxlib "
        + __import__("jaxlib").__version__ + ") would abort: Unknown flag in XLA_FLAGS: "
        "--xla_gpu_autotune_levle=2"]


@pytest.mark.slow
def test_main_py_runs_with_the_configs_flags_and_records_them(cifar_batches_dir, tmp_path):
    """Two CPU devices (a flag whose effect the run itself shows) and the GPU flags, as
    XLA read them; the environment's own flags kept, the config's value winning."""
    flags = f"--xla_force_host_platform_device_count=2 {GPU_FLAGS} {dump_flags(tmp_path / 'd')}"
    result = run(["main.py", *TINY, f"--config.data.dir={cifar_batches_dir}",
                  f"--config.train.xla_flags={flags}", f"--workdir={tmp_path / 'run'}"],
                 env_flags="--xla_gpu_autotune_level=4 --xla_cpu_enable_fast_math=false")
    assert result.returncode == 0, result.stderr[-2000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["device_count"] == 2
    assert summary["xla_flags"] == f"--xla_cpu_enable_fast_math=false {flags}"
    assert summary["config"]["train"]["xla_flags"] == flags
    options = debug_options(tmp_path / "d")
    assert "xla_gpu_autotune_level: 2\n" in options
    assert "xla_gpu_enable_triton_gemm: false\n" in options
    assert "xla_gpu_enable_llvm_module_compilation_parallelism: true\n" in options


@pytest.mark.slow
@pytest.mark.parametrize("command", ["bench", "compare"])
def test_bench_and_compare_pass_the_configs_flags_to_xla(command, cifar_batches_dir, tmp_path):
    flags = f"--xla_gpu_autotune_level=1 {dump_flags(tmp_path / 'd')}"
    common = [*TINY, f"--config.data.dir={cifar_batches_dir}",
              f"--config.train.xla_flags={flags}"]
    if command == "bench":
        args = ["-m", "jaxtrain.bench", *common, "--runs=0", "--warmup=0",
                f"--json={tmp_path / 'out.json'}"]
        written = tmp_path / "out.json"
    else:
        args = ["-m", "jaxtrain.compare", *common, "--frameworks=jax",
                f"--workdir={tmp_path / 'compare'}"]
        written = tmp_path / "compare" / "compare.json"
    result = run(args)
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(written.read_text())["xla_flags"] == flags
    assert "xla_gpu_autotune_level: 1\n" in debug_options(tmp_path / "d")
