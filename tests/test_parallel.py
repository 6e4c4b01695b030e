"""Data parallelism on the CPU: 8 host devices stand in for 8 GPUs, and two local
processes with 4 devices each (gloo collectives) for two machines.

Each run is `python main.py` in a subprocess, because the device count is fixed
when JAX starts. The recipe has BatchNorm (so the batch statistics must be taken
over the global batch to match) and random flips and translations.

A run that several checks need is made in the one test that checks them all: pytest-xdist
would make a module fixture once per worker.
"""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import finish, free_port
from tolerances import NETWORK_PASS, TRAINING_STEPS
import quick_compile
import fork_server

import jaxtrain
from jaxtrain import ConfigError
from jaxtrain.runtime import mesh as mesh_lib
from jaxtrain.runtime import processes as processes_lib
from jaxtrain.runtime import report
from jaxtrain.training import inputs, placement

REPO = Path(__file__).resolve().parents[1]

# float32 throughout; runs differ only in the order of floating-point reductions.
# Such differences stay near 1e-7 unless a ReLU input lands within them of zero:
# then one example's gradient flips on or off and the runs part by ~1e-4 (seen
# with an MLP of widths (128, 64) at step 4). The recipes below are fixed and
# do not meet such a point in their 10 steps when compiled at LLVM -O1
# (COMPARED_LEVEL): at -O0 a Xeon with AVX-512 rounds the 1- and 8-device CNN
# apart by 6e-7 at step 5 and 4e-4 at step 10 (-O1: within 1.1e-7; the earlier
# machines held at -O0 too). The losses are held to NETWORK_PASS of each other; the
# parameters, whose differences add up over the steps, to TRAINING_STEPS (and to that of
# a weight 0.1 in size, for the smaller ones).
COMPARED_LEVEL = 1

RECIPE = ("--config=configs/cifar_seed_cnn.py", "--config.model.batch_norm=True",
          "--config.train.batch_size=64", "--config.optimizer.learning_rate=0.05",
          "--config.augment.flip=True", "--config.augment.translate=2",
          "--config.train.num_steps=10", "--config.train.log_every_steps=5")
MLP = ("--config.model.name=mlp", "--config.model.batch_norm=True",
       "--config.model.hidden_sizes=(64,32)")


def devices_env(count: int, backend_level: int | None = None) -> dict:
    """The environment of a subprocess with `count` CPU devices; backend_level: XLA's
    LLVM optimisation level there (None: XLA's default; quick_compile.py)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "SLURM_", "OMPI_"))}
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={count}" + (
        "" if backend_level is None else f" {quick_compile.xla_flags(backend_level)}")
    return env


def start_main(args, env):
    return fork_server.Popen([sys.executable, "main.py", *args], cwd=REPO, env=env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def run_main(args, devices: int, level: int = quick_compile.LEVEL):
    return finish(start_main(args, devices_env(devices, level)))


# The SIGTERM test gives each of its two processes one device: a step, a collective over
# both, then costs about half the CPU time it does with 4, and a stop at the end of a chunk
# is the same. Not so the tests of a lost process: with one device each, killing process 0
# makes the survivor's gloo all-reduce raise JaxRuntimeError ("Connection reset by peer"),
# printed with its traceback before the one-line message; with 4 it is not (seen 3 of 3).
SIGNAL_TEST_DEVICES = 1


def start_processes(args, count: int = 2, devices: int = 4, address: str | None = None,
                    level: int = quick_compile.LEVEL) -> list:
    """The `count` processes of one run, `devices` CPU devices each (gloo collectives), its
    coordination service at `address` (default: a free port), XLA's LLVM at -O`level`."""
    address = address or f"localhost:{free_port()}"
    args = [*args, f"--coordinator_address={address}", f"--num_processes={count}"]
    return [start_main([*args, f"--process_id={i}"], devices_env(devices, level))
            for i in range(count)]


def train_run(workdir, devices, *extra, data_dir):
    """A run of RECIPE (+ `extra`) that a test compares with another: at COMPARED_LEVEL."""
    result = run_main([*RECIPE, *extra, f"--workdir={workdir}", f"--config.data.dir={data_dir}"],
                      devices, COMPARED_LEVEL)
    assert result.returncode == 0, result.stderr[-3000:]
    return workdir


