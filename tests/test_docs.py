"""README.md and docs/*.md: the callback example runs as printed, and every command the
pages show names a config file that exists, config keys jaxtrain knows and flags its
command defines (so a page cannot drift from the code)."""
import csv
import json
import re
import shlex
import sys
from pathlib import Path

import fork_server
import numpy as np
import pytest
import quick_compile
from conftest import missing, require_module
from tolerances import TRAINING_STEPS
from test_callbacks import mlp_config

from jaxtrain.config import checks
from jaxtrain.run import loop
from jaxtrain.runtime import report

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# Each command's module, for its flags (absl DEFINE_* calls in these files).
COMMANDS = {"main.py": "jaxtrain/__main__.py", "jaxtrain": "jaxtrain/__main__.py",
            "jaxtrain.bench": "jaxtrain/bench.py", "jaxtrain.compare": "jaxtrain/compare.py",
            "jaxtrain.predict": "jaxtrain/predict.py",
            "jaxtrain.export": "jaxtrain/export.py", "jaxtrain.data": None}
DYNAMIC_KEYS = ("model.kwargs", "optimizer.groups.", "callbacks.")
ABSL_FLAGS = {"helpfull", "help", "flagfile"}


def page_commands():
    """(page, command words) of every `python main.py ...` / `python -m jaxtrain...` line
    in the pages' code (indented or fenced), continuation lines joined."""
    found = []
    for page in PAGES:
        text = re.sub(r"\\\n\s*", " ", page.read_text())
        inline = re.findall(r"`(python3? (?:main\.py|-m jaxtrain)[^`]*)`", text)
        for line in [*(line.strip() for line in text.splitlines()), *inline]:
            match = re.match(r"(?:python3?|\$ python3?) (main\.py|-m jaxtrain(?:\.\w+)?)\b(.*)",
                             line)
            if not match:
                continue
            words = shlex.split(re.sub(r"\[([^\]]*)\]", r"\1", match.group(2).split("#")[0])
                                .replace("`", ""), posix=True)
            name = match.group(1).removeprefix("-m ")
            found.append((page.name, name, words))
    return found


def defined_flags(path: str) -> set:
    source = (REPO / path).read_text()
    names = set(re.findall(r"DEFINE_\w+\(\s*\"([\w-]+)\"", source))
    names |= {f"no{name}" for name in names}
    return names | ABSL_FLAGS


def test_the_pages_hold_commands():
    commands = page_commands()
    assert len(commands) >= 25
    assert {page for page, _, _ in commands} >= {"README.md", "data.md", "training.md"}


@pytest.mark.parametrize("page, name, words", page_commands(),
                         ids=lambda value: value if isinstance(value, str) else None)
def test_every_command_names_real_files_keys_and_flags(page, name, words):
    known = checks.known_keys()
    module = COMMANDS.get(name)
    flags = defined_flags(module) if module else None
    for word in words:
        if not word.startswith("--"):
            continue
        flag, _, value = word[2:].partition("=")
        if flag == "config" and value.endswith(".py") and "/" in value and not value.startswith(
                ("path", "my", "/")):
            assert (REPO / value).is_file(), f"{page}: {word}: no such config file"
        elif flag.startswith("config."):
            key = flag[len("config."):]
            assert key in known or key.startswith(DYNAMIC_KEYS) or key == "KEY", (
                f"{page}: {word}: unknown key")
        elif flags is not None:
            assert flag in flags, f"{page}: `{name}` has no flag --{flag}"


@pytest.mark.slow
def test_the_readme_callback_runs_as_printed(cifar_batches_dir, tmp_path, monkeypatch):
    blocks = re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), re.S)
    (example,) = [b for b in blocks if b.startswith("# my_callbacks.py")]
    (tmp_path / "my_callbacks.py").write_text(example)
    monkeypatch.syspath_prepend(str(tmp_path))
    import my_callbacks

    evals = tmp_path / "evals.csv"
    summary = loop.train_and_evaluate(
        mlp_config(cifar_batches_dir), str(tmp_path / "run"),
        callbacks=[my_callbacks.TargetAccuracy(str(evals), target=0.2)])
    rows = [r for r in report.read_metrics(str(tmp_path / "run")) if "test_accuracy" in r]
    written = list(csv.reader(evals.open()))
    assert [int(step) for step, _, _ in written] == [r["step"] for r in rows]
    assert float(written[-1][2]) == pytest.approx(rows[-1]["test_accuracy"])
    assert rows[-1]["test_accuracy"] >= 0.2 > max(r["test_accuracy"] for r in rows[:-1])
    assert summary["stopped_early"]["step"] == rows[-1]["step"] < 200


