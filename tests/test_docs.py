"""README.md and docs/*.md: the callback example runs as printed, and every command the
pages show names a config file that exists, config keys jaxtrain knows and flags its
command defines (so a page cannot drift from the code)."""
import csv
import re
import shlex
from pathlib import Path

import pytest
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
