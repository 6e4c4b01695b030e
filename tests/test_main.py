"""The command line, run as users run it: `python main.py --config=... --workdir=...`."""
import json
import os
import sys
from pathlib import Path

import pytest
import fork_server

REPO = Path(__file__).resolve().parents[1]


def run_main(*args, env=None):
    return fork_server.run([sys.executable, "main.py", *args], cwd=REPO, capture_output=True,
                           text=True, timeout=600, env={**os.environ, **(env or {})})


@pytest.mark.slow
def test_seed_recipe_runs_from_the_command_line(cifar_batches_dir, tmp_path):
    result = run_main("--config=configs/cifar_seed_cnn.py", f"--workdir={tmp_path}",
                      f"--config.data.dir={cifar_batches_dir}", "--config.train.num_steps=20",
                      "--config.train.log_every_steps=10")
    assert result.returncode == 0, result.stderr
    assert "test_accuracy=" in result.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 20
    assert summary["config"]["train"]["num_steps"] == 20  # the override reached the run
    assert summary["config"]["model"]["name"] == "seed_cnn"
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2
    assert (tmp_path / "curves.png").exists()
    assert list((tmp_path / "tensorboard").iterdir())


@pytest.mark.slow
def test_fast_recipe_config_runs(cifar_batches_dir, tmp_path):
    result = run_main("--config=configs/cifar.py", f"--workdir={tmp_path}",
                      f"--config.data.dir={cifar_batches_dir}", "--config.train.num_steps=2",
                      "--config.train.batch_size=32", "--config.eval.tta=none",
                      "--config.train.precision=float32")  # bfloat16: 20x slower on a CPU
    assert result.returncode == 0, result.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["config"]["model"]["name"] == "cifar_cnn"
    assert summary["param_count"] > 1_000_000


@pytest.mark.slow
@pytest.mark.parametrize("override,message", [
    ("--config.train.bogus=3", "unknown config key 'train.bogus'"),
    ("--config.nosuch.key=1", "unknown config key 'nosuch.key'"),
    ("--config.train.batch_size=abc", "--config.train.batch_size=abc"),
    ("--config.optimizer.nesterov=maybe", "--config.optimizer.nesterov"),
    ("--config.train.precision=float16", "config.train.precision='float16'"),
])
def test_bad_overrides_stop_with_a_message_naming_the_key(tmp_path, override, message):
    result = run_main("--config=configs/cifar.py", f"--workdir={tmp_path}", override,
                      "--config.data.dir=/nonexistent", "--config.data.source=files")
    assert result.returncode != 0
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "summary.json").exists()


@pytest.mark.slow
def test_missing_data_lists_where_it_looked(tmp_path):
    home = tmp_path / "home"
    result = run_main("--config=configs/cifar.py", f"--workdir={tmp_path / 'w'}",
                      f"--config.data.dir={tmp_path / 'nodata'}", "--config.data.source=files",
                      env={"HOME": str(home), "JAXTRAIN_DATA_DIR": str(tmp_path / "env")})
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    for place in (tmp_path / "nodata", tmp_path / "env", home / ".cache" / "jaxtrain"):
        assert str(place) in result.stderr
    assert "cifar-10-python.tar.gz" in result.stderr
    assert "--config.data.dir" in result.stderr
