"""The speedrun benchmark and the inspection report, on small real CIFAR-10 runs."""
import gzip
import io
import json
import os
import re
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from tolerances import TRAINING_STEPS
import fork_server

from configs import cifar_seed_cnn
from jaxtrain.models.ops import onednn
from jaxtrain.perf import benchmark, hlo, inspection
from jaxtrain.runtime import report

REPO = Path(__file__).resolve().parents[1]
MLP_OVERRIDES = ("--config=configs/cifar_seed_cnn.py", "--config.model.name=mlp",
                 "--config.model.hidden_sizes=(64,32)", "--config.model.batch_norm=True",
                 "--config.train.batch_size=64", "--config.optimizer.learning_rate=0.05",
                 "--config.train.num_steps=70", "--config.augment.flip=True")


def mlp_config(data_dir):
    config = cifar_seed_cnn.get_config()
    config.data.dir = str(data_dir)
    config.model.name, config.model.hidden_sizes = "mlp", (64, 32)
    config.model.batch_norm = True
    config.train.batch_size, config.train.num_steps = 64, 70  # 2 epochs of 31 steps + 8
    config.optimizer.learning_rate = 0.05
    config.augment.flip = True
    return config


def run(module_args, env=None):
    return fork_server.run([sys.executable, *module_args], cwd=REPO, capture_output=True,
                           text=True, timeout=600, env={**os.environ, **(env or {})})


@pytest.mark.slow
def test_a_benchmark_run_is_the_run_main_py_makes(cifar_batches_dir, tmp_path):
    """Same config and seed: the one-program run ends where `python main.py` ends."""
    out = io.StringIO()
    result = benchmark.benchmark(mlp_config(cifar_batches_dir), runs=2, warmup=0, first_seed=3,
                                 stream=out)
    assert [r["seed"] for r in result["runs"]] == [3, 4]
    assert result["runs"][0]["test_accuracy"] != result["runs"][1]["test_accuracy"]
    assert all(r["seconds"] > 0 and r["nonfinite_steps"] == 0 for r in result["runs"])
    assert "2 runs: test_accuracy" in out.getvalue()

    main = run(["main.py", *MLP_OVERRIDES, f"--config.data.dir={cifar_batches_dir}",
                "--config.seed=3", f"--workdir={tmp_path}"])
    assert main.returncode == 0, main.stderr[-2000:]
    summary = json.loads((tmp_path / report.SUMMARY_FILE).read_text())
    first = result["runs"][0]
    assert first["test_accuracy"] == pytest.approx(summary["test_accuracy"], abs=1 / 500)
    assert first["test_loss"] == pytest.approx(summary["test_loss"], rel=TRAINING_STEPS)
    assert first["train_loss"] == pytest.approx(summary["train_loss"], rel=TRAINING_STEPS)


@pytest.mark.slow
def test_the_command_writes_json_with_every_run(cifar_batches_dir, tmp_path):
    path = tmp_path / "bench.json"
    result = run(["-m", "jaxtrain.bench", *MLP_OVERRIDES, f"--config.data.dir={cifar_batches_dir}",
                  "--runs=3", "--warmup=1", f"--json={path}"])
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.count("\nrun ") == 3 and "whole process" in result.stdout
    summary = json.loads(path.read_text())
    assert len(summary["runs"]) == 3 and summary["warmup_runs"] == 1
    accuracies = [r["test_accuracy"] for r in summary["runs"]]
    assert summary["accuracy_mean"] == pytest.approx(sum(accuracies) / 3)
    assert min(accuracies) > 0.2  # well above chance after 70 steps
    assert 0 < summary["compile_seconds"] < summary["process_seconds"] < 600


@pytest.mark.slow
def test_a_diverging_recipe_is_reported_not_averaged(cifar_batches_dir):
    result = run(["-m", "jaxtrain.bench", *MLP_OVERRIDES, f"--config.data.dir={cifar_batches_dir}",
                  "--config.optimizer.learning_rate=1e30", "--runs=2", "--warmup=0"])
    assert result.returncode != 0
    assert "error: seed 0:" in result.stderr and "non-finite loss" in result.stderr
    assert "Traceback" not in result.stderr and "2 runs:" not in result.stdout


