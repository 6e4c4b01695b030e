"""jaxtrain/run/loop.py and phases.py: the host loop's chunks, metrics rows, phase timing,
--profile and the persistent compilation cache, through main.py as a user runs it."""
import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import filelock
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import quick_compile
from tolerances import FLOAT64_DATASET
import fork_server

import jaxtrain
from jaxtrain import models
from jaxtrain.config import defaults
from jaxtrain.perf import hlo
from jaxtrain.run import loop, profiling, projection, start
from jaxtrain.run import plan as plan_lib
from jaxtrain.run import rows as rows_lib
from jaxtrain.runtime import phases, report
from jaxtrain.training import chunks, inputs, optim, train_state
from jaxtrain.training import step as step_lib

pytestmark = pytest.mark.usefixtures("compile_quickly")  # conftest.py

REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- chunks and rows

def test_chunks_end_at_epochs_checkpoints_evaluations_and_breaks_only():
    assert plan_lib.plan_chunks(7, 3, (2,)) == [(0, 0, 2), (0, 2, 1), (1, 0, 1), (1, 1, 2),
                                                (2, 0, 1)]
    assert plan_lib.plan_chunks(6, 3) == [(0, 0, 3), (1, 0, 3)]
    assert plan_lib.plan_chunks(10, 5, (0, 4), breaks=(1, 3)) == [
        (0, 0, 1), (0, 1, 2), (0, 3, 1), (0, 4, 1), (1, 0, 3), (1, 3, 2)]
    # a resumed run meets the same grid
    assert plan_lib.plan_chunks(10, 5, (4,), start_step=6) == [(1, 1, 2), (1, 3, 2)]


@pytest.mark.parametrize("total, per_epoch", [(20, 12500), (4680, 468), (25000, 12500),
                                              (243, 30), (97, 97), (10, 3)])
def test_about_fifty_rows_a_run_ending_on_every_epoch(total, per_epoch):
    on_grid = rows_lib.row_grid(0, per_epoch, total)
    rows = [step for step in range(1, total + 1) if on_grid(step)]
    assert min(total, 40) <= len(rows) <= 70, len(rows)
    assert all(on_grid(epoch_end) for epoch_end in range(per_epoch, total + 1, per_epoch))
    gaps = np.diff([0, *rows])
    assert gaps.max() <= 2 * max(gaps.min(), 1) + 1  # evenly spread, no slivers


def test_an_explicit_interval_is_kept_with_every_epoch_end_and_the_last_step():
    on_grid = rows_lib.row_grid(100, 468, 4650)
    assert [s for s in range(1, 501) if on_grid(s)] == [100, 200, 300, 400, 468, 500]
    assert [s for s in range(4550, 4651) if on_grid(s)] == [4600, 4650]


def test_rows_average_their_steps_and_count_skipped_ones():
    window = rows_lib.RowWindow(10)
    window.add({"loss": np.array([1.0, 3.0, np.nan]), "accuracy": np.array([0.5, 0.5, 0.0])})
    window.add({"loss": np.array([5.0, np.nan]), "accuracy": np.array([1.0, 0.0])})
    rows = [rows_lib.train_row(window.take(end), end) for end in (12, 14, 15)]
    assert rows[0] == {"step": 12, "train_loss": 2.0, "train_accuracy": 0.5}
    assert rows[1] == {"step": 14, "train_loss": 5.0, "train_accuracy": 1.0, "skipped_steps": 1}
    assert rows[2] == {"step": 15, "train_loss": None, "train_accuracy": None,
                       "skipped_steps": 1}
    assert window.steps == 0 and window.after == 15


def test_the_row_window_travels_through_a_checkpoint_as_json():
    window = rows_lib.RowWindow(40, {"loss": np.array([[1.5, np.nan], [2.0, 3.0]]),
                                     "accuracy": np.array([[0.5, 0.0], [0.25, 1.0]])})
    saved = json.loads(json.dumps(window.to_json()))
    assert saved == {"after": 40, "loss": [[1.5, None], [2.0, 3.0]],
                     "accuracy": [[0.5, 0.0], [0.25, 1.0]]}
    back = rows_lib.RowWindow.from_json(saved)
    assert back.after == 40 and back.steps == 2
    np.testing.assert_array_equal(back.per_step["loss"], window.per_step["loss"])
    assert rows_lib.RowWindow.from_json({"after": 7}).steps == 0