@pytest.mark.slow
def test_a_signal_to_one_process_stops_all_at_the_same_step(tmp_path, cifar_batches_dir):
    """SIGTERM to process 1 only: both save one checkpoint together and exit; a rerun resumes.
    The signal comes after step 5's row and the run stops where a chunk of 5 steps ends,
    at step 10 or 15 (30 steps, not more: each is a collective of both processes)."""
    args = [*RECIPE, "--config.train.num_steps=30", "--config.checkpoint.every_epochs=0",
            "--config.train.chunk_steps=5",
            f"--workdir={tmp_path}", f"--config.data.dir={cifar_batches_dir}"]
    address = f"localhost:{free_port()}"  # the rerun's too: the same command run again
    processes = start_processes(args, devices=SIGNAL_TEST_DEVICES, address=address)
    metrics = tmp_path / report.METRICS_FILE
    deadline = time.monotonic() + 240
    while not (metrics.exists() and metrics.read_text().count("\n") >= 1):
        assert time.monotonic() < deadline and all(p.poll() is None for p in processes)
        time.sleep(0.2)
    processes[1].send_signal(signal.SIGTERM)
    results = [finish(p) for p in processes]
    assert [r.returncode for r in results] == [128 + signal.SIGTERM] * 2, results[0].stderr[-2000:]
    assert "interrupted by SIGTERM" in results[0].stderr
    steps = os.listdir(tmp_path / "checkpoints")
    assert len(steps) == 1 and 5 <= int(steps[0]) < 30
    assert not (tmp_path / report.SUMMARY_FILE).exists()

    processes = start_processes(args, devices=SIGNAL_TEST_DEVICES, address=address)
    results = [finish(p) for p in processes]
    assert [r.returncode for r in results] == [0, 0], results[0].stderr[-2000:]
    summary = json.loads((tmp_path / report.SUMMARY_FILE).read_text())
    assert summary["resumed_from_step"] == int(steps[0]) and summary["steps"] == 30
    # the stopped run's coordination service was released with it: the rerun did not wait
    # out the 70 s (2 x --peer_timeout + 10) it is kept for a lost process 0
    assert summary["phase_seconds"]["imports"] < 40, summary["phase_seconds"]


def test_a_coordinator_port_is_waited_for_while_a_service_holds_it():
    """A rerun's process 0 waits for the port the run before's coordination service still
    holds, rather than starting a second service that would share its connections."""
    with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as server:
        server.bind(("::", 0))
        server.listen()
        port = server.getsockname()[1]
        assert not processes_lib.wait_until_free(port, 0.3)
    assert processes_lib.wait_until_free(port, 5.0)


def test_a_stopped_run_releases_its_coordination_service():
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    processes_lib.SERVICE["helper"] = helper
    processes_lib.release_service()
    assert helper.wait(timeout=10) == -signal.SIGTERM and "helper" not in processes_lib.SERVICE
    processes_lib.release_service()  # nothing left: nothing to do


def start_two_and_wait_for_a_checkpoint(workdir, data_dir):
    """Two processes of a long run (a checkpoint every 5 steps, --peer_timeout=4), once
    the first checkpoint is on disk."""
    processes = start_processes([*RECIPE, "--config.train.num_steps=2000",
                                 "--config.checkpoint.every_steps=5", f"--workdir={workdir}",
                                 f"--config.data.dir={data_dir}", "--peer_timeout=4"])
    deadline = time.monotonic() + 240
    while not [n for n in os.listdir(workdir / "checkpoints") if n.isdigit()] if (
            workdir / "checkpoints").is_dir() else True:
        assert time.monotonic() < deadline and all(p.poll() is None for p in processes)
        time.sleep(0.1)
    return processes


def trainer_of(process) -> int:
    """The pid of the child that trains for a process of a multi-process run (the
    process itself is jaxtrain/runtime/supervise.py's parent)."""
    children = Path(f"/proc/{process.pid}/task/{process.pid}/children").read_text().split()
    assert len(children) == 1, children
    return int(children[0])