# ---------------------------------------------------------------- the commands, run

# Documented commands that finish in seconds on a CPU once a run exists: evaluation,
# predict, export and the memory report. The training commands are the recipes' full
# runs (tests/test_main.py runs each recipe for a few steps); `jaxtrain.data download`
# needs the network, which the tests never reach (its code runs against a local server
# in tests/test_data_download.py).
def runnable(name: str, words: list) -> bool:
    return ((name in ("main.py", "jaxtrain") and "--mode=eval" in words)
            or name in ("jaxtrain.predict", "jaxtrain.export")
            or (name == "jaxtrain.bench" and "--memory" in words))


DOCUMENTED_RUNS = [(page, name, words) for page, name, words in page_commands()
                   if runnable(name, words)]

# Runs each command in a child forked after the heavy imports (done once, by fork_server),
# as its module's __main__.
RUNNER = """
import json, os, runpy, sys, traceback
commands = json.loads(sys.argv[1])
import absl.app, flax, jax, ml_collections, optax, orbax.checkpoint
import jaxtrain.inference.exporters, jaxtrain.perf.benchmark, jaxtrain.run.loop  # not the
# commands themselves: each defines its flags when it runs, once per child
results = []
for module, argv in commands:
    out, err = f"{len(results)}.out", f"{len(results)}.err"
    pid = os.fork()
    if pid == 0:
        os.dup2(os.open(out, os.O_WRONLY | os.O_CREAT), 1)
        os.dup2(os.open(err, os.O_WRONLY | os.O_CREAT), 2)
        sys.argv, code = [module, *argv], 0
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
            if e.code is not None and not isinstance(e.code, int):
                print(e.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
            code = 99
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    results.append({"status": os.waitstatus_to_exitcode(status),
                    "stdout": open(out).read()[-3000:], "stderr": open(err).read()[-3000:]})
print(json.dumps(results))
"""


