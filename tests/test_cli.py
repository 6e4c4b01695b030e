"""Commands that cannot mislead: one-line errors with the right exit status, nothing written,
a default workdir, checkpoints by step number, and Ctrl-C / SIGTERM in every phase."""
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import fork_server

from configs import cifar_seed_cnn
from jaxtrain.config import checks, defaults
from jaxtrain.errors import ConfigError
from jaxtrain.run import loop

REPO = Path(__file__).resolve().parents[1]
MAIN = str(REPO / "main.py")


def run_main(*args, cwd=REPO, timeout=300, env=None):
    return fork_server.run([sys.executable, MAIN, *args], cwd=cwd, capture_output=True,
                           text=True, timeout=timeout, env={**os.environ, **(env or {})})


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def assert_one_line_error(result, status, message=None):
    assert result.returncode == status, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert len(error_lines(result.stderr)) == 1, result.stderr[-2000:]
    if message is not None:
        assert error_lines(result.stderr)[0] == f"error: {message}", result.stderr


# ---------------------------------------------------------------- unknown keys

@pytest.mark.slow
def test_an_unknown_key_on_the_command_line_names_the_nearest(tmp_path):
    result = run_main("--config=configs/cifar.py", f"--workdir={tmp_path}",
                      "--config.train.batch_siz=3")
    assert_one_line_error(result, 2, "unknown config key 'train.batch_siz' "
                                     "(did you mean 'train.batch_size'?)")
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
def test_an_unknown_key_in_ones_own_config_file_is_refused(tmp_path):
    """`c.optimizer.lr = 0.01` used to train at the default 0.1, silently."""
    recipe = tmp_path / "my_recipe.py"
    recipe.write_text("from jaxtrain.config.defaults import get_config as defaults\n\n\n"
                      "def get_config():\n    c = defaults()\n    c.optimizer.lr = 0.01\n"
                      "    return c\n")
    result = run_main(f"--config={recipe}", f"--workdir={tmp_path / 'run'}")
    assert_one_line_error(result, 2, "unknown config key 'optimizer.lr' "
                                     "(did you mean 'optimizer.learning_rate'?)")
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_an_unknown_key_set_in_python_is_refused(tmp_path):
    config = cifar_seed_cnn.get_config()
    config.train.epochs = 3
    with pytest.raises(ConfigError, match=r"^unknown config key 'train.epochs' \(did you mean "
                                          r"'train.num_epochs'\?\)$"):
        loop.train_and_evaluate(config, str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()


def test_a_key_like_no_known_one_lists_its_blocks_keys_instead_of_a_wrong_guess():
    """'train.early_stopping' used to suggest 'train.label_smoothing' (the shared 'train.'
    made them look alike)."""
    known = checks.known_keys()
    message = str(checks.unknown_key_error("train.early_stopping", known))
    assert "did you mean" not in message
    assert message.startswith("unknown config key 'train.early_stopping': train has no such "
                              "key; its keys are accumulate_steps, batch_size, ")
    assert "label_smoothing" in message and "num_epochs" in message
    # near spellings and keys of another block are still found
    for typed, meant in (("model.init_fro", "model.init_from"), ("train.batchsize",
                                                                  "train.batch_size"),
                         ("optimizer.lr", "optimizer.learning_rate"),
                         ("train.learning_rate", "optimizer.learning_rate"),
                         ("eval.tta_frac", "eval.tta_fraction")):
        assert str(checks.unknown_key_error(typed, known)).endswith(
            f"(did you mean {meant!r}?)"), typed
    assert str(checks.unknown_key_error("trainer.steps", known)).endswith(
        "(did you mean 'train.num_steps'?)")  # the nearest block, then its nearest key
    message = str(checks.unknown_key_error("foo.bar", known))
    assert "did you mean" not in message and "top-level names are augment, " in message


@pytest.fixture
def my_model(tmp_path):
    """docs/models.md's model module, on the PYTHONPATH of main.py's process."""
    from test_user_model import readme_example
    (tmp_path / "mynets.py").write_text(readme_example())
    return {"PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}


@pytest.mark.slow
def test_a_user_models_arguments_are_set_from_the_command_line(my_model, tmp_path,
                                                                cifar_batches_dir):
    """--config.model.kwargs.width=8 reaches TinyNet(width=8); a typo is one line naming
    what the class takes; on a built-in model, one line saying kwargs are not its keys."""
    common = ["--config=configs/cifar_seed_cnn.py", "--config.model.name=mynets:TinyNet",
              f"--config.data.dir={cifar_batches_dir}", "--config.data.source=files",
              "--config.train.num_steps=1", "--config.eval.batch_size=500"]
    result = run_main(*common, f"--workdir={tmp_path / 'w8'}", "--config.model.kwargs.width=8",
                      env=my_model)
    assert result.returncode == 0, result.stderr[-2000:]
    summary = json.loads((tmp_path / "w8" / "summary.json").read_text())
    assert summary["config"]["model"]["kwargs"] == {"width": 8}
    # conv 3->8 and 8->16 (3x3 with bias), BatchNorm scale+bias, dense 16->10
    assert summary["param_count"] == (27 * 8 + 8) + 16 + (72 * 16 + 16) + 32 + (16 * 10 + 10)

    result = run_main(*common, f"--workdir={tmp_path / 'typo'}", "--config.model.kwargs.widht=8",
                      env=my_model)
    assert_one_line_error(result, 2, "--config.model.kwargs.widht: TinyNet takes no argument "
                                     "'widht' (did you mean 'width'? it takes num_classes, "
                                     "width, dtype)")
    result = run_main(*common, "--config.model.name=cifar_cnn", f"--workdir={tmp_path / 'b'}",
                      "--config.model.kwargs.width=8", env=my_model)
    assert_one_line_error(result, 2)
    assert "model.name='cifar_cnn' is built in" in result.stderr
    assert not (tmp_path / "typo").exists() and not (tmp_path / "b").exists()


# ---------------------------------------------------------------- every value checked

def bad_values(key: str, default):
    """A wrong-typed value of `key` (as typed on the command line) and, where the key has
    a range or choices, one outside them."""
    works, _ = checks.RANGES.get(key, (None, None))
    if isinstance(default, bool):
        wrong = "maybe"
    elif isinstance(default, (int, float)):
        wrong = "abc"
    elif isinstance(default, tuple):
        wrong = "abc" if not default or not isinstance(default[0], str) else "(1, 2)"
    else:
        wrong = "(1, 2)" if works is None else "no_such_choice"
    values = [wrong]
    if works is not None:
        for candidate in (-1, 0, 1.5, 1e9, -0.5, "(0,)", "(2.0, 1.0)", "(1.5, 2)", "(-0.5,)"):
            parsed = candidate
            if isinstance(candidate, str):
                parsed = tuple(float(x) for x in candidate.strip("(),").split(",") if x)
                if not isinstance(default, tuple):
                    continue
            elif isinstance(default, tuple) or isinstance(default, str):
                continue
            elif isinstance(default, int) and not isinstance(candidate, int):
                continue
            if not works(parsed):
                values.append(str(candidate))
                break
    return values


# Runs main.py as a script once per case, in a child forked after the heavy imports (a case
# then takes milliseconds, not the seconds of importing JAX): its exit status and stderr.
DRIVER = """
import json, os, runpy, sys, tempfile, traceback
CASES, MAIN = json.loads(sys.argv[1]), sys.argv[2]
import absl.app, flax, jax, ml_collections, optax, orbax.checkpoint
import jaxtrain.cli, jaxtrain.run.loop
results = []
for workdir, override in CASES:
    argv = [MAIN, "--config=configs/cifar_seed_cnn.py", f"--workdir={workdir}",
            "--config.data.source=files", "--config.data.dir=/nonexistent", override]
    err = tempfile.NamedTemporaryFile(suffix=".err", delete=False).name
    pid = os.fork()
    if pid == 0:
        os.dup2(os.open(err, os.O_WRONLY), 2)
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
        sys.argv, code = argv, 0
        try:
            runpy.run_path(MAIN, run_name="__main__")
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
            if not isinstance(e.code, int):
                print(e.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
            code = 99
        sys.stderr.flush()
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    with open(err) as f:
        stderr = f.read()
    os.unlink(err)
    results.append({"override": override, "status": os.waitstatus_to_exitcode(status),
                    "stderr": stderr,
                    "written": os.path.exists(workdir) and bool(os.listdir(workdir))})
print(json.dumps(results))
"""


ANY_VALUE = ("data.dir", "train.compilation_cache", "seed", "logging.mlflow", "logging.wandb",
             "logging.mlflow_experiment", "logging.mlflow_registered_model", "model.init_from",
             "model.init_from_exclude")


@pytest.mark.slow
def test_every_key_refuses_a_wrong_type_and_an_out_of_range_value(tmp_path):
    """For every key of jaxtrain/config/defaults.py, through main.py's own parsing and main():
    exactly one `error:` line, no traceback, exit status 2, nothing written."""
    # (optimizer.groups and callbacks hold entries of their own, checked in their tests)
    keys = [k for k in checks.flat_keys(defaults.get_config())
            if k not in ("optimizer.groups", "callbacks")]
    config = defaults.get_config()
    cases, expected = [], {}
    for key in keys:
        if key in ANY_VALUE:  # any string or int is a value these may take
            continue
        default = checks._value(config, key)
        for value in bad_values(key, default):
            override = f"--config.{key}={value}"
            cases.append((str(tmp_path / f"w{len(cases)}"), override))
            expected[override] = key
    ranged = {k for k in keys if k in checks.RANGES}
    # A key added without a rule must get one (booleans take any value of their type;
    # data.dir, train.compilation_cache, seed and the trackers' URI and project any string
    # and int; model.name and optimizer.name have their own checks).
    assert {k for k in keys if not isinstance(checks._value(config, k), bool)} - {
        *ANY_VALUE, "model.name", "optimizer.name"} <= ranged
    done = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(cases), MAIN], cwd=REPO,
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(results) == len(cases)
    for key in ranged:  # a number or tuple with a range: a wrong type and a value outside it
        if not isinstance(checks._value(config, key), str):
            assert sum(k == key for k in expected.values()) == 2, key
    for result in results:
        what = f"{result['override']}: {result['stderr']!r}"
        assert result["status"] == 2, what
        assert "Traceback" not in result["stderr"], what
        assert len(error_lines(result["stderr"])) == 1, what
        assert expected[result["override"]] in result["stderr"] or "--config." in \
            result["stderr"], what
        assert not result["written"], what


@pytest.mark.slow
@pytest.mark.parametrize("args, message", [
    (("--config=configs/cifar10.py",),
     "--config=configs/cifar10.py: no such file (did you mean configs/cifar.py?)"),
    (("--config.data.dir=/data",),
     "--config.data.dir overrides a config, but no --config=FILE names one "
     "(e.g. --config=configs/cifar.py)"),
    (("--config=configs/cifar.py", "--config.model.name=resnet999"),
     "config.model.name='resnet999': unknown model (did you mean 'resnet50'? one of seed_cnn, "
     "cifar_cnn, mlp, resnet18, resnet34, resnet50, vit_tiny, vit_small, vit_base, or "
     "'package.module:Class' for your own)"),
    (("--config=configs/cifar.py", "--config.optimizer.momentum=1.5"),
     "config.optimizer.momentum=1.5: must be in [0, 1)"),
    (("--config=configs/cifar.py", "--config.augment.rotate=-5"),
     "config.augment.rotate=-5.0: must be in [0, 180] (degrees)"),
    (("--config=configs/cifar.py", "--config.train.accumulate_steps=3"),
     "config.train.accumulate_steps=3: must divide train.batch_size=1024 (each micro-batch is "
     "batch_size / accumulate_steps images): one of 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024"),
    (("--config=configs/cifar.py", "--confg.train.batch_size=64"),
     "unknown flag --confg.train.batch_size (did you mean --config.train.batch_size?)"),
    (("--config=configs/cifar.py", "--workdri=runs/x"),
     "unknown flag --workdri (did you mean --workdir?)"),
    ((), "--config=FILE names the recipe to train (e.g. --config=configs/cifar.py)"),
])
def test_usage_errors_are_one_line_with_status_2(tmp_path, args, message):
    result = run_main(*args, f"--workdir={tmp_path / 'run'}")
    assert_one_line_error(result, 2, message)
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_a_model_that_cannot_take_the_images_names_the_key(cifar_batches_dir, tmp_path):
    result = run_main("--config=configs/cifar.py", f"--workdir={tmp_path / 'run'}",
                      f"--config.data.dir={cifar_batches_dir}", "--config.data.source=files",
                      "--config.model.widths=(8,8,8,8,8,8)")
    assert_one_line_error(result, 2)
    assert error_lines(result.stderr)[0].startswith(
        "error: config.model.widths=(8, 8, 8, 8, 8, 8): cifar_cnn halves the image once per "
        "block: 6 blocks are too many for 32x32x3 images")
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_missing_data_is_a_failed_run_status_1(tmp_path):
    result = run_main("--config=configs/cifar.py", f"--workdir={tmp_path / 'run'}",
                      "--config.data.source=files", f"--config.data.dir={tmp_path / 'none'}",
                      env={"HOME": str(tmp_path)})
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------- workdir and --checkpoint

@pytest.fixture(scope="module")
def default_workdir_run(cifar_batches_dir, tmp_path_factory):
    """The seed recipe, 20 steps, checkpoints at 10 and 20, without --workdir."""
    cwd = tmp_path_factory.mktemp("cwd")
    result = run_main(f"--config={REPO / 'configs' / 'cifar_seed_cnn.py'}",
                      f"--config.data.dir={cifar_batches_dir}", "--config.data.source=files",
                      "--config.train.num_steps=20", "--config.checkpoint.every_steps=10",
                      "--config.train.log_every_steps=10", cwd=cwd)
    assert result.returncode == 0, result.stderr[-2000:]
    return cwd, result


@pytest.mark.slow
def test_without_workdir_the_run_goes_to_runs_config_stem(default_workdir_run):
    cwd, result = default_workdir_run
    assert result.stdout.splitlines()[0] == ("workdir: runs/cifar_seed_cnn (--workdir not "
                                             "given: runs/<config file name>)")
    assert (cwd / "runs" / "cifar_seed_cnn" / "summary.json").is_file()


@pytest.mark.slow
def test_eval_uses_the_runs_config_and_takes_a_step_number(default_workdir_run):
    """--config names another recipe (cifar.py's model and TTA), and no data.dir is given:
    the run's config.json decides, and the overrides typed now go on top."""
    cwd, _ = default_workdir_run
    workdir = cwd / "runs" / "cifar_seed_cnn"
    common = (f"--config={REPO / 'configs' / 'cifar.py'}", "--mode=eval",
              f"--workdir={workdir}")
    result = run_main(*common, "--checkpoint=10", "--config.eval.tta=flip", cwd=cwd)
    assert result.returncode == 0, result.stderr[-2000:]
    assert (f"evaluating with the run's config ({workdir / 'config.json'}) and "
            "--config.eval.tta") in result.stdout
    assert "checkpoint step 10:" in result.stdout and "(TTA: flip; on 1 device)" in result.stdout
    missing = run_main(*common, "--checkpoint=15", cwd=cwd)
    assert_one_line_error(missing, 1, f"no checkpoint at step 15 in {workdir / 'checkpoints'} "
                                      "(saved steps: 10, 20)")


# ---------------------------------------------------------------- resume checks the recipe

@pytest.mark.slow
def test_resuming_with_another_recipe_stops_naming_every_change(default_workdir_run,
                                                                  cifar_batches_dir):
    cwd, _ = default_workdir_run
    workdir = cwd / "runs" / "cifar_seed_cnn"
    before = (workdir / "config.json").read_text()
    config = cifar_seed_cnn.get_config()
    config.data.dir, config.data.source = str(cifar_batches_dir), "files"
    config.train.num_steps, config.checkpoint.every_steps = 20, 10
    config.train.log_every_steps = 10
    config.optimizer.learning_rate, config.seed, config.optimizer.name = 0.01, 3, "adamw"
    config.eval.batch_size, config.train.log_every_steps = 500, 5  # these may change
    with pytest.raises(ConfigError) as error:
        loop.train_and_evaluate(config, str(workdir))
    assert str(error.value) == (
        f"{workdir} holds checkpoints of another recipe (optimizer.learning_rate: 0.001 -> "
        "0.01; optimizer.name: 'sgd' -> 'adamw'; seed: 0 -> 3). Use a new --workdir, or resume "
        "anyway with --config.checkpoint.allow_recipe_change=True (the run is then no longer "
        "an exact resume)")
    assert (workdir / "config.json").read_text() == before


@pytest.mark.slow
def test_changes_that_leave_training_alone_resume(default_workdir_run, cifar_batches_dir,
                                                  tmp_path):
    cwd, _ = default_workdir_run
    workdir = tmp_path / "copy"
    import shutil
    shutil.copytree(cwd / "runs" / "cifar_seed_cnn", workdir)
    # Logging, evaluation and checkpoint policy changed, and (with a constant learning
    # rate) the length: none of it is a recipe change. The learning rate is, allowed here.
    allowed = run_main("--config=configs/cifar_seed_cnn.py", f"--workdir={workdir}",
                       f"--config.data.dir={cifar_batches_dir}", "--config.data.source=files",
                       "--config.train.num_steps=30", "--config.checkpoint.every_steps=5",
                       "--config.train.log_every_steps=5", "--config.eval.batch_size=250",
                       "--config.checkpoint.keep=5", "--config.optimizer.learning_rate=0.002",
                       "--config.checkpoint.allow_recipe_change=True")
    assert allowed.returncode == 0, allowed.stderr[-2000:]
    assert "resumed from checkpoint step 20" in allowed.stdout
    assert ("resuming with a changed recipe (optimizer.learning_rate: 0.001 -> 0.002): "
            "checkpoint.allow_recipe_change=True") in allowed.stdout
    assert json.loads((workdir / "summary.json").read_text())["steps"] == 30


# ---------------------------------------------------------------- signals in every phase

def start(*args, cwd=REPO, env=None):
    return subprocess.Popen([sys.executable, MAIN, *args], cwd=cwd, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, **(env or {})})


