"""What a run does between its compiled chunks, one action a job: the profiler window,
the metrics rows, the evaluation, the reports, the checkpoint policy, the user's
callbacks and the stops. loop.py runs them in that fixed order after every chunk, so
a callback sees rows already logged and the checkpoint that holds its step.

Each action keeps its own state and may implement any of: start() once before the
first chunk, before_chunk(chunk), between_steps(chunk, done, metrics) after each step
of a chunk run one call per step (done: its steps so far; metrics: the step's, maybe
still computing), after_chunk(chunk), finish() after the last one,
close() on the way out (also after an error), summarize(summary) to add to
summary.json, and run_end(summary) once summary.json is written. `session` (loop.py)
holds what the run shares: the state, the step, the reporter, the clock, the
checkpoint manager.
"""
import dataclasses
import os
import signal
import time

import jax
import numpy as np

from jaxtrain.callbacks import base
from jaxtrain.errors import TrainingError
from jaxtrain.perf import profile
from jaxtrain.run import callbacks as callbacks_lib
from jaxtrain.runtime import processes, report, signals
from jaxtrain.training import checkpoint, chunks, evaluation, replicas, train_state

PROFILE_DIR = "profile"


@dataclasses.dataclass
class Chunk:
    """One planned chunk, and what running it produced."""
    epoch: int
    first_step: int            # in the epoch
    length: int
    previous: int = 0          # the global step before it ran
    step: int = 0              # after it (less than planned if a signal cut it short)
    seconds: float = 0.0
    wait: float = 0.0          # of the seconds, waiting for streamed input
    metrics: dict = None       # its per-step metrics, on the host
    stopping: bool = False     # a signal asked every process to stop here
    rows: list = dataclasses.field(default_factory=list)
    last: bool = False         # it ended the run
    evaluated: bool = False
    saved: bool = False


class Action:
    def __init__(self, session):
        self.session = session

    def start(self):
        pass

    def before_chunk(self, chunk: Chunk):
        pass

    def between_steps(self, chunk: Chunk, done: int, metrics):
        pass

    def after_chunk(self, chunk: Chunk):
        pass

    def finish(self):
        pass

    def close(self):
        pass

    def summarize(self, summary: dict):
        pass

    def run_end(self, summary: dict):
        pass


class Profile(Action):
    """--profile=N: a jax.profiler trace of the session's traced window of steps, and
    the ten XLA ops that took the most time."""

    def __init__(self, session):
        super().__init__(session)
        self.tracing, self.seconds, self.table = False, 0.0, None

    def before_chunk(self, chunk):
        window = self.session.traced
        if window and chunk.previous == window[0]:
            jax.profiler.start_trace(os.path.join(self.session.workdir, PROFILE_DIR),
                                     create_perfetto_trace=True)
            self.tracing = True

    def after_chunk(self, chunk):
        if not self.tracing:
            return
        self.seconds += chunk.seconds
        window = self.session.traced
        if chunk.previous + chunk.length == window[1]:
            self.tracing = False
            self.table = finish_profile(self.session.workdir, window, self.seconds,
                                        self.session.reporter)

    def close(self):
        if self.tracing:
            jax.profiler.stop_trace()  # stopped or failed inside the traced steps

    def summarize(self, summary):
        if self.table is not None:
            summary["profile"] = self.table


def finish_profile(workdir: str, traced, seconds: float, reporter) -> dict:
    """Stops the trace; prints where it is and the ten XLA ops that took the most time."""
    jax.profiler.stop_trace()
    steps, directory = traced[1] - traced[0], os.path.join(workdir, PROFILE_DIR)
    # Shares are of the summed op time: the traced steps' wall time includes the
    # profiler's own overhead, so it is reported beside them, not divided by.
    trace = profile.newest_trace(directory)
    table = profile.op_table(trace, steps)
    table["traced_wall_seconds_per_step"] = seconds / steps
    perfetto = os.path.join(os.path.dirname(trace), "perfetto_trace.json.gz")
    reporter.print_line(f"profile of steps {traced[0] + 1}-{traced[1]} ({seconds / steps * 1e3:.2f}"
                        f" ms a step under the profiler): `tensorboard --logdir {directory}` "
                        f"(profile plugin), or open {perfetto} at ui.perfetto.dev\n"
                        + profile.format_op_table(table))
    return table