def test_eval_every_steps_adds_test_points():
    assert [s for s in range(1, 21) if plan_lib.evaluates_after(s, 100, 20, 1, 8)] == [8, 16, 20]
    assert [s for s in range(1, 21) if plan_lib.evaluates_after(s, 5, 20, 2, 0)] == [10, 20]


def test_channel_statistics_equal_numpy_over_the_whole_split():
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (2500, 8, 8, 3), dtype=np.uint8)
    images[:, :, :, 2] //= 3  # channels differ
    dataset = type("D", (), {"x_train": images, "image_shape": (8, 8, 3)})()
    config = type("C", (), {"data": type("Data", (), {"mean": (), "std": ()})()})()
    mean, std = inputs.channel_stats(dataset, config.data)
    np.testing.assert_allclose(mean, (images / 255.0).mean(axis=(0, 1, 2)), rtol=FLOAT64_DATASET)
    np.testing.assert_allclose(std, (images / 255.0).std(axis=(0, 1, 2)), rtol=FLOAT64_DATASET)


# ---------------------------------------------------------------- train.drop_finished_groups

@pytest.mark.slow
def test_a_finished_group_held_constant_ends_where_its_masked_rate_does():
    """Two replicas of a BatchNorm MLP whose first layer trains for 4 of 8 steps: the plan
    cut at step 4 (chunks.phased_chunks, as start.compile_training builds it) computes no
    gradient for that layer after it, in both loops, and ends with the same weights, to
    the bit, as the run that computes its gradient on every step and multiplies it by a
    zero rate."""
    config = defaults.get_config()
    config.model.name, config.model.hidden_sizes, config.model.batch_norm = "mlp", (32,), True
    opt = config.optimizer
    opt.learning_rate, opt.momentum, opt.schedule = 0.05, 0.9, "linear"
    opt.groups.first = defaults.param_group(r"Dense_0/.*", lr_scale=2.0, train_steps=4)
    model = models.create_model(config.model, 10, jnp.float32)
    tx = optim.create_optimizer(opt, optim.create_schedule(opt, 8))
    rng = np.random.default_rng(4)
    x = rng.integers(0, 256, (64, 8, 8, 3), dtype=np.uint8)
    y = rng.integers(0, 10, 64).astype(np.int32)
    spec = step_lib.StepSpec(batch_size=16, mean=(0.5,), std=(0.25,), num_classes=10,
                             label_smoothing=0.1, augment=dict(flip=False, translate=0))
    initial = train_state.create_train_state(jax.random.split(jax.random.key(0), 2), model, tx,
                                             (8, 8, 3), replicas=True)
    keys = jax.random.split(jax.random.key(1), 2)
    cuts = step_lib.finished_groups(opt, initial.params, total_steps=8)
    assert cuts == {4: frozenset({"Dense_0/kernel", "Dense_0/bias"})}
    plan = plan_lib.plan_chunks(8, 4, breaks=tuple(cuts))
    assert plan == [(0, 0, 4), (1, 0, 4)]
    for kind in ("scan", "python"):
        compiled = {}  # the masked run's program is the dropped run's before the cut

        def compile_phase(constant, lengths):
            if constant not in compiled:
                compiled[constant] = chunks.compile_chunks(
                    kind, initial, x, y, keys, lengths, spec.replace(constant_params=constant),
                    replicas=True)
            return compiled[constant]

        weights = {}
        for name, phase_cuts in (("masked", {}), ("dropped", cuts)):
            run_chunk = chunks.phased_chunks(plan, 4, phase_cuts, compile_phase)
            state = jax.tree.map(jnp.copy, initial)
            for epoch, first_step, length in plan:
                state, _ = run_chunk(state, keys, epoch, first_step, length)
                if epoch == 0:
                    at_cut = jax.device_get(state.params["Dense_0"])
            weights[name] = jax.device_get((state.params, state.batch_stats))
        before, after = [sum(hlo.kernel_counts(p.as_text()).values()) for p in run_chunk.programs]
        assert after < before, kind  # the first layer's backward is gone after the cut
        jax.tree.map(np.testing.assert_array_equal, weights["dropped"], weights["masked"])
        jax.tree.map(np.testing.assert_array_equal, weights["dropped"][0]["Dense_0"], at_cut)
        assert not np.array_equal(weights["dropped"][0]["Dense_1"]["kernel"],
                                  jax.device_get(initial.params["Dense_1"]["kernel"]))