@pytest.mark.slow
def test_inspect_reports_kernels_flops_speed_and_the_costliest_ops(cifar_batches_dir, tmp_path):
    config = mlp_config(cifar_batches_dir)
    info = inspection.inspect(config, steps=3, profile_dir=str(tmp_path / "profile"))
    forward = 2 * (32 * 32 * 3 * 64 + 64 * 32 + 32 * 10)  # multiply-adds of the dense layers
    # backward: weight gradients of every layer (1x forward) and input gradients of all
    # but the first (whose input is the data): about 2.1x forward in all, plus elementwise
    assert 2.0 * forward < info["flops_per_image"] < 2.5 * forward
    assert info["kernels_per_step"] == sum(info["kernels"].values()) > 5
    assert info["kernels"]["dot"] >= 1 and info["kernels"]["fusion"] >= 1  # what each holds: below
    assert info["step_seconds"] > 0 and info["loop"] == "scan"
    # FLOPs come from the lowered program (a GPU's compiled one hides its convolutions and
    # matrix products in library calls); on the CPU XLA's compiled count agrees with it.
    assert info["flops_source"] == "lowered program"
    assert info["compiled_flops_per_step"] == pytest.approx(info["flops_per_step"], rel=1e-3)
    # The jaxpr's matrix work, exactly: forward, every weight gradient, and the input
    # gradients of the two layers whose input is not the data.
    dense = 2 * (32 * 32 * 3 * 64 + 64 * 32 + 32 * 10)
    assert info["matmul_flops_per_step"] == config.train.batch_size * (
        2 * dense + 2 * (64 * 32 + 32 * 10))
    assert len(info["step_seconds_timings"]) == 5
    assert info["step_seconds"] == min(info["step_seconds_timings"])
    assert info["collectives_per_step"] == {}  # one device
    # The profile: a trace TensorBoard can open, and the ops read back from it, costliest first.
    table = info["profile"]
    assert table["trace"].endswith(".xplane.pb") and os.path.getsize(table["trace"]) > 0
    assert table["trace"].startswith(str(tmp_path / "profile" / "plugins" / "profile"))
    assert table["traced_steps"] == 3 and table["distinct_ops"] >= len(table["top_ops"]) > 0
    assert len(table["top_ops"]) <= 10
    per_step = [row["seconds_per_step"] for row in table["top_ops"]]
    assert per_step == sorted(per_step, reverse=True) and per_step[-1] > 0
    assert 0 < sum(row["share_of_op_time"] for row in table["top_ops"]) <= 1 + 1e-9
    assert all(row["share_of_step"] > 0 for row in table["top_ops"])
    # (which op the profile ranks first is checked on a program whose answer is known:
    # test_the_profile_ranks_a_programs_costliest_op_first)
    # The same trace by kernel name (on a CPU: the host thunks' names), costliest first.
    kernels = table["kernels"]
    assert kernels["traced_steps"] == 3 and kernels["distinct_kernels"] >= len(
        kernels["top_kernels"]) > 0 and len(kernels["top_kernels"]) <= inspection.TOP_KERNELS
    per_step = [row["seconds_per_step"] for row in kernels["top_kernels"]]
    assert per_step == sorted(per_step, reverse=True) and per_step[-1] > 0
    assert kernels["kernel_seconds_per_step"] == pytest.approx(table["op_seconds_per_step"])
    assert all(row["calls_per_step"] > 0 and row["hlo_ops"] >= 1 and row["top_hlo_op"]
               for row in kernels["top_kernels"])
    # The step's optimised HLO beside the trace: the program whose kernels were counted.
    assert info["hlo_file"] == str(tmp_path / "profile" / inspection.HLO_FILE)
    with gzip.open(info["hlo_file"], "rt") as f:
        text = f.read()
    assert "ENTRY" in text and dict(hlo.kernel_counts(text)) == info["kernels"]
    # that file is the MLP's step: its 8 matrix products, each with its shape (forward 3,
    # weight gradients 3, input gradients of the two layers not fed by the data)
    products = sorted(tuple(int(d) for d in re.search(r"\[([\d,]*)\]", i.type)[1].split(","))
                      for body in hlo.computations(text)[0].values() for i in body
                      if i.opcode == "dot")
    assert products == sorted([(64, 64), (64, 32), (64, 10),  # forward
                               (3072, 64), (64, 32), (32, 10),  # weight gradients
                               (64, 64), (64, 32)])  # input gradients
    out = io.StringIO()
    inspection.print_inspection(info, "configs/x.py", out)
    assert "XLA kernels per step:" in out.getvalue() and "TFLOP/s" in out.getvalue()
    assert f"top {len(table['top_ops'])} of {table['distinct_ops']} XLA ops" in out.getvalue()
    assert table["top_ops"][0]["op"] in out.getvalue()
    assert (f"top {len(kernels['top_kernels'])} of {kernels['distinct_kernels']} kernels by "
            "name") in out.getvalue()
    assert info["hlo_file"] in out.getvalue()


