"""What one run holds between its start (start.py) and its summary (summary.py)."""
import dataclasses
from typing import Any, Callable

import jax
import ml_collections

from jaxtrain.run import plan, rows
from jaxtrain.runtime import phases, report
from jaxtrain.training import chunks, prepare, train_state


@dataclasses.dataclass
class Session:
    """One run between its start and its summary: what start.start made, and what the
    loop (loop.py) changes as it goes, each field named below."""
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
    pace: chunks.Pace | None  # train.chunk_seconds: how long one compiled call may run
    paced: bool  # the chunks run in calls of the pace's length (else whole; see chunks.py)
    eval_fn: Callable  # the compiled test-set evaluation
    eval_arrays: tuple  # the test split on the devices, batched for eval_fn
    clock: phases.Clock  # where the process's time goes
    reporter: report.Reporter  # console, metrics.jsonl, TensorBoard, summary.json
    window: rows.RowWindow  # the steps since the last training row
    cache_dir: str | None  # the persistent compilation cache; None: off
    compile_seconds: float
    save_every: int  # steps between checkpoints (0: at the end only); plan.save_interval
    on_grid: Callable[[int], bool]  # whether a step ends a training row; rows.row_grid
    schedules: list  # each replica's learning-rate schedule (one for a single run)
    train_seconds: float = 0.0  # training and evaluation, over every resume
    eval_seconds: float = 0.0
    # Changed by the loop as it goes:
    step: int = -1  # the state's step (start_step until a chunk has run)
    test_metrics: dict | None = None  # the last evaluation's
    test_step: int | None = None  # the step it evaluated
    saved_step: int | None = None  # the step of the newest checkpoint this process saved
    wait_seconds: float = 0.0  # of chunk_seconds, waiting for a stream's batches
    chunk_seconds: float = 0.0  # in compiled chunks, this process

    def __post_init__(self):
        self.step = self.start_step

    @property
    def single_process(self) -> bool:
        """One process alone may stop mid-chunk (others would wait for it forever)."""
        return jax.process_count() == 1

    def evaluates(self, step: int) -> bool:
        return plan.evaluates_after(step, self.setup.steps_per_epoch, self.setup.total_steps,
                                    self.config.eval.every_epochs, self.config.eval.every_steps)

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()
        self.reporter.close()
        self.manager.close()