LONG_RUN_SECONDS = 600  # training projected past this: say so, once


class Projection(Action):
    """One line, once, when the training left is projected past LONG_RUN_SECONDS: after
    the first chunk, or inside it after a few steps when it runs one call per step (a
    CPU's convolutional chunk can take an hour); on a CPU it names the recipes sized
    for one. The first step of a chunk is not timed (it may carry first-run costs)."""

    def __init__(self, session):
        super().__init__(session)
        self.said = not processes.is_main_process()
        self.mark = None  # (time, steps done) where the timing starts

    def before_chunk(self, chunk):
        self.mark = None

    def between_steps(self, chunk, done, metrics):
        if self.said:
            return
        if done == 1 or self.mark is None:
            jax.block_until_ready(metrics)  # dispatch runs ahead: time finished steps
            self.mark = (time.perf_counter(), done)
            return
        began, at = self.mark
        if done - at >= 3 or time.perf_counter() - began >= 10:
            jax.block_until_ready(metrics)
            self.project((time.perf_counter() - began) / (done - at), chunk.previous + done)

    def after_chunk(self, chunk):
        if chunk.step > chunk.previous:
            self.project(chunk.seconds / (chunk.step - chunk.previous), chunk.step)

    def project(self, seconds_per_step: float, step: int):
        if self.said:
            return
        self.said = True
        s = self.session
        left = s.setup.total_steps - step
        seconds = left * seconds_per_step
        if seconds <= LONG_RUN_SECONDS:
            return
        line = (f"projected: about {duration(seconds)} of training left ({left:,} steps at "
                f"{seconds_per_step:.3g} s a step on {jax.devices()[0].device_kind}; "
                "evaluations not counted)")
        if jax.default_backend() == "cpu":
            narrower = ("a narrower cifar_cnn (--config.model.widths=(16,32,64)), "
                        if s.config.model.name == "cifar_cnn" else "")
            line += (f". This recipe is sized for a GPU; on a CPU, {narrower}"
                     "configs/fashion_mnist_cnn.py, configs/cifar_seed_cnn.py or "
                     "configs/fashion_mnist_mlp.py train in minutes")
        s.reporter.print_line(line)


def duration(seconds: float) -> str:
    """'3 h 20 min', '45 min'."""
    minutes = round(seconds / 60)
    return f"{minutes // 60} h {minutes % 60} min" if minutes >= 60 else f"{minutes} min"


class Rows(Action):
    """The chunk's metrics rows (plan.chunk_rows): on the row grid, at epoch ends, at
    evaluations and stops; a non-finite loss stops the run here (train.nonfinite='stop')."""

    def after_chunk(self, chunk):
        s, run = self.session, self.session.setup
        if s.config.train.nonfinite == "stop":
            check_finite(chunk.metrics, run, chunk.epoch, s.manager.directory)
        ends = [step for step in range(chunk.previous + 1, chunk.step + 1) if s.on_grid(step)]
        epoch_done = chunk.step % run.steps_per_epoch == 0
        if ((epoch_done or chunk.last or chunk.stopping or s.evaluates(chunk.step))
                and chunk.step not in ends[-1:]):
            ends.append(chunk.step)
        chunk.rows = s.chunk_rows(chunk, ends)
        s.latest.update({row.get("replica"): row for row in chunk.rows})
        s.clock.lap("train")


