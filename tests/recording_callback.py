"""Callbacks the tests name in config files (`recording_callback:Recorder`): they write
what they are told to a JSON-lines file, stop at a step, stall, or fail."""
import json
import os
import time

import jax

import jaxtrain


def append(path, record):
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


class Recorder(jaxtrain.Callback):
    """Every call, one line each, tagged with this process's pid."""

    def __init__(self, path):
        self.path = path

    def on_run_start(self, run):
        append(self.path, {"event": "start", "pid": os.getpid(), "start_step": run.start_step,
                           "total_steps": run.total_steps, "history": len(run.history)})

    def on_rows(self, rows):
        for row in rows:
            append(self.path, {"event": "row", "pid": os.getpid(), **row})

    def on_evaluation(self, step, metrics):
        append(self.path, {"event": "evaluation", "pid": os.getpid(), "step": step, **metrics})

    def on_checkpoint(self, step, path):
        append(self.path, {"event": "checkpoint", "step": step, "on_disk": os.path.isdir(path)})

    def on_run_end(self, summary):
        append(self.path, {"event": "end", "test_accuracy": summary["test_accuracy"]})


class StopAt(jaxtrain.Callback):
    """StopTraining once a row reaches `step`, on process `process` only (None: every one)."""

    def __init__(self, step, process=None):
        self.step, self.process = step, process

    def on_rows(self, rows):
        if rows[-1]["step"] >= self.step and self.process in (None, jax.process_index()):
            raise jaxtrain.StopTraining(f"step {self.step} reached")


class FailsAtEvaluation(jaxtrain.Callback):
    def on_evaluation(self, step, metrics):
        raise ValueError(f"no per-class accuracy at step {step}")


class StallAt(jaxtrain.Callback):
    """Once the evaluation of `step` is delivered (to the callbacks named before this one
    too), creates the file `marker` and hangs until the process is killed: a run held at
    a known point for a test's SIGKILL. A rerun, which finds the marker, goes on."""

    def __init__(self, step, marker):
        self.step, self.marker = step, marker

    def on_evaluation(self, step, metrics):
        if step >= self.step and not os.path.exists(self.marker):
            with open(self.marker, "w"):
                pass
            while True:
                time.sleep(1)