@pytest.mark.slow
def test_the_profile_ranks_a_programs_costliest_op_first(tmp_path):
    """A 768x768 matrix product and a tiny sum: the traced op holding the product (a dot,
    or the fusion calling it, as XLA named it in the compiled program) is first, with
    nearly all the time, in both the op and the kernel tables."""
    from jaxtrain.perf import profile
    matrix = jax.random.normal(jax.random.key(0), (768, 768))
    program = jax.jit(lambda x: jnp.tanh(x @ x)[0, :8].sum())
    computations, entry = hlo.computations(program.lower(matrix).compile().as_text())

    def holds_a_product(instruction):
        called = re.search(r"calls=%?([\w.\-]+)", instruction.text)
        return instruction.opcode == "dot" or (called is not None and any(
            inner.opcode == "dot" for inner in computations[called[1]]))
    product = [i.name for i in computations[entry] if holds_a_product(i)]
    assert len(product) == 1, computations[entry]
    program(matrix).block_until_ready()
    trace, _ = profile.trace(lambda: program(matrix).block_until_ready(), str(tmp_path), steps=3)
    ops = profile.op_table(trace, 3)
    assert ops["traced_steps"] == 3 and ops["distinct_ops"] >= 2
    first = ops["top_ops"][0]
    assert first["op"] == product[0] and first["calls_per_step"] == 1
    assert first["share_of_op_time"] > 0.9
    kernels = profile.kernel_table(trace, 3)["top_kernels"]
    assert kernels[0]["top_hlo_op"] == product[0] and kernels[0]["share_of_kernel_time"] > 0.9


@pytest.mark.slow
def test_where_xla_counts_no_flops_the_jaxpr_s_matrix_work_is_reported(cifar_batches_dir,
                                                                        monkeypatch):
    """jax 0.11.2 on the H200 gave an empty cost analysis: the report must not say 0."""
    monkeypatch.setattr(inspection, "cost", lambda program: {})
    info = inspection.inspect(mlp_config(cifar_batches_dir), steps=2, repeats=1)
    assert info["flops_source"] == "jaxpr (matrix products and convolutions)"
    assert info["flops_per_step"] == info["matmul_flops_per_step"] > 0
    assert info["achieved_tflops_per_device"] > 0