@pytest.mark.slow
def test_every_documented_command_that_runs_on_a_cpu_runs_as_written(
        cifar_batches_dir, cifar_jpeg_folder, tmp_path):
    """Each command as the page prints it, from a folder laid out as the page assumes:
    its workdirs (runs/cifar, runs/photos, W, WORKDIR) a short run with a best checkpoint,
    ~/data the CIFAR-10 files, photos/ and more/cat.png real images."""
    root, home = tmp_path / "cwd", tmp_path / "home"
    (root / "runs").mkdir(parents=True)
    home.mkdir()
    (home / "data").symlink_to(cifar_batches_dir)
    (root / "configs").symlink_to(REPO / "configs")
    run = root / "runs" / "cifar"
    loop.train_and_evaluate(mlp_config(cifar_batches_dir, train__num_steps=20,
                                       eval__every_steps=10, checkpoint__every_steps=10,
                                       checkpoint__best_metric="test_accuracy"), str(run))
    (root / "runs" / "photos").symlink_to(run)
    last = max(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())
    (root / "photos" / "unsorted").mkdir(parents=True)
    jpegs = sorted((cifar_jpeg_folder / "test").rglob("*.jpg"))[:3]
    for jpeg in jpegs:
        (root / "photos" / "unsorted" / jpeg.name).write_bytes(jpeg.read_bytes())
    (root / "more").mkdir()
    from PIL import Image
    Image.open(jpegs[0]).save(root / "more" / "cat.png")
    placeholders = {"W": "runs/cifar", "WORKDIR": "runs/cifar", "PATH...": "photos",
                    "--config=...": "--config=configs/cifar_seed_cnn.py"}
    commands = []
    for page, name, words in DOCUMENTED_RUNS:
        argv = []
        for word in words:
            word = placeholders.get(word, word)
            for placeholder in ("W", "WORKDIR"):
                word = word.replace(f"={placeholder}", f"={placeholders[placeholder]}")
            word = word.replace("~/", f"{home}/").replace("checkpoints/980",
                                                           f"checkpoints/{last}")
            argv.append(word)
        module = "jaxtrain.__main__" if name in ("main.py", "jaxtrain") else name
        commands.append((module, argv))
    # XLA's LLVM at -O0: the commands compile big programs (ResNet-50's memory report) and
    # run them for a few images at most (quick_compile.py)
    env = {**quick_compile.env(0), "PYTHONPATH": f"{REPO}", "HOME": str(home)}
    done = fork_server.run([sys.executable, "-c", RUNNER, json.dumps(commands)], cwd=root,
                           capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    for (page, name, words), result in zip(DOCUMENTED_RUNS, results):
        assert result["status"] == 0, (page, name, " ".join(words), result["stderr"])
    assert len(results) == len(DOCUMENTED_RUNS) >= 10


# ---------------------------------------------------------------- docs/python.md, run

def run_python_page_script(name: str, folder):
    """docs/python.md's script whose first line names it `name`, saved in `folder` and run
    there as a user runs it (Fashion-MNIST from the system's package); its finished process."""
    if not Path("/usr/share/datasets/fashion-mnist").is_dir():
        missing("no Fashion-MNIST in /usr/share/datasets/fashion-mnist: "
                "apt-get install dataset-fashion-mnist")
    blocks = re.findall(r"```python\n(.*?)```", (REPO / "docs" / "python.md").read_text(), re.S)
    (script,) = [block for block in blocks if block.startswith(f"# {name}")]
    (folder / name).write_text(script)
    done = fork_server.run([sys.executable, name], cwd=folder, capture_output=True, text=True,
                           timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.mark.slow
def test_the_python_page_s_script_runs_as_printed(tmp_path):
    """docs/python.md's script, as a user saves and runs it (from any folder: the recipe
    comes from the installed package): it trains, reads its history, classifies files
    and exports; the history is metrics.jsonl's, the ONNX file gives restore's
    probabilities."""
    onnxruntime = require_module("onnxruntime", "pip install -e .[export]")
    done = run_python_page_script("train_fashion.py", tmp_path)
    workdir = tmp_path / "runs" / "fashion_py"
    summary = json.loads((workdir / report.SUMMARY_FILE).read_text())
    assert summary["steps"] == 468 and summary["test_accuracy"] > 0.8  # chance: 0.1
    assert summary["param_count"] == 248734  # the article's 784-256-128-100-10 with BatchNorm
    assert f"test accuracy {summary['test_accuracy']:.2%} after 468 steps" in done.stdout
    evaluations = [row for row in report.read_metrics(str(workdir)) if "test_loss" in row]
    assert [row["step"] for row in evaluations] == [200, 400, 468]
    for row in evaluations:
        assert f"step {row['step']}: test_accuracy {row['test_accuracy']:.2%}" in done.stdout
    # each file's class and probability (restore's predict_files) as the ONNX file gives them
    printed = re.findall(r"^item(\d)\.png is \('([^']+)', ([\d.e-]+)\)", done.stdout, re.M)
    assert [int(i) for i, _, _ in printed] == [0, 1, 2, 3]
    import jaxtrain
    test = jaxtrain.load("fashion_mnist")
    session = onnxruntime.InferenceSession(str(tmp_path / "fashion_mlp.onnx"))
    exported = session.run(None, {"images": test.x_test[:4]})[0]
    assert [name for _, name, _ in printed] == [test.class_names[i] for i in exported.argmax(1)]
    # onnxruntime's kernels against XLA's, of probabilities (at most 1)
    np.testing.assert_allclose([float(p) for _, _, p in printed], exported.max(1),
                               atol=TRAINING_STEPS)
    assert json.loads((tmp_path / "fashion_mlp.onnx.json").read_text())["format"] == "onnx"


@pytest.mark.slow
def test_the_python_page_s_own_parts_script_runs_as_printed(tmp_path):
    """docs/python.md's second script: an NNX model, an optax chain given the schedule, a
    focal loss and an augmentation from Python train, resume when passed again and restore
    with the model alone; the loss reported is the focal loss, the rates logged lion's."""
    done = run_python_page_script("train_your_parts.py", tmp_path)
    workdir = tmp_path / "runs" / "your_parts"
    summary = json.loads((workdir / report.SUMMARY_FILE).read_text())
    assert summary["steps"] == 400 and summary["resumed_from_step"] == 300
    assert summary["test_accuracy"] > 0.75  # chance: 0.1
    config = json.loads((workdir / "config.json").read_text())
    assert (config["model"]["name"], config["optimizer"]["name"], config["train"]["loss"],
            config["augment"]["fn"]) == ("instance:__main__:SmallNet", "python:__main__:optimizer",
                                         "python:__main__:focal_loss",
                                         "python:__main__:brightness")
    first = [row for row in report.read_metrics(str(workdir)) if row["step"] <= 300]
    rates = [row["learning_rate"] for row in first if "learning_rate" in row]
    assert rates[0] == pytest.approx(3e-4, rel=0.02) and rates[-1] == pytest.approx(1e-6)
    (evaluated,) = [row for row in first if row["step"] == 300 and "test_loss" in row]
    assert f"test focal loss {evaluated['test_loss']:.4f} after 300 steps" in done.stdout
    assert "resumed from step 300, ended at 400" in done.stdout
    (right,) = re.findall(r"restored: ([\d.]+)% of 1000 test images right", done.stdout)
    assert float(right) > 75


# ---------------------------------------------------------------- README's headline table

def test_the_readme_s_headline_figures_are_the_committed_results():
    """Each figure of README's first table is the one in benchmarks/results/."""
    results = REPO / "benchmarks" / "results"
    h200 = json.loads((results / "h200.json").read_text())["items"]
    rerun = json.loads((results / "h200_rerun.json").read_text())["items"]
    cpu = json.loads((results / "cpu_speed.json").read_text())["recipes"]
    jax_run, torch_run = h200["compare_speedrun"]["result"]["results"]
    jax_resnet, torch_resnet = rerun["finetune_resnet50_224"]["result"]["results"]
    assert (jax_run["framework"], torch_run["framework"]) == ("jax", "torch_fast")
    assert (jax_resnet["framework"], torch_resnet["framework"]) == ("jax", "torch_fast")
    expected = {
        "configs/cifar_speedrun.py": (
            f"**{jax_run['train_seconds']:.3f} s**, {jax_run['test_accuracy']:.2%}",
            f"{torch_run['train_seconds']:.3f} s, {torch_run['test_accuracy']:.2%} "
            "(`torch.compile`)", "H200"),
        "configs/finetune.py": (f"**{jax_resnet['images_per_second']:,.0f}**",
                                f"{torch_resnet['images_per_second']:,.0f} (`torch.compile`)",
                                "H200"),
        **{f"configs/{name}.py": (f"**{cpu[name]['jax_seconds']:.2f} s**",
                                  f"{cpu[name]['torch_fast_seconds']:.2f} s", "2-core CPU")
           for name in ("fashion_mnist_mlp", "cifar_seed_cnn", "fashion_mnist_cnn")}}
    section = (REPO / "README.md").read_text().split("## Headline figures")[1].split("\n## ")[0]
    rows = [[cell.strip() for cell in line.strip("|").split("|")]
            for line in section.splitlines() if line.startswith("| ") and "`configs/" in line]
    assert len(rows) == len(expected)
    for measured, jax_cell, torch_cell, where in rows:
        config = re.search(r"`(configs/\w+\.py)", measured)[1]
        assert (jax_cell, torch_cell, where.split(",")[0]) == expected[config], measured
    assert h200["compare_speedrun"]["result"]["results"][0]["device"] == "NVIDIA H200"