# ---------------------------------------------------------------- phases

def test_laps_partition_the_time_and_print_their_lines():
    lines = []
    clock = phases.Clock(say=lines.append)
    clock.lap("imports", "imported")
    clock.lap("load", "loaded {seconds:.0f}x")
    clock.lap("train")
    clock.lap("train")
    assert lines[0].startswith("imported in ") and lines[0].endswith(" s")
    assert lines[1] == "loaded 0x" and len(lines) == 2
    assert abs(sum(clock.seconds.values()) - clock.total()) < 0.01
    assert clock.breakdown().startswith("time: ") and "total" in clock.breakdown()


def test_a_cache_that_is_off_says_how_it_was_turned_off():
    """The compile line says the cache is off and names the key that turned it off."""
    note = start.cache_note(None, {})
    assert "cache off" in note and "train.compilation_cache=''" in note
    assert "from the persistent cache" not in note  # no count of programs it never read


@pytest.mark.slow
def test_an_impossible_cache_folder_is_a_config_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    snippet = ("import sys\nfrom jaxtrain.runtime import xla_cache\n"
               "try:\n    xla_cache.enable(sys.argv[1])\n"
               "except xla_cache.ConfigError as error:\n    print(error)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    result = fork_server.run([sys.executable, "-c", snippet, str(blocker / "xla")], cwd=REPO,
                             capture_output=True, text=True, timeout=120, env=env)
    assert result.stdout.strip() == (
        f"config.train.compilation_cache='{blocker / 'xla'}': cannot create it (Not a "
        "directory); set train.compilation_cache='' to run without the compilation cache")


def test_the_cache_keeps_its_most_recently_used_programs_within_its_limit(tmp_path):
    """Trimmed once a process (xla_cache.trim), not by JAX's eviction before each write;
    only JAX's programs (and their last-use files) are counted and removed."""
    from jaxtrain.runtime import xla_cache
    day, now = 86400, 1.8e9
    for name, days_unused in (("a", 5), ("b", 1), ("c", 3), ("d", 2)):
        program = tmp_path / f"{name}-cache"
        program.write_bytes(b"x" * 100)
        os.utime(program, (now - days_unused * day, now - days_unused * day))
    (tmp_path / "a-atime").write_bytes(b"t")  # JAX's eviction kept one beside a program
    (tmp_path / "notes.txt").write_bytes(b"y" * 1000)  # not JAX's: never counted or removed
    os.utime(tmp_path / "notes.txt", (0, 0))
    xla_cache.trim(str(tmp_path), -1)  # no limit
    xla_cache.trim(str(tmp_path), 400)  # at the limit
    assert len(list(tmp_path.iterdir())) == 6
    xla_cache.trim(str(tmp_path), 250)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b-cache", "d-cache", "notes.txt"]
    assert jax.config.jax_compilation_cache_dir  # on (conftest), with JAX's limit off
    assert jax.config.jax_compilation_cache_max_size == -1


# ---------------------------------------------------------------- main.py, as a user runs it

def main_py(workdir, data_dir, home, *args):
    """A fresh process (not fork_server's): the console's first line times its imports."""
    env = quick_compile.env(0, {k: v for k, v in os.environ.items() if not k.startswith("JAX_")})
    return subprocess.run(
        [sys.executable, "main.py", "--config=configs/cifar_seed_cnn.py", f"--workdir={workdir}",
         f"--config.data.dir={data_dir}", "--config.data.source=files",
         "--config.train.num_steps=20", "--config.model.name=mlp",
         "--config.model.hidden_sizes=(32,)", *args], cwd=REPO, capture_output=True, text=True,
        timeout=300, env=dict(env, HOME=str(home)))