@pytest.mark.slow
@pytest.mark.parametrize("lost, how", [(0, "kill"), (1, "freeze")])
def test_when_a_process_is_lost_the_other_stops_with_a_message(tmp_path, cifar_batches_dir,
                                                                lost, how):
    """Process 0 (the coordination service's host) killed, or process 1's trainer frozen
    (SIGSTOP, as a hung machine): the other used to abort natively (exit 134; about 80 s
    later, or at once when process 0 was lost); it now stops within --peer_timeout with
    exit status 75, in one line naming the newest checkpoint and the lost process, whose
    heartbeat went silent. A kill can also end the survivor inside a collective first
    (docs/parallel.md; CI saw it): then the line names the survivor and its native report.
    A frozen peer keeps its sockets open, so only its silence can be seen. The lost
    process's trainer goes with it."""
    processes = start_two_and_wait_for_a_checkpoint(tmp_path, cifar_batches_dir)
    survivor = 1 - lost
    trainer = trainer_of(processes[lost])
    if how == "kill":
        processes[lost].kill()
    else:
        os.kill(trainer, signal.SIGSTOP)
    lost_at = time.monotonic()
    result = finish(processes[survivor], timeout=120)
    processes[lost].kill()  # a frozen trainer goes with its parent
    finish(processes[lost])
    assert result.returncode == processes_lib.PEER_LOST, result.stderr[-3000:]
    assert time.monotonic() - lost_at < 4 + 10
    assert "Traceback" not in result.stderr and "Check failure" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, result.stderr[-3000:]
    newest = f"The newest checkpoint is {tmp_path / 'checkpoints'}/"
    inside = f"error: process {survivor} of 2 stopped inside JAX's runtime ("
    if how == "kill" and lines[0].startswith(inside):
        report = tmp_path / f"native-report-process{survivor}.txt"
        assert f"process {survivor} stops too. {newest}" in lines[0] and report.is_file()
        assert lines[0].endswith(f"Rerun every process to resume. (its native report: {report})")
    else:
        assert lines[0].startswith(f"error: process {lost} of 2 was lost (no heartbeat for 4 s); "
                                   f"process {survivor} stops too. {newest}"), lines[0]
        assert lines[0].endswith("Rerun every process to resume.")
    gone_by = time.monotonic() + 10  # no trainer left behind (a zombie is reaped at once)
    while Path(f"/proc/{trainer}").exists() and time.monotonic() < gone_by:
        time.sleep(0.1)
    assert not Path(f"/proc/{trainer}").exists(), Path(f"/proc/{trainer}/status").read_text()


@pytest.mark.slow
def test_a_survivor_that_ends_inside_the_runtime_still_says_one_line(tmp_path,
                                                                     cifar_batches_dir):
    """Process 1 killed while a collective is in flight can end process 0 inside the
    runtime (gloo's C++ exception: `terminate called ...`, `Fatal Python error: Aborted`,
    thread dumps, exit 134), before its heartbeat watch sees anything. Such an end, here
    a SIGABRT to process 0's trainer right after process 1 is killed, reaches the user
    as one line and exit 75 from the parent that watches it; the dump goes to a file."""
    processes = start_two_and_wait_for_a_checkpoint(tmp_path, cifar_batches_dir)
    trainer = trainer_of(processes[0])
    processes[1].kill()
    os.kill(trainer, signal.SIGABRT)
    result = finish(processes[0], timeout=120)
    finish(processes[1])
    assert result.returncode == processes_lib.PEER_LOST, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, result.stderr[-3000:]
    rest = result.stderr.replace(lines[0], "")
    assert "Thread 0x" not in rest and "Fatal Python error" not in rest, rest[-3000:]
    report = tmp_path / "native-report-process0.txt"
    assert lines[0].startswith(
        "error: process 0 of 2 stopped inside JAX's runtime (Fatal Python error: Aborted): in "
        "a multi-process run, another process lost in the middle of a collective; process 0 "
        f"stops too. The newest checkpoint is {tmp_path / 'checkpoints'}/"), lines[0]
    assert lines[0].endswith(f"Rerun every process to resume. (its native report: {report})")
    assert "Fatal Python error: Aborted" in report.read_text()


def restored_variables(workdir, replica=None):
    state = jaxtrain.restore(str(workdir), replica=replica).state
    return {"params": state.params, "batch_stats": state.batch_stats}