def assert_stopped(process, signum, phase):
    out, err = process.communicate(timeout=120)
    assert process.returncode == 128 + signum, err[-2000:]
    assert "Traceback" not in err and "Fatal Python error" not in err, err[-2000:]
    lines = [line for line in err.splitlines() if line.startswith("stopped:")]
    assert len(lines) == 1, err[-2000:]
    assert lines[0].startswith(f"stopped: interrupted by {signal.Signals(signum).name} "
                               f"while {phase}"), lines[0]


@pytest.mark.slow
def test_a_signal_while_starting_stops_cleanly(tmp_path):
    process = start("--config=configs/cifar.py", f"--workdir={tmp_path / 'run'}")
    time.sleep(0.5)  # importing JAX and Flax takes seconds
    process.send_signal(signal.SIGINT)
    assert_stopped(process, signal.SIGINT, "starting")
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_a_signal_while_loading_the_data_stops_cleanly(tmp_path):
    with socket.socket() as silent:  # accepts the download, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(4)
        mirror = f"http://127.0.0.1:{silent.getsockname()[1]}/"
        process = start("--config=configs/cifar.py", f"--workdir={tmp_path / 'run'}",
                        "--config.data.source=download", f"--config.data.dir={tmp_path / 'd'}",
                        env={"HOME": str(tmp_path), "JAXTRAIN_DOWNLOAD_MIRROR": mirror})
        silent.settimeout(120)
        connection, _ = silent.accept()  # the loader is waiting for the archive now
        process.send_signal(signal.SIGTERM)
        assert_stopped(process, signal.SIGTERM, "loading the data")
        connection.close()
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_a_signal_while_compiling_stops_cleanly(cifar_batches_dir, tmp_path):
    workdir = tmp_path / "run"
    process = start("--config=configs/cifar.py", f"--workdir={workdir}",
                    f"--config.data.dir={cifar_batches_dir}", "--config.data.source=files",
                    "--config.train.batch_size=50")
    deadline = time.time() + 120
    while not (workdir / "config.json").exists():  # written just before compiling starts
        assert process.poll() is None and time.time() < deadline, process.communicate()
        time.sleep(0.02)
    process.send_signal(signal.SIGINT)
    assert_stopped(process, signal.SIGINT, "compiling")
    assert not (workdir / "metrics.jsonl").exists()
    assert not [p for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()]