@pytest.fixture(scope="module")
def profiled_run(cifar_batches_dir, tmp_path_factory, worker_id):
    """20 steps of the seed recipe with an MLP (programs that compile in a second, no
    oneDNN to build in the fresh HOME), test points every 8 steps, 3 steps profiled; HOME
    is a fresh folder, so the compilation cache starts empty. Then the same command again
    in a new workdir (the same chunks of scanned steps: the same programs). Run once a
    session: the first pytest-xdist worker that asks runs it, the others read its output."""
    root = tmp_path_factory.getbasetemp()
    if worker_id != "master":  # the workers' folders share the session's
        root = root.parent
    root, outputs = root / "profiled_run", root / "profiled_run.json"
    with filelock.FileLock(str(outputs) + ".lock"):
        if not outputs.exists():
            home = root / "home"
            home.mkdir(parents=True)
            flags = ("--profile=3", "--config.eval.every_steps=8")
            done = [main_py(root / name, cifar_batches_dir, home, *flags)
                    for name in ("first", "again")]
            outputs.write_text(json.dumps([{"returncode": d.returncode, "stdout": d.stdout,
                                            "stderr": d.stderr} for d in done]))
    first, again = (types.SimpleNamespace(**d) for d in json.loads(outputs.read_text()))
    return root / "home", root, first, again


@pytest.mark.slow
def test_the_console_names_each_phase_as_it_ends(profiled_run):
    _, root, first, _ = profiled_run
    assert first.returncode == 0, first.stderr[-2000:]
    lines = first.stdout.splitlines()
    starts = ["imported JAX, Flax and jaxtrain in ", "loaded cifar10 from ", "built mlp (",
              "compiled the training and evaluation programs in "]
    found = [next(i for i, line in enumerate(lines) if line.startswith(prefix))
             for prefix in starts]
    assert found == sorted(found) and found[0] == 0, lines[:6]
    assert lines[-2].startswith("time: imports ") and "; total " in lines[-2]
    assert not any(line.startswith("projected:") for line in lines)  # a short run says none


@pytest.mark.slow
def test_the_summary_accounts_for_the_whole_process(profiled_run):
    _, root, first, _ = profiled_run
    summary = json.loads((root / "first" / report.SUMMARY_FILE).read_text())
    parts = summary["phase_seconds"]
    assert set(parts) == set(phases.NAMES)
    assert abs(sum(parts.values()) - summary["total_seconds"]) < 1.0
    assert parts["imports"] > 0 and parts["compile"] > 0 and parts["train"] > 0
    assert summary["train_only_seconds"] == pytest.approx(
        summary["train_seconds"] - summary["eval_seconds"])
    assert summary["eval_seconds"] > 0


@pytest.mark.slow
def test_rows_for_a_curve_and_test_points_every_n_steps(profiled_run):
    _, root, first, _ = profiled_run
    rows = report.read_metrics(str(root / "first"))
    assert [r["step"] for r in rows] == list(range(1, 21))  # 20 steps: a row each
    assert all(r["learning_rate"] == pytest.approx(0.001) for r in rows)
    assert [r["step"] for r in rows if "test_accuracy" in r] == [8, 16, 20]
    seconds = [r["seconds"] for r in rows]
    assert seconds == sorted(seconds)
    from PIL import Image
    with Image.open(root / "first" / report.PLOT_FILE) as image:
        assert image.size == (1500, 400)  # loss, accuracy and learning-rate panels


@pytest.mark.slow
def test_profile_writes_a_trace_and_prints_the_costliest_ops(profiled_run):
    _, root, first, _ = profiled_run
    profile_dir = root / "first" / profiling.PROFILE_DIR
    assert list(profile_dir.rglob("*.xplane.pb")) and list(profile_dir.rglob(
        "perfetto_trace.json.gz"))
    out = first.stdout
    assert "profile of steps 2-4 (" in out and f"tensorboard --logdir {profile_dir}" in out
    table = out.split("top ", 1)[1].splitlines()
    assert table[0].startswith("10 of ") and "3 traced steps" in table[0]
    assert len([line for line in table[1:11] if "% of op time" in line]) == 10
    summary = json.loads((root / "first" / report.SUMMARY_FILE).read_text())
    assert len(summary["profile"]["top_ops"]) == 10


