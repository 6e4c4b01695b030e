"""The prepared H200 script (benchmarks/h200.py), dry: items for a few steps on the CPU, so the
one GPU run a loan allows does not fail on something a CPU could have caught.

CI runs one item of each command the script uses (bench --inspect --profile, main.py,
compare with torch.compile switched on, as a GPU has it), and the speedrun benchmark
stopped at its cap. The other items' commands are the same commands with flags the test
modules of bench, speedrun and compare run. Before a GPU loan, run every item by hand:
    python3 benchmarks/h200.py --dry --data_dir=DIR --out=/tmp/h200
"""
import importlib.util
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "h200.py"
CI_ITEMS = ("inspect_speedrun", "compare_seed", "cifar_train")  # in the plan's order


def load_script():
    spec = importlib.util.spec_from_file_location("h200", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def dry_run(cifar_batches_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("h200")
    result = subprocess.run([sys.executable, str(SCRIPT), "--dry",
                             f"--data_dir={cifar_batches_dir}", f"--out={out}",
                             f"--wheels={out / 'no-wheels'}", f"--only={','.join(CI_ITEMS)}"],
                            cwd=REPO, capture_output=True, text=True, timeout=900)
    return out, result


def test_every_item_runs_and_reports_its_figures(dry_run):
    out, result = dry_run
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    report = json.loads((out / "h200.json").read_text())
    items = report["items"]
    assert list(items) == list(CI_ITEMS)
    assert set(CI_ITEMS) <= {step.name for step, *_ in load_script().items("D", "A", "W",
                                                                            dry=True)}
    for name, entry in items.items():
        assert entry["status"] == "ok", (name, entry.get("error"))
    assert report["dry"] and report["environment"]["child"]["backend"] == "cpu"
    child = report["environment"]["child"]
    assert child["preflight"].startswith("ok") and child["packages"]["jax"]
    assert child["torch"]["cuda_available"] is False and "variables" in report["environment"]
    assert [report["setup"][name]["status"] for name in ("wheels", "data", "preflight")] == [
        "not needed", "not needed", "ok"]
    for name, entry in items.items():
        script = load_script()
        assert entry["cap_seconds"] == 10 * next(step.cap for step in script.PLAN + script.EXTRAS
                                                 if step.name == name)

    inspected = items["inspect_speedrun"]["result"]
    assert inspected["kernels_per_step"] > 0 and inspected["flops_per_step"] > 0
    assert 0 < len(inspected["profile"]["top_ops"]) <= 10
    with tarfile.open(out / "profile_inspect_speedrun.tar.gz") as tar:
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


def test_an_item_past_the_budget_is_stopped_and_the_rest_skipped(tmp_path):
    h200 = load_script()
    log = tmp_path / "sleep.log"
    status, seconds = h200.run_item([sys.executable, "-c", "import time; time.sleep(60)"],
                                    str(log), timeout=1.0, env={})
    assert status == "stopped after 1 s (out of time)" and seconds < 30
    assert log.read_text().startswith("$ ")
    result = subprocess.run([sys.executable, str(SCRIPT), "--data_dir=D", f"--out={tmp_path}",
                             "--wheels=/nonexistent", "--only=speedrun,compare_seed",
                             "--budget=0"],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    report = json.loads((tmp_path / "h200.json").read_text())
    assert report["setup"]["preflight"]["status"].startswith("skipped")
    assert report["items"] == {}  # the run ends at the setup step it could not run


def test_an_item_stopped_at_its_cap_reports_its_finished_runs(cifar_batches_dir, tmp_path):
    """The speedrun benchmark writes its JSON after compiling and after every run: stopped
    at its cap part-way through 100,000 runs, it has left its compile time and the runs it
    finished in h200.json, and the next item still runs."""
    result = subprocess.run([sys.executable, str(SCRIPT), "--dry",
                             f"--data_dir={cifar_batches_dir}", f"--out={tmp_path}",
                             "--wheels=/nonexistent", "--only=speedrun,seed_64_replicas",
                             "--runs=100000", "--caps=speedrun=45,seed_64_replicas=1"],
                            cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-2000:]
    items = json.loads((tmp_path / "h200.json").read_text())["items"]
    speedrun = items["speedrun"]
    assert speedrun["status"] == "stopped after 45 s (its 45 s cap)"
    assert speedrun["cap_seconds"] == 45 and 45 <= speedrun["seconds"] < 60
    partial = speedrun["result"]
    assert partial["finished"] is False and partial["runs_asked"] == 100000
    assert partial["compile_seconds"] > 0 and 1 <= len(partial["runs"]) < 100000
    assert partial["accuracy_mean"] == pytest.approx(
        sum(run["test_accuracy"] for run in partial["runs"]) / len(partial["runs"]))
    assert items["seed_64_replicas"]["status"] == "stopped after 1 s (its 1 s cap)"


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
    report = json.loads((tmp_path / "out" / "h200.json").read_text())
    step = report["setup"][broken]
    assert step["status"] == "failed (exit 1)" if broken == "wheels" else "failed (exit 2)"
    assert step["error"] and step["cap_seconds"] == next(
        s.cap for s in load_script().PLAN if s.name == broken)
    assert "preflight" not in report["setup"] and report["items"] == {}
    assert "nvidia_smi" in report["environment"] or "variables" in report["environment"]
    assert f"setup step {broken} failed" in result.stdout


def test_the_plan_adds_up_and_benchmarks_md_shows_it():
    h200 = load_script()
    assert sum(step.cap for step in h200.PLAN) == h200.BUDGET
    assert sum(step.expected for step in h200.PLAN) < 0.85 * h200.BUDGET
    assert all(step.expected < step.cap for step in h200.PLAN + h200.EXTRAS)
    names = [step.name for step, *_ in h200.items("D", "A", "W", dry=False)]
    assert names == [s.name for s in h200.PLAN + h200.EXTRAS if s.name not in h200.SETUP]
    # Dropped as duplicates: the same network as the speedrun's, the jax row of
    # compare_seed, the article's PyTorch (measured: 82.6 s).
    assert not {"inspect_cifar", "seed_single"} & set(names)
    assert "torch_article" not in " ".join(" ".join(c) for _, c, _ in h200.items(
        "D", "A", "W", dry=False))
    # The first loan (benchmarks/results/h200.json) settled the epoch count; what it measured
    # already runs after what it could not reach.
    assert not [name for name in names if name.endswith("_epochs")]
    assert names.index("compare_seed") < names.index("seed_64_replicas")
    assert names.index("resnet50_largest_batch") < names.index("cifar_train")
    assert h200.plan_table() in (REPO / "BENCHMARKS.md").read_text()


def test_an_unknown_item_is_a_one_line_usage_error(tmp_path):
    result = subprocess.run([sys.executable, str(SCRIPT), "--data_dir=D", f"--out={tmp_path}",
                             "--only=speedrun,sppedrun"], cwd=REPO, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "error: --only: unknown item(s) sppedrun; choose from speedrun," in result.stderr