# ---------------------------------------------------------------- installable

RECIPES = sorted(p for p in (REPO / "configs").glob("*.py") if p.name != "__init__.py")


@pytest.mark.slow
def test_pip_install_gives_jaxtrain_anywhere_with_its_defaults(cifar_batches_dir, tmp_path):
    """`pip install .` (here into a folder, from a copy of the package's files): import
    jaxtrain from elsewhere, and train from a config file kept outside the repository."""
    import shutil
    source = tmp_path / "source"
    shutil.copytree(REPO / "jaxtrain", source / "jaxtrain",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    target = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                           "--no-build-isolation", "--target", str(target), str(source)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    recipe = tmp_path / "elsewhere" / "my_recipe.py"
    recipe.parent.mkdir()
    recipe.write_text(
        "from jaxtrain.config.defaults import get_config as jaxtrain_defaults\n\n\n"
        "def get_config():\n    config = jaxtrain_defaults()\n"
        "    config.model.name = 'seed_cnn'\n    config.train.batch_size = 50\n"
        "    config.train.num_steps = 4\n    config.data.mean = (0.5,)\n"
        "    config.data.std = (0.25,)\n    return config\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(target)
    imported = subprocess.run([sys.executable, "-c", "import jaxtrain; print(jaxtrain.__file__)"],
                              cwd=recipe.parent, capture_output=True, text=True, env=env)
    assert imported.stdout.strip() == str(target / "jaxtrain" / "__init__.py"), imported.stderr
    trained = fork_server.run([sys.executable, "-m", "jaxtrain", f"--config={recipe}",
                              f"--config.data.dir={cifar_batches_dir}",
                              "--config.data.source=files"], cwd=recipe.parent,
                              capture_output=True, text=True, env=env, timeout=300)
    assert trained.returncode == 0, trained.stderr[-2000:]
    assert "workdir: runs/my_recipe" in trained.stdout
    summary = json.loads((recipe.parent / "runs" / "my_recipe" / "summary.json").read_text())
    assert summary["steps"] == 4
    # the repository's recipes load from anywhere too (one builds on another by its path,
    # not through a `configs` package), as main.py's --config loads them
    loaded = subprocess.run(
        [sys.executable, "-c", "import sys\nfrom ml_collections import config_flags\n"
         "for path in sys.argv[1:]:\n"
         "    print(config_flags.config_flags._LoadConfigModule('c', path).get_config()"
         ".model.name)", *map(str, RECIPES)],
        cwd=recipe.parent, capture_output=True, text=True, env=env, timeout=120)
    assert loaded.returncode == 0, loaded.stderr[-2000:]
    assert len(loaded.stdout.split()) == len(RECIPES) and "resnet18" in loaded.stdout.split()


@pytest.mark.slow
def test_a_signal_while_a_checkpoint_is_written_stops_after_it(cifar_batches_dir, tmp_path):
    """SIGTERM the moment a checkpoint's temporary folder appears (Orbax writing it): the
    run finishes that checkpoint, stops with one line naming a saved step, exit 143, and
    every checkpoint on disk is whole."""
    workdir = tmp_path / "run"
    process = start("--config=configs/cifar_seed_cnn.py", f"--workdir={workdir}",
                    f"--config.data.dir={cifar_batches_dir}", "--config.data.source=files",
                    "--config.train.num_steps=4000", "--config.train.log_every_steps=20",
                    "--config.checkpoint.every_steps=20", "--config.eval.every_epochs=0")
    deadline = time.time() + 120
    checkpoints = workdir / "checkpoints"
    while not (checkpoints.is_dir() and any("tmp" in p.name for p in checkpoints.iterdir())):
        assert process.poll() is None and time.time() < deadline, process.communicate()
        time.sleep(0.002)
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("stopped:")]
    assert len(lines) == 1 and lines[0].startswith("stopped: interrupted by SIGTERM at step ")
    step = int(lines[0].split("at step ")[1].split(";")[0])
    saved = sorted(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit())
    assert step == saved[-1] and all(not p.name.endswith("tmp") for p in checkpoints.iterdir())
    from jaxtrain.training import checkpoint
    manager = checkpoint.create_manager(str(checkpoints), create=False)
    try:
        assert checkpoint.read_meta(manager, step)["step"] == step
    finally:
        manager.close()