@pytest.mark.slow
def test_the_second_run_reads_its_programs_from_the_cache(profiled_run):
    home, root, first, again = profiled_run
    assert again.returncode == 0, again.stderr[-2000:]
    cache = home / ".cache" / "jaxtrain" / "xla"
    assert cache.is_dir() and any(cache.iterdir())
    # Training, evaluation and its parts: every program compiled once, then all from the cache.
    compiled = re.search(rf"\(0 of (\d+) from the persistent cache in {re.escape(str(cache))}\)",
                         first.stdout)
    assert compiled and int(compiled[1]) >= 3, first.stdout
    count = compiled[1]
    assert f"({count} of {count} from the persistent cache in {cache})" in again.stdout
    summary = json.loads((root / "again" / report.SUMMARY_FILE).read_text())
    assert summary["compilation_cache"] == str(cache)
    before = json.loads((root / "first" / report.SUMMARY_FILE).read_text())
    assert summary["params_sha256"] == before["params_sha256"]


@pytest.mark.slow
def test_a_training_run_imports_neither_torch_nor_tensorflow(tmp_path):
    snippet = ("import sys\n"
               "import jaxtrain.__main__, jaxtrain.run.loop, jaxtrain.runtime.report\n"
               "jaxtrain.runtime.report.Reporter(sys.argv[1], total_steps=1).close()\n"
               "heavy = {'torch', 'tensorflow', 'tensorflow_datasets', 'matplotlib'}\n"
               "print(sorted(heavy & {m.split('.')[0] for m in sys.modules}))\n")
    result = subprocess.run([sys.executable, "-c", snippet, str(tmp_path)], cwd=REPO,
                            capture_output=True, text=True, timeout=120)  # a fresh process
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"


@pytest.mark.slow
def test_a_long_run_says_its_projected_time_once_within_its_first_chunk(
        cifar_batches_dir, tmp_path, monkeypatch, capsys):
    """Past projection.LONG_RUN_SECONDS (here 0 s) one line says how long is left, after a
    few timed steps of the first chunk (a CPU's convolutional chunk may take an hour),
    and on a CPU which recipes suit it."""
    from configs import cifar_seed_cnn
    monkeypatch.setattr(projection, "LONG_RUN_SECONDS", 0.0)
    config = cifar_seed_cnn.get_config()
    config.data.dir, config.data.source = str(cifar_batches_dir), "files"
    config.train.num_steps, config.train.batch_size = 12, 50  # one chunk,
    config.train.loop = "python"  # a call per step (a scanned chunk is timed as a whole)
    loop.train_and_evaluate(config, str(tmp_path))
    lines = [line for line in capsys.readouterr().out.splitlines()
             if line.startswith("projected:")]
    assert len(lines) == 1, lines
    # steps 2-4 timed (step 1 may carry first-run costs): 8 of the 12 left, the time left
    # their number times the seconds a step measured
    found = re.match(r"projected: about (.+?) of training left \((\d+) steps at ([0-9.e+-]+) "
                     r"s a step on ", lines[0])
    assert found, lines
    assert int(found[2]) == 8 and found[1] == projection.duration(8 * float(found[3]))
    # on a CPU, the recipes sized for one: each a recipe jaxtrain carries
    named = re.findall(r"configs/(\w+)\.py", lines[0])
    assert "cifar_seed_cnn" in named
    assert all((REPO / "configs" / f"{name}.py").is_file() for name in named)


def test_durations_read_as_hours_and_minutes():
    assert [projection.duration(s) for s in (45 * 60, 3 * 3600 + 20 * 60, 601)] == [
        "45 min", "3 h 20 min", "10 min"]


@pytest.mark.slow
def test_the_progress_bar_moves_after_every_compiled_call(cifar_batches_dir, tmp_path,
                                                          monkeypatch):
    """A CPU's scanned chunk (an epoch here) runs in calls of train.chunk_seconds (tiny
    here: a step each), and the progress bar is told after each, not at the chunk's end."""
    from configs import cifar_seed_cnn
    seen = []
    monkeypatch.setattr(report.Reporter, "advance", lambda self, step: seen.append(step))
    config = cifar_seed_cnn.get_config()
    config.data.dir, config.data.source = str(cifar_batches_dir), "files"
    config.model.name, config.model.hidden_sizes = "mlp", (16,)
    config.train.num_steps, config.train.batch_size = 12, 500  # 4 steps an epoch
    config.train.chunk_seconds = 1e-6
    summary = loop.train_and_evaluate(config, str(tmp_path))
    assert seen == list(range(1, 13)) and summary["steps"] == 12