def test_matmul_flops_counts_products_convolutions_loops_and_branches():
    x, w = jnp.ones((8, 16)), jnp.ones((16, 4))
    assert inspection.matmul_flops(jax.make_jaxpr(jnp.dot)(x, w)) == 2 * 8 * 16 * 4
    looped = jax.make_jaxpr(lambda x, w: jax.lax.scan(
        lambda c, _: (c, jnp.dot(c, w)), x, None, length=3)[1])(x, w)
    assert inspection.matmul_flops(looped) == 3 * 2 * 8 * 16 * 4
    branch = jax.make_jaxpr(lambda p, x, w: jax.lax.cond(
        p, lambda: jnp.dot(x, w).sum(), lambda: x.sum()))(True, x, w)
    assert inspection.matmul_flops(branch) == 2 * 8 * 16 * 4
    images, kernel = jnp.ones((2, 9, 9, 3)), jnp.ones((3, 3, 3, 5))  # NHWC, HWIO, 'SAME'

    def conv_loss(impl):
        conv = onednn.conv_function(impl)
        return lambda x, k: conv(x, k, (1, 1), "SAME", dimension_numbers=onednn.NHWC).sum()

    forward = 2 * (2 * 9 * 9 * 5) * (3 * 3 * 3)
    assert inspection.matmul_flops(jax.make_jaxpr(conv_loss("xla"))(images, kernel)) == forward
    # forward, input gradient and kernel gradient: three times the forward's work, whether
    # lax's convolutions or oneDNN's FFI calls do it; without the value, the forward of
    # this linear loss is dead code and not counted
    for impl in ("xla", "onednn"):
        both = jax.value_and_grad(conv_loss(impl), argnums=(0, 1))
        assert inspection.matmul_flops(jax.make_jaxpr(both)(images, kernel)) == 3 * forward, impl
        grads = jax.grad(conv_loss(impl), argnums=(0, 1))
        assert inspection.matmul_flops(jax.make_jaxpr(grads)(images, kernel)) == 2 * forward, impl


@pytest.mark.slow
def test_inspect_on_eight_devices_reports_the_gradient_all_reduce(cifar_batches_dir, tmp_path):
    path = tmp_path / "inspect.json"
    result = run(["-m", "jaxtrain.bench", "--inspect", "--steps=1",
                  "--config=configs/cifar_seed_cnn.py", "--config.train.batch_size=8",
                  f"--config.data.dir={cifar_batches_dir}", f"--json={path}"],
                 env={"XLA_FLAGS": f"{os.environ['XLA_FLAGS']} --xla_force_host_platform_device_count=8"})
    assert result.returncode == 0, result.stderr[-2000:]
    assert "all-reduce per step:" in result.stdout
    info = json.loads(path.read_text())
    assert info["hlo_file"] == str(tmp_path / "inspect.hlo.txt.gz")  # beside --json
    with gzip.open(info["hlo_file"], "rt") as f:
        assert "all-reduce" in f.read()
    assert info["devices"] == 8 and info["param_count"] == 62_006
    gradient_bytes = 4 * info["param_count"]
    assert gradient_bytes <= info["collectives_per_step"]["all-reduce"]["bytes"] < 1.1 * gradient_bytes


def test_the_one_program_run_splits_its_epochs_at_the_cuts():
    """train.drop_finished_groups in benchmark.whole_run: (epoch, first step, steps, whole
    epochs) pieces, scanned epochs between partial ones, no piece across a cut."""
    stem = frozenset({"Conv_0/bias"})
    assert benchmark.phases(30, {}) == [(0, 30, frozenset())]
    assert benchmark.phases(30, {15: stem, 40: frozenset({"x"})}) == [
        (0, 15, frozenset()), (15, 30, stem)]
    assert benchmark.pieces(0, 30, 10) == [(0, 0, 10, 3)]  # today's program: one scan
    assert benchmark.pieces(0, 15, 10) == [(0, 0, 10, 1), (1, 0, 5, 0)]
    assert benchmark.pieces(15, 30, 10) == [(1, 5, 5, 0), (2, 0, 10, 1)]
    assert benchmark.pieces(75, 200, 25) == [(3, 0, 25, 5)]  # the speedrun's stem bias
    assert benchmark.pieces(3, 8, 10) == [(0, 3, 5, 0)]
    assert benchmark.pieces(5, 47, 10) == [(0, 5, 5, 0), (1, 0, 10, 3), (4, 0, 7, 0)]
    for begin, end in ((0, 7), (3, 40), (12, 12), (9, 31)):  # every step once, in order
        steps = [epoch * 10 + first + i
                 for epoch, first, n, epochs in benchmark.pieces(begin, end, 10)
                 for i in range(n * max(epochs, 1))]
        assert steps == list(range(begin, end))


