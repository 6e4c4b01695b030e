"""EarlyStopping: stop when a monitored metric has stopped improving."""
import math

import numpy as np

from jaxtrain.callbacks import base


class EarlyStopping(base.Callback):
    """Stops when `monitor` has not improved by more than `min_delta` for `patience`
    evaluations in a row (eval.every_epochs / eval.every_steps give the points).

    monitor: 'test_loss', 'test_accuracy' or a train metric of the evaluated row
    ('train_loss', 'train_accuracy'); mode 'min', 'max' or 'auto' (max for accuracy).
    A replicated run watches the mean over its replicas. A resumed run rebuilds its
    state from the evaluations in its history, so it stops where an uninterrupted
    run would. restore_best_weights (as Keras's): the run ends with the weights of its
    best checkpoint by `monitor` (checkpoint.best_metric must name it), and its summary
    with that evaluation's figures.
    """

    def __init__(self, monitor: str = "test_loss", patience: int = 3, min_delta: float = 0.0,
                 mode: str = "auto", restore_best_weights: bool = False):
        if mode == "auto":
            mode = "max" if "accuracy" in monitor else "min"
        if mode not in ("min", "max"):
            raise ValueError(f"mode={mode!r}: must be 'min', 'max' or 'auto'")
        if not (isinstance(patience, int) and patience >= 1):
            raise ValueError(f"patience={patience!r}: must be an int >= 1")
        if not min_delta >= 0:
            raise ValueError(f"min_delta={min_delta!r}: must be >= 0")
        self.monitor, self.patience, self.min_delta, self.mode = monitor, patience, min_delta, mode
        self.restore_best_weights = bool(restore_best_weights)
        self.best = self.best_step = None
        self.waited = 0

    def on_run_start(self, run: base.RunInfo) -> None:
        kept = run.config.checkpoint.best_metric
        if self.restore_best_weights and kept != self.monitor:
            raise ValueError(f"restore_best_weights=True restores the best checkpoint by "
                             f"{self.monitor}: set --config.checkpoint.best_metric="
                             f"{self.monitor} (it is {kept!r})")
        for step, metrics in base.evaluation_points(run.history):
            self.on_evaluation(step, metrics)

    def on_evaluation(self, step: int, metrics: dict) -> None:
        if self.monitor not in metrics:
            raise ValueError(f"EarlyStopping: no metric {self.monitor!r} at evaluations "
                             f"(there are {', '.join(sorted(metrics))})")
        value = float(np.mean(metrics[self.monitor]))
        if not math.isfinite(value):
            return
        better = (self.best is None
                  or (value < self.best - self.min_delta if self.mode == "min"
                      else value > self.best + self.min_delta))
        if better:
            self.best, self.best_step, self.waited = value, step, 0
            return
        self.waited += 1
        if self.waited >= self.patience:
            raise base.StopTraining(
                f"{self.monitor} has not improved by more than {self.min_delta:g}"
                f" for {self.patience} evaluation{'s' if self.patience > 1 else ''}"
                f" (best {self.best:.6g} at step {self.best_step})")