def assert_same_training(workdir, reference, replica=None):
    """The run in `workdir` trained as the one in `reference` (replica: as that replica of
    a replicated run there)."""
    records = report.read_metrics(workdir)
    expected = [r for r in report.read_metrics(reference) if r.get("replica") == replica]
    assert [r["step"] for r in records] == [r["step"] for r in expected] == [5, 10]
    np.testing.assert_allclose([r["train_loss"] for r in records],
                               [r["train_loss"] for r in expected], rtol=NETWORK_PASS)
    np.testing.assert_allclose(records[-1]["test_loss"], expected[-1]["test_loss"],
                               rtol=NETWORK_PASS)
    got, want = restored_variables(workdir), restored_variables(reference, replica)
    paths = jax.tree_util.tree_leaves_with_path(want)
    assert len(paths) > 10 and jax.tree.structure(got) == jax.tree.structure(want)
    for (path, expected_leaf), leaf in zip(paths, jax.tree.leaves(got)):
        np.testing.assert_allclose(np.asarray(leaf), np.asarray(expected_leaf),
                                   atol=TRAINING_STEPS * 0.1, rtol=TRAINING_STEPS,
                                   err_msg=jax.tree_util.keystr(path))


@pytest.mark.slow
def test_eight_devices_and_two_processes_match_one_device(tmp_path, cifar_batches_dir):
    """The recipe's 10 steps on 1 device, on 8, and as 2 processes x 4 devices: the same
    training, and only process 0 reports. The 8-device and the two-process checkpoints
    evaluate on one device; the 8-device run's checkpoint at step 5 resumes on 1 device
    to the same run; another seed is far outside the tolerance."""
    one_device = train_run(tmp_path / "one", 1, data_dir=cifar_batches_dir)
    eight_devices = train_run(tmp_path / "eight", 8, "--config.checkpoint.every_steps=5",
                              data_dir=cifar_batches_dir)
    summary = json.loads((eight_devices / report.SUMMARY_FILE).read_text())
    assert summary["device_count"] == 8 and summary["process_count"] == 1
    assert json.loads((one_device / report.SUMMARY_FILE).read_text())["device_count"] == 1
    assert_same_training(eight_devices, one_device)

    two_processes = tmp_path / "two"  # one workdir, as on a shared filesystem
    first, second = [finish(p) for p in start_processes(
        [*RECIPE, f"--workdir={two_processes}", f"--config.data.dir={cifar_batches_dir}"],
        level=COMPARED_LEVEL)]
    for i, result in enumerate((first, second)):
        assert result.returncode == 0, f"process {i}:\n{result.stderr[-3000:]}"
    summary = json.loads((two_processes / report.SUMMARY_FILE).read_text())
    assert (summary["device_count"], summary["process_count"]) == (8, 2)
    assert_same_training(two_processes, one_device)
    # only process 0 reports
    assert "test_accuracy=" in first.stdout and "train_loss" in first.stdout
    assert "processes=2" in first.stdout
    assert "test_accuracy=" not in second.stdout and "train_loss" not in second.stdout
    # gloo's connection lines go to a log file each, not into the console table
    for i, result in enumerate((first, second)):
        assert "[Gloo]" not in result.stdout + result.stderr
        assert "[Gloo] Rank" in (two_processes / f"gloo-process{i}.log").read_text()

    # a checkpoint from 8 devices (one process or two) evaluates on one
    for workdir in (eight_devices, two_processes):
        summary = json.loads((workdir / report.SUMMARY_FILE).read_text())
        result = run_main([*RECIPE, f"--workdir={workdir}",
                           f"--config.data.dir={cifar_batches_dir}", "--mode=eval"], devices=1,
                          level=COMPARED_LEVEL)  # the one-device run's evaluation, cached
        assert result.returncode == 0, result.stderr[-3000:]
        assert f"test_accuracy={summary['test_accuracy']:.2%}" in result.stdout
        assert "on 1 device)" in result.stdout

    # training resumes on another device count: five steps on 8 devices (the 8-device run
    # as its step-5 checkpoint left it), the other five on 1: the same run
    resumed = tmp_path / "resumed"
    shutil.copytree(eight_devices, resumed)
    shutil.rmtree(resumed / "checkpoints" / "10")
    (resumed / report.SUMMARY_FILE).unlink()
    train_run(resumed, 1, "--config.checkpoint.every_steps=5", data_dir=cifar_batches_dir)
    assert json.loads((resumed / report.SUMMARY_FILE).read_text())["resumed_from_step"] == 5
    assert_same_training(resumed, one_device)

    # another seed is far outside the tolerance: the matches above mean something (on one
    # device, whose programs the first run compiled: the seed is an input of them)
    other = train_run(tmp_path / "other", 1, "--config.seed=1", data_dir=cifar_batches_dir)
    with pytest.raises(AssertionError):
        assert_same_training(other, one_device)