def test_peak_table_and_process_clock():
    assert inspection.peak_tflops("NVIDIA H200") == 989.4
    assert inspection.peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert inspection.peak_tflops("cpu") is None
    assert time.time() - 3600 < benchmark.PROCESS_START <= time.time()


@pytest.mark.slow
def test_runs_zero_compiles_only(cifar_batches_dir):
    out = io.StringIO()
    result = benchmark.benchmark(mlp_config(cifar_batches_dir), runs=0, warmup=0, stream=out)
    assert result["runs"] == [] and "accuracy_mean" not in result
    assert 0 < result["compile_seconds"] < result["process_seconds"]
    assert out.getvalue().splitlines()[-1].startswith("compile ")


# ---------------------------------------------------------------- devices, cache, whole process

# XLA_FLAGS given here replaces the variable: conftest.py's -O1 is kept in it
TWO_CPUS = {"XLA_FLAGS": f"{os.environ['XLA_FLAGS']} --xla_force_host_platform_device_count=2"}


def bench_args(data_dir, *args):
    """The MLP benchmark at its cheapest: one timed run of 10 steps, no warm-up."""
    return ["-m", "jaxtrain.bench", *MLP_OVERRIDES, f"--config.data.dir={data_dir}",
            "--config.train.num_steps=10", "--runs=1", "--warmup=0", *args]


@pytest.mark.slow
def test_devices_picks_the_first_n_and_defaults_to_one(cifar_batches_dir, tmp_path):
    """One device unless asked, even when more exist: the public records are single-GPU."""
    for flags, devices in (((), 1), (("--devices=2", f"--compilation_cache={tmp_path / 'c'}"), 2)):
        path = tmp_path / f"{devices}.json"
        result = run(bench_args(cifar_batches_dir, *flags, f"--json={path}"), env=TWO_CPUS)
        assert result.returncode == 0, result.stderr[-2000:]
        assert f", {devices} x cpu (cpu backend); compile" in result.stdout.splitlines()[0]
        summary = json.loads(path.read_text())
        assert (summary["devices"], summary["backend"], summary["device_kind"]) == (
            devices, "cpu", "cpu")
    assert summary["compilation_cache"] == str(tmp_path / "c")
    assert any(name.startswith("jit_whole_run-") for name in os.listdir(tmp_path / "c"))


@pytest.mark.slow
def test_bad_devices_and_flag_values_are_one_line_errors(cifar_batches_dir):
    for flag, message in (
            ("--devices=3", "error: --devices=3: must be from 1 to 2, the number of cpu devices "
                            "available"),
            ("--devices=0", "error: --devices=0: must be from 1 to 2"),
            ("--runs=-1", "error: flag --runs=-1: -1 is not a non-negative integer"),
            ("--profile=p", "error: --profile traces the steps --inspect compiles; add --inspect"),
            # The parent hands the flags on; the child's one-line error comes back as one line.
            ("--whole_process --devices=3", "error: the cold run failed (exit 1): --devices=3: "
                                            "must be from 1 to 2")):
        result = run(bench_args(cifar_batches_dir, *flag.split()), env=TWO_CPUS)
        status = 2 if flag.startswith("--runs") else 1  # a flag absl refuses: usage, 2
        assert result.returncode == status and "Traceback" not in result.stderr, \
            result.stderr[-2000:]
        assert result.stderr.strip().splitlines()[-1].startswith(message)