class Evaluation(Action):
    """The test split evaluated on schedule; its metrics go into the last rows."""

    def after_chunk(self, chunk):
        s = self.session
        if not s.evaluates(chunk.step):
            return
        self.evaluate(chunk.step)
        for replica, row in s.latest.items():
            row.update(seconds=round(s.train_seconds, 4),
                       **{f"test_{name}": value if replica is None else value[replica]
                          for name, value in s.test_metrics.items()})
        chunk.evaluated = True

    def evaluate(self, step: int, counted: bool = True):
        s = self.session
        metrics, seconds = self.timed_evaluation(s.state, step)
        s.test_metrics, s.test_step = host_metrics(metrics), step
        if s.state.ema is not None:  # train.ema_decay: the averaged weights too
            metrics, more = self.timed_evaluation(train_state.ema_weights(s.state), step)
            s.test_metrics.update({f"{name}_ema": value
                                   for name, value in host_metrics(metrics).items()})
            seconds += more
        if counted:  # part of the run's train_seconds
            s.eval_seconds += seconds
            s.train_seconds += seconds
        s.clock.lap("eval")

    def timed_evaluation(self, state, step: int):
        """(metrics, seconds) of the test split, batch by batch with a progress bar; a
        signal between two batches (agreed by every process) stops the run there, saving
        nothing new and naming the newest checkpoint."""
        s = self.session
        several = jax.process_count() > 1
        with s.reporter.evaluation_progress(s.eval_fn.batches) as bar:
            try:
                return chunks.timed(s.eval_fn, state, *s.eval_arrays,
                                    lambda: processes.any_process(bool(s.signal())) if several
                                    else bool(s.signal()), bar.update)
            except evaluation.EvaluationStopped:
                pass
        checkpoint.wait(s.manager)
        saved = checkpoint.saved_steps(s.manager.directory)
        newest = (f"the newest checkpoint is {s.manager.directory}/{max(saved)}; run the same "
                  "command again to resume from it" if saved else "no checkpoint was saved yet")
        raise signals.Interrupted(s.signal.signal or signal.SIGTERM, phase=(
            f"evaluating step {step}; nothing new saved: {newest}"))

    def finish(self):
        # A finished run resumed, or one stopped early between evaluations: the summary's
        # figures, not part of training's time.
        if self.session.test_step != self.session.step:
            self.evaluate(self.session.step, counted=False)


class Log(Action):
    """The rows into metrics.jsonl and TensorBoard; the console's row at each epoch end."""

    def after_chunk(self, chunk):
        s = self.session
        for row in chunk.rows:
            s.reporter.log(row)
        if chunk.step % s.setup.steps_per_epoch == 0 or chunk.last:
            s.reporter.print_row(console_row(s.latest, s.reporter.records,
                                             s.setup.steps_per_epoch))
        s.clock.lap("train")


class Checkpoints(Action):
    """Saves on schedule (checkpoint.every_steps / every_epochs), at the last step and
    where the run stops; asynchronously, waited for before the run ends. With
    checkpoint.best_metric, also at every evaluation, with its test metric, so that the
    manager (Orbax's BestN policy) keeps the best ones."""

    def __init__(self, session, restore_best: bool = False):
        """restore_best: end with the best checkpoint's weights and figures (a callback's
        restore_best_weights)."""
        super().__init__(session)
        self.best = checkpoint.best_policy(session.config.checkpoint)
        self.best_checkpoint = None
        self.restore_best, self.restored = restore_best, None

    def after_chunk(self, chunk):
        every = self.session.save_every
        if (chunk.last or chunk.stopping or (every > 0 and chunk.step % every == 0)
                or (self.best and chunk.evaluated)):
            self.save(chunk)

    def save(self, chunk):
        s = self.session
        if not chunk.saved:
            metrics = None
            if self.best and s.test_step == chunk.step:
                name = self.best[0].removeprefix("test_")
                metrics = {self.best[0]: float(np.mean(s.test_metrics[name]))}
            s.save(metrics)
            chunk.saved = True
        s.clock.lap("checkpoint")

    def finish(self):
        s = self.session
        checkpoint.wait(s.manager)
        if self.best:  # over every checkpoint kept, also those of the run before a resume
            step = s.manager.best_step()
            values = [row[self.best[0]] for row in s.reporter.records
                      if row["step"] == step and row.get(self.best[0]) is not None]
            if step is not None and values:
                self.best_checkpoint = {"step": step, self.best[0]: float(np.mean(values)),
                                        "path": os.path.join(s.manager.directory, str(step))}
                if self.restore_best:
                    self.restore(step)
        s.clock.lap("checkpoint")

    def restore(self, step: int) -> None:
        """The session's state and test figures become those of checkpoint `step`."""
        s = self.session
        s.state = checkpoint.restore(s.manager, s.state, s.data_key, step)[0]
        rows = sorted((row for row in s.reporter.records
                       if row["step"] == step and row.get("test_loss") is not None),
                      key=lambda row: row.get("replica", 0))
        names = [key for key in rows[0] if key.startswith("test_")]
        s.test_metrics = {key.removeprefix("test_"): rows[0][key] if len(rows) == 1
                          else [row[key] for row in rows] for key in names}
        s.test_step, self.restored = step, step

    def summarize(self, summary):
        if self.best_checkpoint is not None:
            summary["best_checkpoint"] = self.best_checkpoint
        if self.restored is not None:
            summary["restored_best_weights"] = {"step": self.restored}