@pytest.mark.slow
def test_a_chunk_past_the_pace_makes_the_rest_of_the_run_paced(cifar_batches_dir, tmp_path,
                                                                monkeypatch, capsys):
    """A GPU's way (its chunks whole until one takes longer than train.chunk_seconds),
    here on the CPU: after the first chunk the paced program is compiled and every later
    chunk runs in calls of the pace; the run ends where one that never paced does."""
    from configs import cifar_seed_cnn
    config = cifar_seed_cnn.get_config()
    config.data.dir, config.data.source = str(cifar_batches_dir), "files"
    config.model.name, config.model.hidden_sizes = "mlp", (16,)
    config.train.num_steps, config.train.batch_size = 12, 500  # 4 steps an epoch
    whole = loop.train_and_evaluate(dict_copy(config, chunk_seconds=0.0), str(tmp_path / "a"))
    monkeypatch.setattr(start, "paced_from_the_start", lambda: False)
    seen = []
    monkeypatch.setattr(report.Reporter, "advance", lambda self, step: seen.append(step))
    paced = loop.train_and_evaluate(dict_copy(config, chunk_seconds=1e-6), str(tmp_path / "b"))
    out = capsys.readouterr().out
    assert ("a chunk took " in out and ", over train.chunk_seconds=1e-06: from step 4 on, chunks "
            "run in calls of about that long" in out), out
    assert seen == [4, *range(5, 13)]  # the first chunk whole, then a call a step
    assert paced["params_sha256"] == whole["params_sha256"]


def dict_copy(config, **train):
    copy = config.copy_and_resolve_references()
    copy.train.update(train)
    return copy


def test_history_reads_the_rows_back_as_python_objects(tmp_path):
    rows = [{"step": 5, "train_loss": 2.0, "train_accuracy": 0.1, "replica": 0, "seed": 0},
            {"step": 5, "train_loss": 1.8, "train_accuracy": 0.2, "replica": 1, "seed": 1},
            {"step": 10, "train_loss": 1.5, "train_accuracy": 0.3, "replica": 0, "seed": 0,
             "test_loss": 1.6, "test_accuracy": 0.4},
            {"step": 10, "train_loss": 1.4, "train_accuracy": 0.35, "replica": 1, "seed": 1,
             "test_loss": 1.5, "test_accuracy": 0.45},
            {"step": 12, "epoch": 1.0, "test_loss": 1.3, "test_accuracy": 0.5, "replica": 0}]
    (tmp_path / report.METRICS_FILE).write_text(
        "".join(json.dumps(row) + "\n" for row in rows) + '{"step": 13, "trai')  # killed
    history = jaxtrain.history(str(tmp_path))
    assert history.train == rows[:4] and history.evaluations == rows[2:]
    assert history.series("train_loss", replica=1) == ([5, 10], [1.8, 1.4])
    assert history.series("test_accuracy", replica=0) == ([10, 12], [0.4, 0.5])
    assert history.series("test_accuracy") == ([], [])  # a replicated run: name the replica
    with pytest.raises(FileNotFoundError, match="not the workdir of a run"):
        jaxtrain.history(str(tmp_path / "elsewhere"))


def test_a_resumed_run_that_dies_while_keeping_its_rows_leaves_them_as_they_were(
        tmp_path, monkeypatch):
    """A resumed run writes the rows it keeps anew; one killed while doing so (here: a
    failure at the third row) leaves metrics.jsonl as it was, every row there."""
    rows = [{"step": step, "train_loss": 1.0 / step, "train_accuracy": 0.5}
            for step in (10, 20, 30, 40)]
    text = "".join(json.dumps(row) + "\n" for row in rows)
    (tmp_path / report.METRICS_FILE).write_text(text)
    written = []

    def dies_at_the_third(obj, **kwargs):
        if len(written) == 2:
            raise KeyboardInterrupt
        written.append(obj)
        return json.dumps(obj, **kwargs)
    monkeypatch.setattr(report, "json", types.SimpleNamespace(
        dumps=dies_at_the_third, loads=json.loads, JSONDecodeError=json.JSONDecodeError))
    with pytest.raises(KeyboardInterrupt):
        report.Reporter(str(tmp_path), total_steps=100, start_step=40)
    assert (tmp_path / report.METRICS_FILE).read_text() == text