@pytest.mark.slow
def test_whole_process_compiles_warm_from_the_cache_the_cold_run_wrote(cifar_batches_dir,
                                                                        tmp_path):
    path, root = tmp_path / "whole.json", tmp_path / "cache"
    root.mkdir()
    (root / "keep.txt").write_text("a user's file")  # a named folder is never emptied
    result = run(bench_args(cifar_batches_dir, "--whole_process", f"--compilation_cache={root}",
                            f"--json={path}"))
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.count("\nrun 1/1") == 2
    assert re.fullmatch(r"whole process: cold \d+\.\d s \(compile \d+\.\d s\), "
                        r"warm \d+\.\d s \(compile \d+\.\d s\)", result.stdout.splitlines()[-1])
    summary = json.loads(path.read_text())
    cache = Path(summary["compilation_cache"])
    assert cache.parent == root and (root / "keep.txt").exists()
    cold, warm = summary["cold"], summary["warm"]
    assert cold["compilation_cache"] == warm["compilation_cache"] == str(cache)
    # The cold run filled the cache; the warm run found every program there and added none.
    assert summary["cache_files"]["cold"] == summary["cache_files"]["warm"] == len(
        os.listdir(cache)) > 0
    figures = summary["whole_process"]
    assert figures["cold_seconds"] == cold["process_seconds"]
    assert figures["warm_compile_seconds"] < figures["cold_compile_seconds"]
    assert warm["runs"][0]["test_accuracy"] == cold["runs"][0]["test_accuracy"]  # same program


def test_a_gpu_trace_is_read_from_the_device_plane_s_xla_ops_line():
    """No GPU here: a stand-in with a GPU trace's layout (host thunks, a device plane whose
    "XLA Ops" line holds the ops, stream lines holding their kernels) must be read from
    the device's op line only, so kernels and host events are not counted twice."""
    from types import SimpleNamespace as Obj

    from jaxtrain.perf import profile

    def event(name, ns, **stats):
        return Obj(name=name, duration_ns=ns, stats=list(stats.items()))

    host = Obj(name="/host:CPU", lines=[Obj(name="python", events=[
        event("convolution.1", 9_000, hlo_op="convolution.1")])])
    gpu = Obj(name="/device:GPU:0", lines=[
        Obj(name="XLA Modules", events=[event("jit_step", 5_000)]),
        Obj(name="XLA Ops", events=[event("convolution.1", 3_000), event("fusion.2", 1_000),
                                    event("convolution.1", 3_000)]),
        Obj(name="Stream #13(Compute)", events=[event("sm90_xmma_fprop", 3_000,
                                                      hlo_op="convolution.1")])])
    source, events = profile.op_events(Obj(planes=[host, gpu]))
    assert source == "/device:GPU:0 XLA Ops"
    assert [(op, name) for op, name, _ in sorted(events)] == [
        ("convolution.1", "convolution.1")] * 2 + [("fusion.2", "fusion.2")]
    assert [seconds for _, _, seconds in sorted(events)] == pytest.approx([3e-6, 3e-6, 1e-6])
    source, events = profile.op_events(Obj(planes=[host]))
    assert source == "/host:CPU thunks" and len(events) == 1
    assert events[0][:2] == ("convolution.1", "convolution.1") and events[0][2] == pytest.approx(9e-6)
    # No "XLA Ops" line: the stream kernels, grouped under the HLO op each names; the
    # host's launch times are never read for a GPU run, even when nothing names an op.
    streams = Obj(name="/device:GPU:0", lines=[
        Obj(name="XLA Modules", events=[event("jit_step", 5_000)]),
        Obj(name="Stream #13(Compute)", events=[
            event("sm90_xmma_fprop", 3_000, hlo_op="convolution.1"),
            event("loop_fusion", 500, hlo_op="fusion.2"),
            event("sm90_xmma_dgrad", 2_000, hlo_op="convolution.1"),
            event("memcpy", 100)])])
    source, events = profile.op_events(Obj(planes=[host, streams]))
    assert source == "/device:GPU:0 stream kernels by HLO op"
    assert sorted((op, name) for op, name, _ in events) == [
        ("convolution.1", "sm90_xmma_dgrad"), ("convolution.1", "sm90_xmma_fprop"),
        ("fusion.2", "loop_fusion")]
    unnamed = Obj(name="/device:GPU:0", lines=[Obj(name="Stream #13(Compute)",
                                                   events=[event("memcpy", 100)])])
    source, events = profile.op_events(Obj(planes=[host, unnamed]))
    assert events == [] and source.startswith("/device:GPU:0: no XLA op named")
    # By kernel name: the stream lines' kernels (memcpy too), whichever op launched them;
    # a trace without a device plane (a CPU run) gives the host thunks by their names.
    source, events = profile.kernel_events(Obj(planes=[host, streams]))
    assert source == "/device:GPU:0 stream kernels"
    assert sorted((name, op) for name, op, _ in events) == [
        ("loop_fusion", "fusion.2"), ("memcpy", ""), ("sm90_xmma_dgrad", "convolution.1"),
        ("sm90_xmma_fprop", "convolution.1")]
    source, events = profile.kernel_events(Obj(planes=[host]))
    assert source == "/host:CPU thunks" and [e[:2] for e in events] == [
        ("convolution.1", "convolution.1")]