class UserCallbacks(Action):
    """The user's callbacks (callbacks.py): each row and evaluation exactly once, also
    across a kill and resume (rows metrics.jsonl held past the resumed step were
    delivered before the kill: they come as history, not again)."""

    def __init__(self, session, callbacks: list):
        super().__init__(session)
        self.callbacks = callbacks
        self.delivered_through = 0  # the last step whose rows the callbacks have seen

    def call(self, hook: str, *args, step=None):
        for callback in self.callbacks:
            if not base.overrides(callback, hook):
                continue
            try:
                getattr(callback, hook)(*args)
            except base.StopTraining as stop:
                self.session.ask_to_stop(f"{stop.reason}")
            except Exception as error:
                s = self.session
                where = f" at step {s.step if step is None else step}"
                reason = str(error).strip().splitlines()[0] if str(error).strip() else ""
                try:
                    checkpoint.wait(s.manager)  # the save of this step, if one is under way
                except checkpoint.CheckpointError:
                    pass
                saved = sorted(s.manager.all_steps())
                kept = (f"the checkpoints are kept in {s.manager.directory} (newest: step "
                        f"{saved[-1]})" if saved else "no checkpoint was saved yet")
                raise base.CallbackError(
                    f"callback {callbacks_lib.describe(callback)}.{hook} failed{where}: "
                    f"{type(error).__name__}: {reason}; {kept}") from error

    def with_epoch_means(self, step: int, metrics: dict) -> dict:
        """An evaluation's metrics with train_loss and train_accuracy the mean over its
        epoch's steps up to `step`: the figures the console's epoch row shows (a metrics
        row's own are the mean since the row before)."""
        records = [row for row in self.session.reporter.records if row["step"] <= step]
        spe = self.session.setup.steps_per_epoch
        if "replica" in metrics:  # a replicated run: a list per metric, one per replica
            means = [report.epoch_means(records, spe, r) for r in metrics["replica"]]
            return dict(metrics, **{key: [m.get(key) for m in means]
                                    for key in ("train_loss", "train_accuracy")})
        return dict(metrics, **report.epoch_means(records, spe))

    def start(self):
        s = self.session
        history = list(s.reporter.previous_records)
        self.delivered_through = history[-1]["step"] if history else 0
        run = base.RunInfo(
            config=s.config, workdir=s.workdir, start_step=s.start_step,
            total_steps=s.setup.total_steps, steps_per_epoch=s.setup.steps_per_epoch,
            devices=jax.device_count(), process_index=jax.process_index(),
            process_count=jax.process_count(), checkpoint_dir=s.manager.directory,
            history=history)
        self.call("on_run_start", run)
        s.clock.lap("write")  # a tracker's start (its store, its run): not training time

    def after_chunk(self, chunk):
        if not self.callbacks:
            return
        rows = [row for row in chunk.rows if row["step"] > self.delivered_through]
        if rows:
            self.call("on_rows", [dict(row) for row in rows])
        for step, metrics in base.evaluation_points(rows):
            self.call("on_evaluation", step, self.with_epoch_means(step, metrics), step=step)
        if chunk.saved and any(base.overrides(c, "on_checkpoint")
                               for c in self.callbacks):
            checkpoint.wait(self.session.manager)  # on disk before anyone is told
            path = os.path.join(self.session.manager.directory, str(chunk.step))
            self.call("on_checkpoint", chunk.step, path)
        self.delivered_through = max(self.delivered_through, chunk.step)

    def run_end(self, summary):
        self.call("on_run_end", summary)


