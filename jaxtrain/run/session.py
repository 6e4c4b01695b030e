"""What the actions of one run share: a typed Session, made once by start.start."""
import dataclasses
from typing import Any, Callable

import jax
import ml_collections

from jaxtrain.run import plan, resume
from jaxtrain.runtime import phases, processes, report
from jaxtrain.training import chunks, prepare, train_state


@dataclasses.dataclass
class Session:
    """One run between its start and its summary (see actions.py: each action reads it, and
    the few it changes are named in their docstrings)."""
    config: ml_collections.ConfigDict  # the checked config, with absolute paths
    workdir: str
    setup: prepare.Setup  # the data, model and initial state the config gave
    manager: Any  # the run's orbax CheckpointManager
    state: train_state.TrainState  # the newest state: after the last chunk run
    data_key: Any  # the data order's and augmentation's PRNG key (resume needs it)
    start_step: int  # the step this process started at (0, or the checkpoint's)
    resumed: bool  # started from a checkpoint
    plan: list  # the chunks to run: (epoch, first step in the epoch, steps); plan.plan_chunks
    traced: tuple | None  # --profile: the (first, end) steps traced; plan.profile_window
    stream: Any  # data.placement='stream': the open batches.Stream; else None
    run_chunk: Callable | None  # the compiled chunks (chunks.compile_chunks); None: none left
    eval_fn: Callable  # the compiled test-set evaluation
    eval_arrays: tuple  # the test split on the devices, batched for eval_fn
    clock: phases.Clock  # where the process's time goes
    reporter: report.Reporter  # console, metrics.jsonl, TensorBoard, summary.json
    cache_dir: str | None  # the persistent compilation cache; None: off
    compile_seconds: float
    save_every: int  # steps between checkpoints (0: at the end only); plan.save_interval
    on_grid: Callable[[int], bool]  # whether a step gets a metrics row; plan.row_grid
    schedules: list  # each replica's learning-rate schedule (one for a single run)
    train_seconds: float = 0.0  # training and evaluation, over every resume
    eval_seconds: float = 0.0
    signal: Any = None  # the signals.StopRequest the loop opened: a signal seen, or None
    # Set as the run goes:
    step: int = -1  # the state's step (start_step until a chunk has run)
    test_metrics: dict | None = None  # the last evaluation's
    test_step: int | None = None  # the step it evaluated
    stop_reason: str | None = None  # a callback's StopTraining, first reason kept
    stopped: bool = False  # the run stops at the end of this chunk (actions.Stops)
    wait_seconds: float = 0.0  # of chunk_seconds, waiting for a stream's batches
    chunk_seconds: float = 0.0  # in compiled chunks, this process
    latest: dict = dataclasses.field(default_factory=dict)  # replica -> its newest row
    single_process: bool = True  # one process alone may stop mid-chunk (else: at its end)

    def __post_init__(self):
        self.step = self.start_step
        self.latest = {row.get("replica"): row for row in self.reporter.records}
        # One process alone may not stop mid-chunk: the others would wait for it forever.
        self.single_process = jax.process_count() == 1

    def run(self, chunk, between_steps=None) -> None:
        """Runs `chunk`'s compiled program on the state; times it. A chunk run one call
        per step calls between_steps(steps done, the step's metrics) after each and can
        stop after any (a signal, in a single-process run)."""
        streaming = self.stream is not None
        waited = self.stream.wait_seconds if streaming else 0.0
        done = [0]

        def after_step(metrics) -> bool:
            done[0] += 1
            if between_steps is not None:
                between_steps(done[0], metrics)
            return self.single_process and bool(self.signal())
        (self.state, metrics), chunk.seconds = chunks.timed(
            self.run_chunk, self.state, self.data_key, chunk.epoch, chunk.first_step,
            chunk.length, after_step)
        chunk.metrics = jax.device_get(metrics)
        chunk.wait = self.stream.wait_seconds - waited if streaming else 0.0
        self.train_seconds += chunk.seconds
        self.wait_seconds += chunk.wait
        self.chunk_seconds += chunk.seconds
        self.step = chunk.step = train_state.current_step(self.state)
        chunk.last = chunk.step == self.setup.total_steps
        chunk.stopping = processes.any_process(self.signal())

    def evaluates(self, step: int) -> bool:
        return plan.evaluates_after(step, self.setup.steps_per_epoch, self.setup.total_steps,
                                    self.config.eval.every_epochs, self.config.eval.every_steps)

    def chunk_rows(self, chunk, ends: list) -> list:
        return plan.chunk_rows(chunk.metrics["per_step"], chunk.previous, ends, self.setup,
                               self.train_seconds, chunk.seconds, chunk.wait, self.schedules)

    def save(self, metrics: dict | None = None) -> None:
        """Starts saving a checkpoint of the state (resume.save says what it records)."""
        resume.save(self, metrics)

    def ask_to_stop(self, reason: str) -> None:
        """A callback's StopTraining: the first reason is kept (actions.Stops acts on it)."""
        if self.stop_reason is None:
            self.stop_reason = reason

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()
        self.reporter.close()
        self.manager.close()
