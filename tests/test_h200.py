"""The prepared H200 script (benchmarks/h200.py), dry: items for a few steps on the CPU, so the
one GPU run a loan allows does not fail on something a CPU could have caught.

CI runs one item of each command the script uses (bench --inspect --profile, main.py,
compare with all three frameworks): about a minute instead of three. The other items'
commands are the same commands with flags the test modules of bench, speedrun and compare
run. Before a GPU loan, run every item by hand:
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
CI_ITEMS = ("inspect_speedrun", "cifar_train", "compare_seed")


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
    assert set(CI_ITEMS) <= {name for name, *_ in load_script().items("D", "W", dry=True)}
    for name, entry in items.items():
        assert entry["status"] == "ok", (name, entry.get("error"))
    assert report["dry"] and report["environment"]["backend"] == "cpu"

    inspected = items["inspect_speedrun"]["result"]
    assert inspected["kernels_per_step"] > 0 and inspected["flops_per_step"] > 0
    assert 0 < len(inspected["profile"]["top_ops"]) <= 10
    with tarfile.open(out / "profile_inspect_speedrun.tar.gz") as tar:
        assert any(n.endswith(".xplane.pb") for n in tar.getnames())
    assert 0 <= items["cifar_train"]["result"]["test_accuracy"] <= 1
    rows = items["compare_seed"]["result"]["results"]
    assert [row["framework"] for row in rows] == ["jax", "torch_article", "torch_fast"]
    assert len({row["param_count"] for row in rows}) == 1
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
                             "--only=speedrun,compare_seed", "--budget=0"],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    items = json.loads((tmp_path / "h200.json").read_text())["items"]
    assert list(items) == ["speedrun", "compare_seed"]
    assert all(entry["status"].startswith("skipped") for entry in items.values())


def test_an_unknown_item_is_a_one_line_usage_error(tmp_path):
    result = subprocess.run([sys.executable, str(SCRIPT), "--data_dir=D", f"--out={tmp_path}",
                             "--only=speedrun,sppedrun"], cwd=REPO, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "error: --only: unknown item(s) sppedrun; choose from speedrun," in result.stderr
