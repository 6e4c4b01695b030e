"""The prepared GPU script (benchmarks/gpu.py), dry: items for a few steps on the CPU, so the
one GPU run a loan allows does not fail on something a CPU could have caught.

CI runs one item of each command the script uses (bench --inspect --profile, main.py,
compare with torch.compile switched on, as a GPU has it), the speedrun benchmark stopped at
its cap, and part 2's airbench item against benchmarks/airbench_standin.py (airbench needs
CUDA); the two capped items run in the background while the dry run's items use the CPU,
since they mostly wait out their caps. XLA's LLVM at -O0 for their few steps
(quick_compile.py: the HLO, hence the counts inspect reports, is the same at every level).
The other items' commands are the same commands with flags the test modules of bench,
speedrun, compare and the levers run. Before a GPU loan, run every item by hand:
    python3 benchmarks/gpu.py --dry --data_dir=DIR --out=/tmp/gpu
    python3 benchmarks/gpu.py --dry --part=2 --data_dir=DIR --out=/tmp/gpu
"""
import glob
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

import pytest
import quick_compile
from conftest import finish

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu.py"
CI_ITEMS = ("inspect_speedrun_corners", "compare_seed", "cifar_train")  # in the plan's order


def load_script():
    spec = importlib.util.spec_from_file_location("gpu", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def capped_speedrun(cifar_batches_dir, tmp_path_factory):
    """The speedrun item asked for 100,000 runs under a 60 s cap, started in the background
    and frozen once its first run is written (see test_an_item_stopped_at_its_cap...): its
    cap's wait overlaps the dry run's items instead of idling a test worker for a minute."""
    out = tmp_path_factory.mktemp("gpu_capped")
    scratch = out / "scratch"  # gpu.py's temporary folder goes in here (TMPDIR)
    scratch.mkdir()
    script = subprocess.Popen([sys.executable, str(SCRIPT), "--dry",
                               f"--data_dir={cifar_batches_dir}", f"--out={out}",
                               "--wheels=/nonexistent", "--only=speedrun,seed_64_replicas",
                               "--runs=100000", "--caps=speedrun=60,seed_64_replicas=1"],
                              cwd=REPO, text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE,
                              env={**quick_compile.env(0), "TMPDIR": str(scratch)})
    freezer = threading.Thread(target=freeze_once_a_run_is_written, daemon=True, args=(
        script, str(scratch / "jaxtrain-gpu-*" / "work" / "speedrun.json")))
    freezer.start()
    yield out, script, freezer
    if script.poll() is None:
        script.kill()
        script.communicate()


@pytest.fixture(scope="module")
def airbench_part2(cifar_batches_dir, tmp_path_factory):
    """Part 2, dry, in the background: its stand-in mostly sleeps out its 13 s, which the
    dry run's items use."""
    out = tmp_path_factory.mktemp("gpu_part2")
    script = subprocess.Popen([sys.executable, str(SCRIPT), "--dry", "--part=2",
                               f"--data_dir={cifar_batches_dir}", f"--out={out}",
                               "--caps=airbench94_muon=18"], cwd=REPO, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env=dict(os.environ, AIRBENCH_STANDIN_EPOCH_SECONDS="0.02"))
    yield out, script
    if script.poll() is None:
        script.kill()
        script.communicate()


@pytest.fixture(scope="module")
def dry_run(cifar_batches_dir, tmp_path_factory, capped_speedrun, airbench_part2):
    out = tmp_path_factory.mktemp("gpu")
    result = subprocess.run([sys.executable, str(SCRIPT), "--dry",
                             f"--data_dir={cifar_batches_dir}", f"--out={out}",
                             f"--wheels={out / 'no-wheels'}", f"--only={','.join(CI_ITEMS)}"],
                            cwd=REPO, capture_output=True, text=True, timeout=900,
                            env=quick_compile.env(0))
    return out, result


@pytest.mark.slow
def test_every_item_runs_and_reports_its_figures(dry_run):
    out, result = dry_run
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    report = json.loads((out / "gpu.json").read_text())
    items = report["items"]
    assert list(items) == list(CI_ITEMS)
    assert set(CI_ITEMS) <= {step.name for step, *_ in load_script().items(
        "D", "A", "W", dry=True)}
    for name, entry in items.items():
        assert entry["status"] == "ok", (name, entry.get("error"))
    assert report["dry"] and report["environment"]["child"]["backend"] == "cpu"
    child = report["environment"]["child"]
    assert child["preflight"].startswith("ok") and child["packages"]["jax"]
    assert child["torch"]["cuda_available"] is False and "variables" in report["environment"]
    assert [report["setup"][name]["status"] for name in ("wheels", "data", "preflight")] == [
        "not needed", "not needed", "ok"]
    # the card every figure is from: here the CPU JAX sees, whose allocator reports no limit
    assert report["card"]["name"] == report["card"]["jax_device_kind"] == "cpu"
    assert report["card"]["jax_memory_bytes"] is None
    assert report["ratios"] == {}  # no baseline among these items
    for name, entry in items.items():
        script = load_script()
        assert entry["cap_seconds"] == 10 * next(step.cap for step in script.PLAN + script.EXTRAS
                                                 if step.name == name)

    inspected = items["inspect_speedrun_corners"]["result"]
    assert inspected["kernels_per_step"] > 0 and inspected["flops_per_step"] > 0
    assert 0 < len(inspected["profile"]["top_ops"]) <= 10
    with tarfile.open(out / "profile_inspect_speedrun_corners.tar.gz") as tar:
        assert any(n.endswith(".xplane.pb") for n in tar.getnames())
    assert 0 <= items["cifar_train"]["result"]["test_accuracy"] <= 1
    assert inspected["flops_source"] == "lowered program"
    # XLA:CPU's passes rewrite the convolutions a little (the MLP's counts agree exactly,
    # tests/test_bench.py); on a GPU the compiled count would miss them altogether.
    assert inspected["compiled_flops_per_step"] == pytest.approx(inspected["flops_per_step"],
                                                                 rel=0.15)
    rows = items["compare_seed"]["result"]["results"]
    assert [row["framework"] for row in rows] == ["jax", "torch_fast"]
    assert len({row["param_count"] for row in rows}) == 1
    # torch.compile ran on the CPU, with static shapes, as it will on the GPU.
    assert rows[1]["torch_compile"] == {"mode": "default", "dynamic": False}
    # The device returns at most 8 files, none in a folder more than 2 deep.
    returned = [p for p in out.rglob("*") if p.is_file()]
    assert len(returned) <= 8 and all(len(p.relative_to(out).parts) <= 3 for p in returned)
    with tarfile.open(out / "logs.tar.gz") as tar:
        assert {Path(n).name for n in tar.getnames()} >= {f"{name}.log" for name in items}


@pytest.mark.slow
def test_an_item_past_the_budget_is_stopped_and_the_rest_skipped(tmp_path):
    gpu = load_script()
    log = tmp_path / "sleep.log"
    status, seconds = gpu.run_item([sys.executable, "-c", "import time; time.sleep(60)"],
                                   str(log), timeout=1.0, env={})
    assert status == "stopped after 1 s (out of time)" and seconds < 30
    assert log.read_text().startswith("$ ")
    result = subprocess.run([sys.executable, str(SCRIPT), "--data_dir=D", f"--out={tmp_path}",
                             "--wheels=/nonexistent", "--only=speedrun,compare_seed",
                             "--budget=0"],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    report = json.loads((tmp_path / "gpu.json").read_text())
    assert report["setup"]["preflight"]["status"].startswith("skipped")
    assert report["items"] == {}  # the run ends at the setup step it could not run


def freeze_once_a_run_is_written(script: subprocess.Popen, partial: str) -> None:
    """SIGSTOP to the process group of the item writing `partial` (a glob) once it holds a
    finished run: from then on the item hangs, using no CPU, until its cap ends it."""
    deadline = time.monotonic() + 240
    while script.poll() is None and time.monotonic() < deadline:
        for path in glob.glob(partial):
            try:
                runs = json.loads(Path(path).read_text()).get("runs", [])
            except ValueError:
                continue  # being written
            if runs:
                for pid in map(int, filter(str.isdigit, os.listdir("/proc"))):
                    try:
                        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                    except OSError:
                        continue
                    if f"--json={path}".encode() in cmdline:
                        os.killpg(pid, signal.SIGSTOP)  # its own group (gpu.run_item)
                        return
        time.sleep(0.2)


@pytest.mark.slow
def test_an_item_stopped_at_its_cap_reports_its_finished_runs(capped_speedrun):
    """The speedrun benchmark writes its JSON after compiling and after every run: stopped
    at its cap part-way through 100,000 runs, it has left its compile time and the runs it
    finished in gpu.json, and the next item still runs. The cap leaves room for the start,
    the compile and one run beside a test worker's other items on two cores (a compile
    there has taken up to 30 s, a run up to 3 s). Once its first run is written the item
    is frozen, as a hung item would be, so that the cap's wait costs no CPU."""
    tmp_path, script, freezer = capped_speedrun
    result = finish(script)
    freezer.join()
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-2000:]
    items = json.loads((tmp_path / "gpu.json").read_text())["items"]
    speedrun = items["speedrun"]
    assert speedrun["status"] == "stopped after 60 s (its 60 s cap)"
    assert speedrun["cap_seconds"] == 60 and 60 <= speedrun["seconds"] < 75
    partial = speedrun["result"]
    assert partial["finished"] is False and partial["runs_asked"] == 100000
    assert partial["compile_seconds"] > 0 and 1 <= len(partial["runs"]) < 100000
    assert partial["accuracy_mean"] == pytest.approx(
        sum(run["test_accuracy"] for run in partial["runs"]) / len(partial["runs"]))
    assert items["seed_64_replicas"]["status"] == "stopped after 1 s (its 1 s cap)"
    ratios = json.loads((tmp_path / "gpu.json").read_text())["ratios"]  # the baseline alone
    assert ratios == {"card": "cpu", "baseline": "speedrun",
                      "baseline_seconds": partial["seconds_mean"], "over_baseline": {}}


@pytest.mark.slow
@pytest.mark.parametrize("broken", ["wheels", "data"])
def test_a_failing_setup_step_is_recorded_before_any_item(broken, tmp_path):
    wheels, npz_dir = tmp_path / "wheels", tmp_path / "npz"
    wheels.mkdir()
    npz_dir.mkdir()  # no cifar10_jpeg.py: the decode fails
    if broken == "wheels":
        (wheels / "broken-1.0-py3-none-any.whl").write_bytes(b"not a zip archive")
    flags = ([] if broken == "data" else ["--data_dir=D"])
    result = subprocess.run([sys.executable, str(SCRIPT), f"--out={tmp_path / 'out'}",
                             f"--wheels={wheels}", f"--data_npz_dir={npz_dir}", *flags],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "Traceback" not in result.stdout
    report = json.loads((tmp_path / "out" / "gpu.json").read_text())
    step = report["setup"][broken]
    assert step["status"] == "failed (exit 1)" if broken == "wheels" else "failed (exit 2)"
    assert step["error"] and step["cap_seconds"] == next(
        s.cap for s in load_script().PLAN if s.name == broken)
    assert "preflight" not in report["setup"] and report["items"] == {}
    assert "nvidia_smi" in report["environment"] or "variables" in report["environment"]
    assert f"setup step {broken} failed" in result.stdout


def test_the_plan_adds_up_and_benchmarks_md_shows_it():
    """The plan's rules, whatever its items and budgets: each device call's caps fit its
    budget and the calls with the machine's start fit a loan; what does not fit is
    dropped least informative first, still runs first among the extras and the table
    says so; the baseline every ratio needs runs first in the same call; each compile
    setting and lever reaches its item's command; BENCHMARKS.md shows the plan."""
    gpu = load_script()
    loan, machine_start = 900, 120  # a device loan's seconds; its start, at most
    assert sum(gpu.BUDGETS.values()) + machine_start <= loan
    for part, (plan, extras) in gpu.PARTS.items():
        assert sum(step.cap for step in plan) <= gpu.BUDGETS[part]
        assert all(step.expected < step.cap for step in plan + extras)
        names = [step.name for step, *_ in gpu.items("D", "A", "W", dry=False, part=part)]
        assert names == [s.name for s in plan + extras if s.name not in gpu.SETUP]
    assert sum(step.expected for step in gpu.PLAN) < 0.85 * gpu.BUDGET
    # dropping: what fit_to_budget leaves out of the wanted plan, in its order
    kept, dropped = gpu.fit_to_budget(gpu.PLAN_WANTED, gpu.BUDGET, gpu.LEAST_INFORMATIVE_FIRST)
    assert (kept, dropped) == (gpu.PLAN, gpu.DROPPED)
    assert bool(dropped) == (sum(step.cap for step in gpu.PLAN_WANTED) > gpu.BUDGET)
    assert gpu.EXTRAS[:len(dropped)] == dropped
    assert all(f"| 1, dropped to fit, run if time is left | {step.name} |" in gpu.plan_table()
               for step in dropped)
    steps = [gpu.Step(name, cap, 1, "", "") for name, cap in (("a", 5), ("b", 4), ("c", 3))]
    assert gpu.fit_to_budget(tuple(steps), 9, ("c", "b")) == ((steps[0], steps[1]), (steps[2],))
    assert gpu.fit_to_budget(tuple(steps), 5, ("c", "b")) == ((steps[0],), (steps[2], steps[1]))
    with pytest.raises(ValueError, match="exceed its 4 s budget"):
        gpu.fit_to_budget(tuple(steps), 4, ("c", "b"))
    # every ratio's baseline (the plain speedrun) first, in the same call as its levers
    names = [step.name for step in gpu.PLAN if step.name not in gpu.SETUP]
    assert names[0] == "speedrun"
    everything = names + [step.name for step in gpu.EXTRAS]
    assert set(gpu.XLA_SETTINGS) <= set(everything)
    commands = {step.name: command for step, command, _ in gpu.items("D", "A", "W", dry=False)}
    assert all(flag in " ".join(commands["speedrun_levers"]) for flag in gpu.LEVERS)
    assert not [arg for arg in commands["speedrun"] if arg.startswith("--config.model.")]
    for name, flags in gpu.XLA_SETTINGS.items():
        assert f"--config.train.xla_flags={flags}" in commands[name]
    assert all(flag in commands["compare_speedrun_strong"] for flag in gpu.STRONG_TWIN)
    assert gpu.plan_table() in (REPO / "BENCHMARKS.md").read_text()
    # the largest batches against the card's own memory: no fixed limit on a GPU
    assert not [arg for arg in commands["resnet50_largest_batch"] if "limit" in arg]


def test_a_plan_that_cannot_fit_is_refused():
    gpu = load_script()
    big, small = gpu.Step("big", 100, 90, "", ""), gpu.Step("small", 10, 9, "", "")
    assert gpu.fit_to_budget((big, small), 110, ("small",)) == ((big, small), ())
    assert gpu.fit_to_budget((big, small), 100, ("small",)) == ((big,), (small,))
    with pytest.raises(ValueError, match="exceed its 50 s budget"):
        gpu.fit_to_budget((big, small), 50, ("small",))


def test_the_best_settings_come_from_the_items_before(tmp_path):
    gpu = load_script()

    def bench(compile_seconds, runs):
        return {"result": {"compile_seconds": compile_seconds, "runs": [
            {"seconds": s, "test_accuracy": a} for s, a in runs],
            "seconds_mean": sum(s for s, _ in runs) / len(runs),
            "accuracy_mean": sum(a for _, a in runs) / len(runs)}}

    done = {"speedrun_corners": bench(30.0, [(1.30, 0.907)] * 10),
            "speedrun_levers": bench(40.0, [(1.00, 0.9075)] * 30),
            "compile_no_triton_gemm": bench(25.0, [(1.40, 0.9), (1.304, 0.9)]),  # kept
            "compile_parallel_llvm": bench(29.5, [(1.40, 0.9), (1.30, 0.9)]),  # saves < 1 s
            "compile_autotune_1": bench(20.0, [(1.40, 0.9), (1.30, 0.9)]),  # kept
            "compile_autotune_0": bench(10.0, [(3.00, 0.9), (2.90, 0.9)]),  # slows the step
            "compile_autotune_2": bench(22.0, [(1.40, 0.9), (1.29, 0.9)])}  # level 1 saves more
    chosen = gpu.best_settings(done)
    assert chosen["config"] == "levers" and chosen["overrides"] == list(gpu.LEVERS)
    assert chosen["settings"] == ["compile_no_triton_gemm", "compile_autotune_1"]
    assert chosen["xla_flags"] == ("--xla_gpu_enable_triton_gemm=false "
                                   "--xla_gpu_autotune_level=1")
    # The levers below the target, or too few of them: corners; nothing measured: defaults.
    done["speedrun_levers"] = bench(40.0, [(1.00, 0.9)] * 30)
    assert gpu.best_settings(done)["config"] == "corners"
    # corners no faster than the plain baseline: the plain speedrun
    done["speedrun"] = bench(31.0, [(1.29, 0.907)] * 10)
    plain = gpu.best_settings(done)
    assert plain["config"] == "plain" and plain["overrides"] == []
    assert plain["why"][1].startswith("plain: the default pooling's 1.290 s")
    del done["speedrun"]
    assert gpu.best_settings({}) == {"config": "corners", "overrides": list(gpu.CORNERS),
                                     "xla_flags": "", "settings": [], "why": [
                                         "speedrun_corners has no runs: corners, XLA's "
                                         "default settings"]}
    # The item's command carries the choice.
    listed = {step.name: command for step, command, _ in gpu.items(
        "D", "A", str(tmp_path), dry=False)}
    command, chosen = listed["whole_process_best"](done)
    assert chosen["config"] == "corners" and "--whole_process" in command
    assert ("--config.train.xla_flags=--xla_gpu_enable_triton_gemm=false "
            "--xla_gpu_autotune_level=1") in command


@pytest.mark.slow
def test_part_2s_preflight_stops_at_a_missing_airbench_script(tmp_path):
    gpu = load_script()
    with pytest.raises(FileNotFoundError, match="prepare it first .*--prepare_airbench"):
        gpu.preflight_part2(str(tmp_path / "airbench94_muon.py"))


def test_every_ratio_is_to_the_baseline_of_the_same_call():
    gpu = load_script()

    def bench(seconds, warmup=1):
        return {"result": {"runs_asked": len(seconds), "warmup_runs": warmup,
                           "runs": [{"seconds": s} for s in seconds],
                           "seconds_mean": sum(seconds) / len(seconds)}}

    items = {"speedrun_corners": bench([1.0, 1.0])}
    assert gpu.ratios(items, "NVIDIA H100 80GB HBM3") == {}  # no baseline yet
    items.update(speedrun=bench([1.25, 1.25]), speedrun_levers=bench([1.1, 0.9]),
                 compile_autotune_0=bench([9.0, 1.5], warmup=0),  # cold: its second run
                 inspect_speedrun_corners={"result": {"kernels_per_step": 9}},
                 compare_speedrun_strong={"result": {"results": [
                     {"framework": "torch_fast", "train_seconds": 2.4, "eval_seconds": 0.1}]}})
    assert gpu.ratios(items, "NVIDIA H100 80GB HBM3") == {
        "card": "NVIDIA H100 80GB HBM3", "baseline": "speedrun", "baseline_seconds": 1.25,
        "over_baseline": {"speedrun_corners": 0.8, "speedrun_levers": 0.8,
                          "compile_autotune_0": 1.2,
                          "compare_speedrun_strong (torch_fast)": 2.0}}


@pytest.mark.parametrize("line, card", [
    ("NVIDIA H100 80GB HBM3, 580.82.07, 81559, 1980, 2619, 700.00",
     {"name": "NVIDIA H100 80GB HBM3", "driver": "580.82.07", "memory_mib": 81559.0,
      "max_sm_clock_mhz": 1980.0, "max_memory_clock_mhz": 2619.0, "power_limit_w": 700.0}),
    ("NVIDIA H200, 580.159.04, 143771, 1980, 3201, [N/A]",
     {"name": "NVIDIA H200", "driver": "580.159.04", "memory_mib": 143771.0,
      "max_sm_clock_mhz": 1980.0, "max_memory_clock_mhz": 3201.0, "power_limit_w": None}),
    ('Field "clocks.max.sm" is not a valid field to query.', None),
    ("", None),
])
def test_the_card_is_read_from_nvidia_smi(line, card):
    gpu = load_script()
    assert gpu.card_from_smi(line) == card
    child = {"devices": ["NVIDIA H100 80GB HBM3"], "device_memory_bytes": 79_725_330_432}
    described = gpu.describe_card(card, child)
    assert described["jax_memory_bytes"] == 79_725_330_432
    assert described["name"] == (card["name"] if card else "NVIDIA H100 80GB HBM3")


def test_the_memory_limit_is_the_devices_own():
    """The largest-batch probes fit the limit JAX's allocator reports for the device (an
    H100's ~78 GiB, an H200's ~132 GiB); a backend that reports none (the CPU) needs
    --limit_gib, which the dry run passes."""
    from jaxtrain.perf import memory

    class Device:
        def __init__(self, stats):
            self.stats = stats

        def memory_stats(self):
            return self.stats

    assert memory.device_limit_bytes(Device({"bytes_limit": 79_725_330_432,
                                             "bytes_in_use": 0})) == 79_725_330_432
    assert memory.device_limit_bytes(Device(None)) is None  # XLA:CPU
    assert memory.device_limit_bytes(object()) is None
    gpu = load_script()
    dry = {step.name: command for step, command, _ in gpu.items("D", "A", "W", dry=True)}
    assert "--limit_gib=0.25" in dry["resnet50_largest_batch"]


# airbench94_muon's output as it prints it (two finished runs, a third cut off).
AIRBENCH_LINES = """\
---------------------------------------------------------------------------------
|  run     |  epoch  |  train_acc  |  val_acc  |  tta_val_acc  |  time_seconds  |
---------------------------------------------------------------------------------
|  warmup  |      0  |     0.1030  |   0.1000  |               |        9.1000  |
|          |   eval  |     0.1030  |   0.1000  |       0.1000  |       12.5000  |
---------------------------------------------------------------------------------
|       0  |      0  |     0.5000  |   0.6000  |               |        0.2000  |
|          |      1  |     0.7000  |   0.8000  |               |        0.4000  |
|          |   eval  |     0.9000  |   0.9050  |       0.9070  |        1.4700  |
---------------------------------------------------------------------------------
AUTOTUNE mm(2000x256, 256x10)
|       1  |      0  |     0.5000  |   0.6000  |               |        0.2000  |
|          |   eval  |     0.9000  |   0.9040  |       0.9080  |        1.3100  |
---------------------------------------------------------------------------------
|       2  |      0  |     0.5000  |   0.6000  |               |        0.2000  |
|          |      1  |""".splitlines()


def test_airbenchs_output_is_read_run_by_run():
    gpu = load_script()
    parsed = gpu.parse_airbench(AIRBENCH_LINES)
    assert parsed["warmup"]["tta_val_acc"] == 0.1 and parsed["finished"] is False
    assert [(r["run"], r["epochs"], r["tta_val_acc"], r["time_seconds"]) for r in parsed[
        "runs"]] == [(0, 2, 0.907, 1.47), (1, 1, 0.908, 1.31)]
    assert parsed["accuracy_mean"] == pytest.approx(0.9075)
    assert (parsed["seconds_min"], parsed["seconds_max"]) == (1.31, 1.47)
    done = gpu.parse_airbench(AIRBENCH_LINES[:-2] + ["Mean: 0.9075    Std: 0.0007"])
    assert done["finished"] and done["mean_line"] == "Mean: 0.9075    Std: 0.0007"


@pytest.mark.slow
def test_the_airbench_item_feeds_it_the_data_and_reads_it_until_its_cap(airbench_part2):
    """Part 2, dry: the stand-in reads the cifar10/*.pt the item wrote (its accuracy is above
    chance only if images and labels line up) and prints airbench's table; the item stops
    it before its cap and gpu_part2.json holds every run it finished."""
    tmp_path, script = airbench_part2
    result = finish(script)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    report = json.loads((tmp_path / "gpu_part2.json").read_text())
    assert report["part"] == 2 and list(report["setup"]) == ["data", "preflight"]
    assert report["setup"]["preflight"]["status"] == "ok"  # torch, the stand-in's script
    assert report["environment"]["child"]["airbench"]["reviewed"] is False
    entry = report["items"]["airbench94_muon"]
    assert entry["status"] == "ok" and "--airbench_seconds=13" in entry["command"]
    found = entry["result"]
    assert found["stopped_after_seconds"] == 13 and not found["finished"]
    assert found["sha256"] and found["reviewed"] is False  # the stand-in, not airbench
    runs = found["runs"]
    assert len(runs) >= 3 and [run["run"] for run in runs] == list(range(len(runs)))
    assert all(run["epochs"] == 8 and 0.15 < run["tta_val_acc"] < 1 for run in runs)
    assert found["warmup"]["wall_seconds"] < runs[0]["wall_seconds"] < 13
    assert found["seconds_mean"] == pytest.approx(
        sum(run["time_seconds"] for run in runs) / len(runs))


@pytest.mark.slow
def test_airbench_is_prepared_from_a_clone_or_a_file(tmp_path):
    gpu = load_script()
    repo = tmp_path / "cifar10-airbench"
    repo.mkdir()
    (repo / "airbench94_muon.py").write_text("print('airbench')\n")
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(git + ["init", "-q"], check=True)
    subprocess.run(git + ["add", "airbench94_muon.py"], check=True)
    subprocess.run(git + ["commit", "-qm", "x"], check=True)
    path = gpu.prepare_airbench(str(repo), str(tmp_path / "out"))
    assert Path(path).read_text() == "print('airbench')\n"
    source = json.loads((tmp_path / "out" / "source.json").read_text())
    head = subprocess.run(git + ["rev-parse", "HEAD"], capture_output=True, text=True).stdout
    assert source["commit"] == head.strip() and source["reviewed"] is False  # not f1c599c
    gpu.prepare_airbench(path, str(tmp_path / "again"))  # the file itself
    assert json.loads((tmp_path / "again" / "source.json").read_text())["commit"] is None
    assert "/.airbench/" in (REPO / ".gitignore").read_text().splitlines()


@pytest.mark.slow
def test_an_unknown_item_is_a_one_line_usage_error(tmp_path):
    result = subprocess.run([sys.executable, str(SCRIPT), "--data_dir=D", f"--out={tmp_path}",
                             "--only=speedrun,sppedrun"], cwd=REPO, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "error: --only: unknown item(s) sppedrun; choose from speedrun, speedrun_corners," in (
        result.stderr)
