"""What a run's start (start.py) made for its loop (loop.py), fixed from the first chunk to
the summary, and the config's values the loop needs, read once there. What changes as the
run goes (the state, the row window, the last evaluation, the times) the loop holds itself
and hands to each function that needs it."""
import dataclasses
from typing import Any, Callable

import jax

from jaxtrain.run import plan
from jaxtrain.runtime import phases, report
from jaxtrain.training import chunks, prepare


@dataclasses.dataclass(frozen=True)
class Run:
    config: Any  # the checked config (absolute paths): for summary.json and RunInfo only
    workdir: str
    setup: prepare.Setup  # the data, model and initial state the config gave
    manager: Any  # the run's Orbax CheckpointManager
    data_key: Any  # the data order's and augmentation's PRNG key (resume needs it)
    start_step: int  # the step this process started at (0, or the checkpoint's)
    resumed: bool  # started from a checkpoint
    plan: list  # the chunks to run: (epoch, first step in the epoch, steps); plan.plan_chunks
    traced: tuple | None  # --profile: the (first, end) steps traced; plan.profile_window
    stream: Any  # data.placement='stream': the open batches.Stream; else None
    run_chunk: Callable | None  # the compiled chunks (chunks.compile_chunks); None: none left
    pace: chunks.Pace | None  # train.chunk_seconds: how long one compiled call may run
    eval_fn: Callable  # the compiled test-set evaluation
    eval_arrays: tuple  # the test split on the devices, batched for eval_fn
    clock: phases.Clock  # where the process's time goes
    reporter: report.Reporter  # console, metrics.jsonl, TensorBoard, summary.json
    cache_dir: str | None  # the persistent compilation cache; None: off
    schedules: list  # each replica's learning-rate schedule (one for a single run)
    on_grid: Callable[[int], bool]  # whether a step ends a training row; rows.row_grid
    # The config's values, read once:
    save_every: int  # steps between checkpoints (0: at the end only); plan.save_interval
    eval_every: tuple  # (eval.every_epochs, eval.every_steps)
    best: tuple | None  # checkpoint.best_metric's (metric, mode); checkpoint.best_policy
    stop_at_nonfinite: bool  # train.nonfinite='stop'
    seed: int
    batch_size: int
    precision: str  # train.precision resolved: float32 or bfloat16
    model_name: str

    @property
    def single_process(self) -> bool:
        """One process alone may stop mid-chunk (others would wait for it forever)."""
        return jax.process_count() == 1

    def evaluates(self, step: int) -> bool:
        return plan.evaluates_after(step, self.setup.steps_per_epoch, self.setup.total_steps,
                                    *self.eval_every)

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()
        self.reporter.close()
        self.manager.close()


@dataclasses.dataclass
class Times:
    """Where the run's seconds went: `train` (training and evaluation) and `eval` over every
    resume (a checkpoint carries them), the others this process's."""
    train: float = 0.0
    eval: float = 0.0
    compile: float = 0.0
    chunks: float = 0.0  # in compiled chunks
    wait: float = 0.0  # of `chunks`, waiting for a stream's batches


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """The test split's metrics at `step` (Python floats; a list per metric for replicas)."""
    step: int
    metrics: dict
