"""The package's layout rules, read from the source (AST, like test_docs.py): the tree is
the map only while these hold.

- data/ never imports JAX, Flax or optax: a Grain worker that reads data stays light.
- No import circles between jaxtrain's modules (imports inside functions count too).
- models/ and training/ never import run/, callbacks/, perf/, baselines/ or a command.
- Below run/ (models/, training/, weights/, runtime/, data/) nothing imports ml_collections:
  the config is read where a run starts; below, functions take its blocks or values.
- Every module lives in its folder: the top level holds only the commands and their
  shared parts, and no old flat module path is left behind.

Each rule is also checked against a small tree that breaks it, so a rule that stopped
finding anything would fail here too.
"""
import ast
import re
import textwrap
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "jaxtrain"
HEAVY = ("jax", "jaxlib", "flax", "optax", "orbax")
LOWER = ("models", "training")  # the parts a run is built from
BELOW_RUN = ("models", "training", "weights", "runtime", "data")  # where the config is not read
UPPER = ("run", "callbacks", "perf", "baselines")  # what uses them
COMMANDS = ("bench", "compare", "evaluate", "predict", "export", "cli", "__main__")
TOP_LEVEL = {"__init__", "__main__", "errors", "cli", *COMMANDS}
SUBPACKAGES = {"config", "data", "models", "weights", "training", "runtime", "run",
               "callbacks", "inference", "perf", "baselines", "recipes"}


def module_names(root: Path) -> dict:
    """{dotted module name: its file} for every .py under root (a package folder)."""
    names = {}
    for path in sorted(root.rglob("*.py")):
        parts = [root.name, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def imports_of(name: str, path: Path, modules: dict) -> set:
    """The modules of the package `name` imports anywhere in its file, and the outside
    top-level packages it imports (as 'outside:NAME')."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                       for alias in node.names]
        else:
            continue
        for target in targets:
            inside = target
            while inside not in modules and "." in inside:
                inside = inside.rpartition(".")[0]
            if inside in modules:
                if inside != name:
                    found.add(inside)
            else:
                found.add("outside:" + target.split(".")[0])
    return found


def import_graph(root: Path) -> dict:
    modules = module_names(root)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def circles(graph: dict) -> list:
    """Strongly connected groups of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w.startswith("outside:"):
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def folder(name: str) -> str:
    """'jaxtrain.training.step' -> 'training'; a top-level module -> its own name."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else ""


def broken_rules(root: Path) -> list[str]:
    """Every rule `root` (a package folder) breaks, one line each."""
    graph = import_graph(root)
    problems = []
    for name, targets in sorted(graph.items()):
        where = folder(name)
        for target in sorted(targets):
            if where == "data" and target.removeprefix("outside:") in HEAVY:
                problems.append(f"{name} imports {target.removeprefix('outside:')}: data/ "
                                "never imports JAX")
            if where in LOWER and not target.startswith("outside:") and (
                    folder(target) in UPPER or (folder(target) in COMMANDS
                                                and target.count(".") == 1)):
                problems.append(f"{name} imports {target}: {where}/ never imports run/, "
                                "callbacks/, perf/, baselines/ or a command")
            if where in BELOW_RUN and target == "outside:ml_collections":
                problems.append(f"{name} imports ml_collections: below run/, code takes config "
                                "blocks or values, not the config")
    for group in circles(graph):
        problems.append("import circle: " + " -> ".join(group))
    for path in sorted(root.glob("*.py")):
        if path.stem not in TOP_LEVEL:
            problems.append(f"{root.name}/{path.name}: a module outside the folders (the top "
                            "level holds the commands and their shared parts)")
    for path in sorted(p for p in root.iterdir() if p.is_dir() and p.name != "__pycache__"):
        if path.name not in SUBPACKAGES:
            problems.append(f"{root.name}/{path.name}/: a folder the layout does not name")
    return problems


def test_the_package_keeps_its_layout_rules():
    assert broken_rules(PACKAGE) == []


def test_the_package_has_no_import_circle_and_its_counts_are_as_documented():
    graph = import_graph(PACKAGE)
    assert circles(graph) == []
    inside = sum(1 for targets in graph.values() for t in targets if not t.startswith("outside:"))
    assert len(graph) > 60 and inside > 100  # a real graph was read, not an empty one


def readme_folders(text: str) -> set:
    """The folders README.md's Layout tree names under jaxtrain/ ('models/ops/' as 'models/ops')."""
    block = text.split("## Layout", 1)[1].split("```")[1]
    return {match.rstrip("/") for match in re.findall(r"^ {2}([a-z_]+/(?:[a-z_]+/)?)", block, re.M)}


def test_the_readme_layout_is_this_tree():
    folders = {str(path.parent.relative_to(PACKAGE)) for path in PACKAGE.rglob("__init__.py")}
    folders |= {path.name for path in PACKAGE.iterdir()  # recipes/: a link to ../configs
                if path.is_symlink() and (path / "__init__.py").is_file()}
    assert readme_folders((PACKAGE.parent / "README.md").read_text()) == folders - {"."}


def write_tree(root: Path, files: dict) -> Path:
    for relative, source in files.items():
        path = root / "jaxtrain" / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source))
    return root / "jaxtrain"