@pytest.mark.slow
def test_memory_prints_what_the_step_needs_per_device_before_anything_runs(cifar_batches_dir,
                                                                            tmp_path):
    """`bench --memory` as a user types it, on 2 devices: the plain step and the same with
    all three knobs, each described in lines and in its JSON (XLA's own analysis)."""
    results = {}
    for name, flags in (("plain", ()), ("knobs", ("--config.parallel.fsdp=2",
                                                  "--config.train.accumulate_steps=2",
                                                  "--config.model.name=cifar_cnn",
                                                  "--config.model.widths=(16,32,32)",
                                                  "--config.model.remat=True"))):
        path = tmp_path / f"{name}.json"
        result = run(["-m", "jaxtrain.bench", "--config=configs/cifar_seed_cnn.py",
                      f"--config.data.dir={cifar_batches_dir}", "--config.train.batch_size=64",
                      "--memory", f"--json={path}", *flags], env=TWO_CPUS)
        assert result.returncode == 0, result.stderr[-2000:]
        results[name] = (json.loads(path.read_text()), result.stdout)
    plain, out = results["plain"]
    assert out.startswith("seed_cnn batch 64 at 32x32x3, float32, accumulate_steps=1, "
                          "remat=False, replicated over 2 device(s) (cpu)")
    assert "  per device: arguments " in out and "  peak " in out
    assert plain["peak_bytes"] == (plain["arguments_bytes"] + plain["outputs_bytes"]
                                   - plain["alias_bytes"] + plain["temporaries_bytes"]) > 0
    knobs, out = results["knobs"]
    assert "accumulate_steps=2, remat=True, fsdp=2 over 2 devices" in out
    assert (knobs["fsdp"], knobs["accumulate_steps"], knobs["remat"]) == (2, 2, True)
    assert knobs["params_bytes_per_device"] > 0 and knobs["temporaries_bytes"] > 0


def test_a_figure_names_its_cpu_and_the_extensions_that_choose_its_kernels(tmp_path):
    """benchmarks/cpu_speed.py's JSON names the CPU: the same test takes 1.8x the time on
    an AVX2 EPYC as on an AVX-512 Xeon, so a CPU figure without it cannot be compared."""
    from jaxtrain.perf import machine
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\n"
                       "model\t\t: 1\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse4_2 avx fma "
                       "avx2 bmi2\n\nprocessor\t: 1\nmodel name\t: other\nflags\t\t: avx512f\n")
    assert machine.describe_cpu(str(cpuinfo)) == {
        "model": "AMD EPYC (family 25, model 1)",
        "vector_extensions": ["sse4_2", "avx", "avx2", "fma"]}
    assert machine.describe_cpu(str(tmp_path / "none"))["vector_extensions"] == []
    here = machine.describe_cpu()
    assert here["model"] and set(here["vector_extensions"]) <= set(machine.VECTOR_EXTENSIONS)
    script = (REPO / "benchmarks" / "cpu_speed.py").read_text()
    assert "machine.describe_cpu()" in script