class Stops(Action):
    """Where the run stops before its last step: a signal (after the checkpoint of this
    step: exit 128 + N), or a callback's StopTraining (checkpoint, one line, exit 0),
    agreed by every process at the same chunk boundary."""

    def __init__(self, session, checkpoints: Checkpoints):
        super().__init__(session)
        self.checkpoints, self.stopped_early = checkpoints, None

    def start(self):
        self.agree(Chunk(0, 0, 0, previous=self.session.step, step=self.session.step))

    def after_chunk(self, chunk):
        s = self.session
        if chunk.stopping:
            checkpoint.wait(s.manager)
            raise signals.Interrupted(s.signal.signal or signal.SIGTERM, chunk.step,
                                      s.manager.directory)
        self.agree(chunk)

    def agree(self, chunk):
        s = self.session
        asking = processes.first_process(s.stop_reason is not None)
        if asking is None:
            return
        reason = s.stop_reason or f"a callback of process {asking} asked to stop"
        if chunk.step not in checkpoint.saved_steps(s.manager.directory):
            self.checkpoints.save(chunk)
        checkpoint.wait(s.manager)
        self.stopped_early = {"step": chunk.step, "reason": reason}
        s.reporter.print_line(f"stopped early at step {chunk.step}: {reason}")
        s.stopped = True

    def summarize(self, summary):
        if self.stopped_early is not None:
            summary["stopped_early"] = self.stopped_early


def check_finite(metrics: dict, run, epoch: int, directory: str) -> None:
    """train.nonfinite='stop': a TrainingError at a chunk's first non-finite loss, naming
    the step (and the replica, for a replicated run)."""
    bad_steps = np.atleast_1d(metrics["nonfinite_step"])
    if not (bad_steps >= 0).any():
        return
    replica = int(np.argmax(bad_steps >= 0))
    bad = epoch * run.steps_per_epoch + int(bad_steps[replica])
    which = f" of {replicas.describe(run.runs[replica])}" if run.runs else ""
    raise TrainingError(
        f"non-finite training loss at step {bad} (epoch {epoch}){which}; the last good "
        f"checkpoint is kept in {directory}. Lower optimizer.learning_rate, check the data, "
        "or set train.nonfinite='skip' to skip such steps")


def host_metrics(metrics) -> dict:
    """Evaluation results as Python floats (a list per metric for a replicated run)."""
    return {name: float(value) if np.ndim(value) == 0 else [float(v) for v in value]
            for name, value in jax.device_get(metrics).items()}


def console_row(latest: dict, records: list, steps_per_epoch: int) -> dict:
    """The console's row at an epoch's end: the last row with the epoch's mean training
    figures; for a replicated run, (mean, std) over the replicas of each figure."""
    rows = {replica: dict(row, **report.epoch_means(records, steps_per_epoch, replica))
            for replica, row in latest.items()}
    if list(rows) == [None]:
        return rows[None]
    row = dict(rows[max(rows)])
    for key in ("train_loss", "train_accuracy", "test_loss", "test_accuracy", "test_loss_ema",
                "test_accuracy_ema"):
        if all(one.get(key) is not None for one in rows.values()):
            row[key] = replicas.mean_std(one[key] for one in rows.values())
    return row