@pytest.mark.slow
def test_a_scanned_mlp_and_its_replicas_on_eight_or_four_devices_match_one_device(
        tmp_path, cifar_batches_dir):
    """The MLP runs each chunk as one lax.scan (the GPU path), the CNN a step per call.
    Two seeds x two learning rates of it as replicas: on 4 devices each device trains one
    whole replica; on 8 (4 replicas do not split over 8) every replica's batch is split
    over the devices. Both are the one-device run, replica by replica. The single run on
    8 devices is that run's replica 0 (seed 0 and learning rate 0.05, the single run's;
    replica and single run round apart as one and eight devices do, tests/test_replicas.py)."""
    args = (*MLP, "--config.train.replicas=2", "--config.sweep.optimizer.learning_rate=(0.05,0.1)")
    runs = {n: train_run(tmp_path / str(n), n, *args, data_dir=cifar_batches_dir)
            for n in (1, 4, 8)}
    single = train_run(tmp_path / "single", 8, *MLP, data_dir=cifar_batches_dir)
    assert_same_training(single, runs[1], replica=0)
    reference = report.read_metrics(runs[1])
    assert [(r["step"], r["replica"]) for r in reference] == [
        (step, k) for step in (5, 10) for k in range(4)]
    assert len({r["train_loss"] for r in reference if r["step"] == 10}) == 4
    for devices in (4, 8):
        records = report.read_metrics(runs[devices])
        assert [(r["step"], r["replica"]) for r in records] == [
            (r["step"], r["replica"]) for r in reference]
        for key in ("train_loss", "test_loss"):
            np.testing.assert_allclose([r.get(key, 0.0) for r in records],
                                       [r.get(key, 0.0) for r in reference],
                                       rtol=NETWORK_PASS)
        for replica in (0, 3):
            got = jaxtrain.restore(str(runs[devices]), replica=replica).state.params
            want = jaxtrain.restore(str(runs[1]), replica=replica).state.params
            jax.tree.map(lambda a, b: np.testing.assert_allclose(
                np.asarray(a), np.asarray(b), atol=TRAINING_STEPS * 0.1, rtol=TRAINING_STEPS),
                got, want)
    summaries = [json.loads((runs[n] / report.SUMMARY_FILE).read_text()) for n in (1, 4, 8)]
    assert [s["device_count"] for s in summaries] == [1, 4, 8]
    assert [s["replica_layout"].split(":")[0] for s in summaries] == [
        "replicated", "split", "replicated"]


@pytest.mark.slow
def test_a_batch_that_does_not_split_over_the_devices_stops_with_a_message(
        tmp_path, cifar_batches_dir):
    result = run_main([*RECIPE, "--config.train.batch_size=100", f"--workdir={tmp_path}",
                       f"--config.data.dir={cifar_batches_dir}"], devices=8)
    assert result.returncode != 0
    assert ("config.train.batch_size=100 does not split evenly over 8 devices: use a multiple "
            "of 8 (e.g. 96 or 104)") in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / report.SUMMARY_FILE).exists()


def test_check_batch_split_names_the_nearest_sizes():
    mesh = mesh_lib.create_mesh()  # this process: one device
    placement.check_batch_split(7, mesh)

    class EightDevices:
        size = 8
    placement.check_batch_split(64, EightDevices)
    with pytest.raises(ConfigError, match=r"use a multiple of 8 \(e\.g\. 8\)"):
        placement.check_batch_split(3, EightDevices)


def test_eval_batches_round_up_to_the_device_count(cifar_subset):
    x, y = cifar_subset["x_test"], cifar_subset["y_test"]  # 500 images
    images, labels, valid = inputs.batch_for_eval(x, y, 1000, multiple_of=8)
    assert images.shape[:2] == labels.shape == valid.shape == (1, 504)
    assert valid.sum() == 500 and (images[0, :500] == x).all()
    images, _, valid = inputs.batch_for_eval(x, y, 100, multiple_of=8)
    assert images.shape[:2] == (5, 104) and valid.sum() == 500


# ---------------------------------------------------------------- launch settings

def test_a_single_process_run_does_not_initialize():
    assert processes_lib.distributed_settings(environ={}) is None
    assert processes_lib.distributed_settings(environ={"SLURM_NTASKS": "1"}) is None
    assert processes_lib.distributed_settings(num_processes=1, environ={}) is None


