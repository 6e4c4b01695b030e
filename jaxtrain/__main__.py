"""Command line: `python -m jaxtrain --config=configs/cifar.py [--workdir=DIR] [--config.KEY=VALUE ...]`.

Also `python main.py ...` in a checkout, or the `jaxtrain` command after `pip install .`.
"""
import time

START_TIME = time.time()  # before the heavy imports: summary.json's total_seconds counts them

import atexit
import os
import signal
import sys


def _stop_while_starting(signum, frame):
    """Ctrl-C or SIGTERM during the imports: one line, the shell's status, no traceback."""
    sys.stderr.write(f"stopped: interrupted by {signal.Signals(signum).name} while starting; "
                     "nothing written\n")
    os._exit(128 + signum)


for _sig in (signal.SIGINT, signal.SIGTERM):
    signal.signal(_sig, _stop_while_starting)

from absl import app, flags, logging
from ml_collections import config_flags

import jaxtrain
from jaxtrain import evaluate
from jaxtrain.cli import override_keys, parse_flags, usage_error
from jaxtrain.config import defaults
from jaxtrain.runtime import processes, signals

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file("config", None, "Path to a config file with get_config().",
                                lock_config=True)
flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics, plots and the summary; "
                    "training resumes from the checkpoints already there. Default: "
                    "runs/<config file name without .py>.")
flags.DEFINE_enum("mode", "train", ["train", "eval"],
                  "train (or resume), or eval: evaluate the newest checkpoint on the test split.")
flags.DEFINE_string("checkpoint", None, "With --mode=eval: a step number, a step directory "
                    "(WORKDIR/checkpoints/STEP), or 'best' (checkpoint.best_metric's), to "
                    "evaluate instead of the newest.")
flags.DEFINE_string("coordinator_address", None, "Multi-process runs: host:port of process 0 "
                    "(default $JAX_COORDINATOR_ADDRESS; auto-detected under SLURM/Open MPI).")
flags.DEFINE_integer("num_processes", None, "Multi-process runs: how many processes "
                     "(default $JAX_NUM_PROCESSES; auto-detected under SLURM/Open MPI).")
flags.DEFINE_integer("process_id", None, "Multi-process runs: this process's index, 0 first "
                     "(default $JAX_PROCESS_ID; auto-detected under SLURM/Open MPI).")
flags.DEFINE_float("peer_timeout", 30.0, "Multi-process runs: seconds without a heartbeat after "
                   "which another process counts as lost; the others then stop with a message "
                   "and exit status 75; 0 turns the watch off.", lower_bound=0.0)
flags.DEFINE_integer("profile", 0, "Trace this many training steps (after one warm-up step) "
                     "with jax.profiler into WORKDIR/profile (TensorBoard's profile plugin, "
                     "Perfetto) and print the ten XLA ops that took the most time; 0 = off.",
                     lower_bound=0)


def default_workdir() -> str:
    """runs/<config file stem>: --workdir left out."""
    name = config_flags.get_config_filename(FLAGS["config"])
    return os.path.join("runs", os.path.splitext(os.path.basename(name))[0])


def eval_config(workdir: str):
    """--mode=eval: the run's own config (WORKDIR/config.json), with this command's
    --config.KEY=VALUE overrides on top; --config's file alone if the workdir has none
    (then --config is needed)."""
    keys = override_keys(sys.argv)
    overrides = {key: defaults.value_at(FLAGS.config, key) for key in keys}
    config = evaluate.run_config(workdir, overrides)
    if config is None:
        if FLAGS.config is None:
            usage_error(f"--mode=eval: {workdir} holds no config.json (no run trained there); "
                        "give --workdir the run's folder, or --config=FILE")
        return FLAGS.config
    print(f"evaluating with the run's config ({os.path.join(workdir, 'config.json')})"
          + (f" and {', '.join('--config.' + k for k in keys)}" if keys else ""), flush=True)
    return config


def main(argv):
    logging.set_verbosity(logging.WARNING)  # keep the console to the training table
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    signals.raise_on_signals()
    workdir = FLAGS.workdir
    if FLAGS.config is None and (FLAGS.mode == "train" or workdir is None):
        usage_error("--config=FILE names the recipe to train (e.g. --config=configs/cifar.py)"
                    if FLAGS.mode == "train" else "--mode=eval without --config evaluates the "
                    "run in --workdir=DIR with the config it recorded: give --workdir")
    if workdir is None:
        workdir = default_workdir()
        print(f"workdir: {workdir} (--workdir not given: runs/<config file name>)", flush=True)
    try:
        peers = processes.initialize(FLAGS.coordinator_address, FLAGS.num_processes,
                                     FLAGS.process_id, peer_timeout=FLAGS.peer_timeout)
        if FLAGS.mode == "eval":
            evaluate.evaluate_checkpoint(eval_config(workdir), workdir,
                                                    FLAGS.checkpoint)
        else:
            jaxtrain.train_and_evaluate(FLAGS.config, workdir, start_time=START_TIME,
                                        profile_steps=FLAGS.profile, peers=peers)
    except jaxtrain.Interrupted as error:
        print(f"stopped: {error}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        processes.release_service()  # every process stops at this step together
        # the shell's convention for "killed by signal N"; os._exit: no interpreter teardown
        # racing XLA's threads (a compile cut short left some running)
        os._exit(128 + error.signum)
    except jaxtrain.ConfigError as error:
        usage_error(str(error))  # exit status 2: the command cannot work as typed
    except (jaxtrain.DataError, jaxtrain.TrainingError, jaxtrain.CheckpointError,
            jaxtrain.DistributedError) as error:
        sys.exit(f"error: {error}")  # exit status 1: the run failed


def run():
    """The `jaxtrain` command: absl parses the flags (one-line errors), then main.

    A process of a multi-process run runs as the child of a small parent
    (jaxtrain/runtime/supervise.py) that outlives a native end in a collective. The process
    then ends without Python's interpreter teardown: everything is written and closed
    by now (and atexit's handlers, such as jax.distributed's shutdown, still run),
    while tearing down XLA's and TensorStore's objects takes a noticeable time that
    summary.json could not account for."""
    from jaxtrain.runtime import supervise
    if supervise.wanted(sys.argv[1:]):
        status = supervise.run()  # None: this is the trainer it forked
        if status is not None:
            os._exit(status)
    try:
        app.run(main, flags_parser=parse_flags)
    except SystemExit as done:
        status = done.code
    else:
        status = 0
    if isinstance(status, str):  # sys.exit("error: ...")
        print(status, file=sys.stderr)
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    atexit._run_exitfuncs()
    os._exit(status or 0)


if __name__ == "__main__":
    run()