GOOD = {"__init__.py": "", "errors.py": "", "bench.py": "from jaxtrain.perf import benchmark\n",
        "data/__init__.py": "import numpy as np\nfrom jaxtrain.data import folder\n",
        "data/folder.py": "from jaxtrain import errors\n",
        "training/__init__.py": "", "training/step.py": "import jax\n",
        "run/__init__.py": "", "run/loop.py": "from jaxtrain.training import step\n",
        "perf/__init__.py": "", "perf/benchmark.py": "from jaxtrain.run import loop\n"}


def test_a_tree_that_keeps_the_rules_passes(tmp_path):
    assert broken_rules(write_tree(tmp_path, GOOD)) == []


@pytest.mark.parametrize("change, expected", [
    ({"data/folder.py": "import jax.numpy as jnp\n"},
     "jaxtrain.data.folder imports jax: data/ never imports JAX"),
    ({"data/folder.py": "def f():\n    from flax import linen\n"},
     "jaxtrain.data.folder imports flax: data/ never imports JAX"),
    ({"training/step.py": "from jaxtrain.run import loop\n"},
     "jaxtrain.training.step imports jaxtrain.run.loop: training/ never imports run/"),
    ({"models/__init__.py": "", "models/cnn.py": "from jaxtrain import bench\n"},
     "jaxtrain.models.cnn imports jaxtrain.bench: models/ never imports run/"),
    ({"training/step.py": "import ml_collections\n"},
     "jaxtrain.training.step imports ml_collections: below run/"),
    ({"runtime/__init__.py": "", "runtime/mesh.py": "def f():\n    from ml_collections import "
      "ConfigDict\n"}, "jaxtrain.runtime.mesh imports ml_collections: below run/"),
    ({"run/loop.py": "from jaxtrain.perf import benchmark\n"},
     "import circle: jaxtrain.perf.benchmark -> jaxtrain.run.loop"),
    ({"training/step.py": "def f():\n    from . import optim\n",
      "training/optim.py": "from jaxtrain.training import step\n"},
     "import circle: jaxtrain.training.optim -> jaxtrain.training.step"),
    ({"loop.py": ""}, "jaxtrain/loop.py: a module outside the folders"),
    ({"misc/__init__.py": ""}, "jaxtrain/misc/: a folder the layout does not name"),
])
def test_each_rule_finds_the_tree_that_breaks_it(tmp_path, change, expected):
    problems = broken_rules(write_tree(tmp_path, {**GOOD, **change}))
    assert any(problem.startswith(expected) for problem in problems), problems