def test_flags_and_environment_configure_the_processes():
    assert processes_lib.distributed_settings("host:1234", 4, 2, environ={}) == {
        "coordinator_address": "host:1234", "num_processes": 4, "process_id": 2}
    environ = {"JAX_COORDINATOR_ADDRESS": "head:99", "JAX_NUM_PROCESSES": "2",
               "JAX_PROCESS_ID": "1"}
    assert processes_lib.distributed_settings(environ=environ) == {
        "coordinator_address": "head:99", "num_processes": 2, "process_id": 1}
    # a flag wins over the environment
    assert processes_lib.distributed_settings(process_id=0, environ=environ)["process_id"] == 0


def test_slurm_and_open_mpi_leave_the_rest_to_jax_auto_detection():
    assert processes_lib.distributed_settings(environ={"SLURM_NTASKS": "16"}) == {}
    assert processes_lib.distributed_settings(environ={"OMPI_COMM_WORLD_SIZE": "2"}) == {}
    settings = processes_lib.distributed_settings("head:99", environ={"SLURM_NTASKS": "16"})
    assert settings == {"coordinator_address": "head:99", "num_processes": None,
                        "process_id": None}


@pytest.mark.parametrize("kwargs,environ,message", [
    ({"coordinator_address": "h:1"}, {}, "missing: --num_processes, --process_id"),
    ({"num_processes": 2, "process_id": 0}, {}, "missing: --coordinator_address"),
    ({"coordinator_address": "h:1", "num_processes": 2, "process_id": 2}, {},
     r"--process_id=2: must be in \[0, 2\)"),
    ({"coordinator_address": "h:1", "num_processes": 0, "process_id": 0}, {},
     "--num_processes=0: must be >= 1"),
    ({}, {"JAX_NUM_PROCESSES": "two"}, r"\$JAX_NUM_PROCESSES='two' is not a valid int"),
])
def test_incomplete_or_wrong_settings_are_named(kwargs, environ, message):
    with pytest.raises(processes_lib.DistributedError, match=message):
        processes_lib.distributed_settings(**kwargs, environ=environ)


@pytest.mark.slow
def test_main_reports_incomplete_settings_without_a_traceback(tmp_path):
    result = run_main([*RECIPE, f"--workdir={tmp_path}", "--num_processes=2"], devices=1)
    assert result.returncode != 0
    assert "missing: --coordinator_address, --process_id" in result.stderr
    assert "Traceback" not in result.stderr


def test_only_processes_of_a_multi_process_run_with_the_peer_watch_are_supervised():
    from jaxtrain.runtime import supervise
    two = ["--config=c.py", "--num_processes=2", "--process_id=0"]
    assert supervise.wanted(two, {})
    assert not supervise.wanted(two + ["--peer_timeout=0"], {})  # the watch is off
    assert not supervise.wanted(two, {supervise.ENV: "/tmp/x.json"})  # the child itself
    assert not supervise.wanted(["--config=c.py"], {})  # one process
    assert not supervise.wanted(["--config=c.py", "--num_processes", "1"], {})
    assert supervise.wanted(["--config=c.py"], {"SLURM_NTASKS": "8"})
    assert supervise.wanted(["--config=c.py"], {"JAX_NUM_PROCESSES": "2"})
    assert not supervise.wanted(["--num_processes=two"], {})  # absl says what is wrong


@pytest.mark.parametrize("said", [True, False])
def test_gloos_lines_go_to_the_workdirs_log_or_at_the_end_to_the_console(
        tmp_path, monkeypatch, said):
    """supervise's stdout relay: gloo's connection lines into WORKDIR/gloo-process1.log once
    the child has named its workdir; a child that ended without naming it leaves them on
    the console after its other lines, not lost."""
    import io
    import types
    from jaxtrain.runtime import supervise
    info = tmp_path / "info.json"
    if said:
        info.write_text(json.dumps({"workdir": str(tmp_path), "process": 1}))
    console = io.BytesIO()
    monkeypatch.setattr(sys, "stdout", types.SimpleNamespace(buffer=console))
    read, write = os.pipe()
    os.write(write, b"epoch 1\n[Gloo] Rank 1 is connected to 1 peer ranks.\nstep 5")
    os.close(write)
    supervise.relay_stdout(read, str(info))
    os.close(read)
    gloo = b"[Gloo] Rank 1 is connected to 1 peer ranks.\n"
    if said:
        assert console.getvalue() == b"epoch 1\nstep 5\n"
        assert (tmp_path / "gloo-process1.log").read_bytes() == gloo
    else:
        assert console.getvalue() == b"epoch 1\nstep 5\n" + gloo
