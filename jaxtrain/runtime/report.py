"""What a run tells its user: console table and progress bar, metrics.jsonl,
TensorBoard event files, a PNG of the curves, and summary.json."""
import dataclasses
import itertools
import json
import math
import os
import sys

import tqdm

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
PLOT_FILE = "curves.png"
TENSORBOARD_DIR = "tensorboard"

# (record key, header, width, format spec) of the console table.
COLUMNS = (("epoch", "epoch", 7, ".2f"), ("step", "step", 8, "d"),
           ("train_loss", "train_loss", 10, ".4f"), ("train_accuracy", "train_acc", 9, ".2%"),
           ("test_loss", "test_loss", 9, ".4f"), ("test_accuracy", "test_acc", 8, ".2%"),
           ("learning_rate", "lr", 9, ".3g"), ("seconds", "seconds", 8, ".2f"))
# A replicated run's table: each figure as mean+-std over the replicas.
SPREAD_COLUMNS = (("epoch", "epoch", 7, ".2f"), ("step", "step", 8, "d"),
                  ("train_loss", "train_loss", 15, ".4f"),
                  ("train_accuracy", "train_acc", 15, ".2%"),
                  ("test_loss", "test_loss", 15, ".4f"), ("test_accuracy", "test_acc", 15, ".2%"),
                  ("seconds", "seconds", 8, ".2f"))
# train.ema_decay: the averaged weights' test figures, after the raw weights' (width, spread width)
EMA_COLUMNS = (("test_loss_ema", "loss_ema", 9, 15, ".4f"),
               ("test_accuracy_ema", "acc_ema", 8, 15, ".2%"))
# Row keys that say which run a row is of (replicas.py), not what it measured.
RUN_KEYS = ("step", "replica", "seed")


def write_atomically(path: str, text: str) -> None:
    """Writes `text` beside `path` and moves it into place: a reader never sees a
    half-written file, and a kill meanwhile leaves the file as it was."""
    with open(f"{path}.tmp", "w") as f:
        f.write(text)
    os.replace(f"{path}.tmp", path)


def write_json_atomically(path: str, obj) -> None:
    write_atomically(path, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def read_metrics(workdir: str) -> list[dict]:
    """The records of metrics.jsonl, up to the first incomplete line (a killed run's last)."""
    records = []
    with open(os.path.join(workdir, METRICS_FILE)) as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                break
    return records


@dataclasses.dataclass(frozen=True)
class History:
    """A run's metrics as Python objects (jaxtrain.history), as Keras's fit returns them:
    `train`, the training rows (step, epoch, train_loss, train_accuracy, learning_rate,
    seconds), and `evaluations`, the rows with test metrics (step, epoch, test_loss,
    test_accuracy, ...); a replicated run's rows name their replica and seed."""
    train: list
    evaluations: list

    def series(self, name: str, replica: int | None = None) -> tuple[list, list]:
        """(steps, values) of one metric ('train_loss', 'test_accuracy', ...), of one
        replica for a replicated run."""
        rows = self.evaluations if name.startswith("test_") else self.train
        pairs = [(row["step"], row[name]) for row in rows
                 if row.get(name) is not None and row.get("replica") == replica]
        return [step for step, _ in pairs], [value for _, value in pairs]


def history(workdir: str) -> History:
    """The run in `workdir`'s metrics.jsonl, every resume's rows included, as a History."""
    path = os.path.join(workdir, METRICS_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no {METRICS_FILE} in {workdir}: not the workdir of a run")
    records = read_metrics(workdir)
    return History(train=[row for row in records if "train_loss" in row],
                   evaluations=[row for row in records if "test_loss" in row])


def import_tensorboardx():
    """tensorboardX, imported without torch: it imports torch when it can (about a
    second) only to accept torch tensors, and jaxtrain logs plain floats."""
    if "torch" in sys.modules:
        import tensorboardX
        return tensorboardX
    sys.modules["torch"] = None  # makes `import torch` raise ImportError, which it handles
    try:
        import tensorboardX
    finally:
        del sys.modules["torch"]
    return tensorboardX


def evaluation_progress(batches: int, write: bool = True):
    """tqdm over an evaluation's test batches (its update as the callable); a short one
    never shows it (delay), nor does a process other than 0 or a stderr that is not a
    terminal."""
    return tqdm.tqdm(total=batches, unit="batch", desc="evaluating", leave=False,
                     delay=2.0, dynamic_ncols=True, disable=None if write else True)


def table_columns(spread: bool = False, ema: bool = False) -> tuple:
    """The console table's columns: the EMA's after the test accuracy, when there is one."""
    columns = SPREAD_COLUMNS if spread else COLUMNS
    if not ema:
        return columns
    at = next(i for i, (key, *_) in enumerate(columns) if key == "test_accuracy") + 1
    added = tuple((key, header, spread_width if spread else width, spec)
                  for key, header, width, spread_width, spec in EMA_COLUMNS)
    return columns[:at] + added + columns[at:]


class Reporter:
    """Writes every logged record to metrics.jsonl and TensorBoard as it arrives.

    With write=False (every process of a multi-process run but the first) it
    only keeps the records: nothing is printed or written.
    """

    def __init__(self, workdir: str, total_steps: int, start_step: int = 0, stream=None,
                 write: bool = True, spread: bool = False, ema: bool = False,
                 rows_through: int | None = None):
        """start_step > 0 continues a resumed run: records up to it are kept, later ones
        (written after the checkpoint the run resumed from) are dropped, and so are
        training rows after `rows_through` (the last row the checkpoint's window
        follows: a row where an earlier run stopped, whose steps the next row covers
        again). spread: the console rows are (mean, std) over replicas. ema: the table
        has the averaged weights' test columns too (train.ema_decay)."""
        self.columns = table_columns(spread, ema)
        tensorboardX = import_tensorboardx()
        self.workdir = workdir
        self.write = write
        self.stream = stream or sys.stdout
        path = os.path.join(workdir, METRICS_FILE)
        # A resumed run's rows as the file held them, also those past start_step (a killed
        # run logged them after its last checkpoint; this run logs them again).
        self.previous_records: list[dict] = (read_metrics(workdir) if start_step > 0
                                             and os.path.exists(path) else [])
        through = start_step if rows_through is None else rows_through
        self.records = [r for r in self.previous_records if r["step"] <= start_step
                        and not (is_train_row(r) and r["step"] > through)]
        if not write:
            return
        os.makedirs(workdir, exist_ok=True)
        write_atomically(path, "".join(json.dumps(record) + "\n" for record in self.records))
        self._metrics = open(path, "a")
        self._tensorboard = tensorboardX.SummaryWriter(os.path.join(workdir, TENSORBOARD_DIR))
        # tqdm hides itself when stderr is not a terminal (disable=None).
        self._progress = tqdm.tqdm(total=total_steps, initial=start_step, unit="step",
                                   disable=None, leave=False, dynamic_ncols=True)

    def advance(self, step: int) -> None:
        """The progress bar at `step` (every compiled call reports its steps)."""
        if self.write and step > self._progress.n:
            self._progress.update(step - self._progress.n)

    def evaluation_progress(self, batches: int):
        """A progress bar over an evaluation's batches (a callable taking how many were
        done), shown from its second second on, on a terminal, by process 0 only."""
        return evaluation_progress(batches, self.write)

    def print_line(self, line: str) -> None:
        if self.write:
            tqdm.tqdm.write(line, file=self.stream)

    def print_header(self, **info) -> None:
        self.print_line("  ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}"
                              for k, v in info.items()))
        self.print_line(" ".join(f"{header:>{width}}" for _, header, width, _ in self.columns))

    def print_row(self, row: dict) -> None:
        """One table row; a (mean, std) value prints as mean+-std."""
        def cell(value, width, spec):
            if value is None:
                return f"{'-':>{width}}"
            if isinstance(value, tuple):
                return f"{f'{value[0]:{spec}}±{value[1]:{spec}}':>{width}}"
            return f"{value:>{width}{spec}}"
        self.print_line(" ".join(cell(row.get(key), width, spec)
                                 for key, _, width, spec in self.columns))

    def log(self, record: dict) -> None:
        self.records.append(record)
        if not self.write:
            return
        self._metrics.write(json.dumps(record) + "\n")
        self._metrics.flush()
        # A replica's curves are tagged NAME/replica_K; swept settings ('optimizer.x')
        # are labels of the row, not curves.
        suffix = f"/replica_{record['replica']}" if "replica" in record else ""
        for key, value in record.items():
            if (key not in RUN_KEYS and "." not in key and isinstance(value, (int, float))
                    and math.isfinite(value)):
                self._tensorboard.add_scalar(key + suffix, value, record["step"])
        self._tensorboard.flush()

    def close(self) -> None:
        if not self.write:
            return
        self._progress.close()
        self._tensorboard.close()
        self._metrics.close()

    def plot(self) -> str:
        """curves_figure of the rows as workdir/curves.png."""
        import matplotlib.pyplot as plt
        fig = curves_figure(self.records)
        path = os.path.join(self.workdir, PLOT_FILE)
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path

    def write_summary(self, summary: dict) -> None:
        if not self.write:
            return
        write_json_atomically(os.path.join(self.workdir, SUMMARY_FILE), summary)
        if "replicas" in summary:
            best = summary["best"]
            settings = "".join(f", {k}={v:g}" for k, v in best["settings"].items())
            for point in summary.get("sweep_points", []):
                self.print_line("  ".join(f"{k}={v:g}" for k, v in point["settings"].items())
                                + f": test_accuracy={point['test_accuracy_mean']:.2%}"
                                f"±{point['test_accuracy_std']:.2%} over "
                                f"{len(point['replicas'])} replicas")
            self.print_line(f"{summary['replica_count']} replicas: test_accuracy="
                            f"{summary['test_accuracy']:.2%}±{summary['test_accuracy_std']:.2%}"
                            f" (mean±std); best: replica {best['replica']} (seed {best['seed']}"
                            f"{settings}) {best['test_accuracy']:.2%}")
        self.print_line(f"test_accuracy={summary['test_accuracy']:.2%}  "
                    f"test_loss={summary['test_loss']:.4f}  "
                    f"train_seconds={summary['train_seconds']:.2f}  "
                    f"compile_seconds={summary['compile_seconds']:.2f}  "
                    f"images/s={summary['images_per_second']:.0f}  -> {self.workdir}")


def is_train_row(row: dict) -> bool:
    """A training row (an evaluation's row of its own has test metrics alone)."""
    return "train_loss" in row


def epoch_means(records: list, steps_per_epoch: int, replica: int | None = None) -> dict:
    """Training loss and accuracy over the last epoch the training rows reach (or its
    steps so far): the rows' means weighted by their steps (of one replica's rows, for a
    replicated run). The console's epoch rows and summary.json's train_loss; from the
    rows, so a resumed run gets the uninterrupted run's figures."""
    records = [row for row in records if is_train_row(row) and row.get("replica") == replica]
    if not records:
        return {}
    last = records[-1]["step"]
    epoch_start = (last - 1) // steps_per_epoch * steps_per_epoch
    sums, previous = {"train_loss": 0.0, "train_accuracy": 0.0, "steps": 0}, epoch_start
    epoch_rows = itertools.takewhile(lambda row: row["step"] > epoch_start, reversed(records))
    for row in reversed(list(epoch_rows)):
        steps = row["step"] - previous - row.get("skipped_steps", 0)
        previous = row["step"]
        if row.get("train_loss") is None or steps <= 0:
            continue
        sums["train_loss"] += row["train_loss"] * steps
        sums["train_accuracy"] += row["train_accuracy"] * steps
        sums["steps"] += steps
    if not sums["steps"]:
        return {"train_loss": None, "train_accuracy": None}
    return {key: sums[key] / sums["steps"] for key in ("train_loss", "train_accuracy")}


def replica_label(row: dict) -> str:
    """A replica's name in the plot's legend, from one of its rows: its seed and swept
    settings (the dotted keys, 'optimizer.learning_rate'), e.g. 'seed 1, learning_rate=0.1'."""
    settings = [f"{key.rsplit('.', 1)[1]}={value:g}" for key, value in row.items()
                if "." in key and isinstance(value, (int, float))]
    return ", ".join([f"seed {row.get('seed', '?')}", *settings])


def curves_figure(records: list):
    """Loss, accuracy (train and test) and learning rate against step. A single run: train
    and test in a colour each. A replicated run: a colour per replica, named in the legend
    by its seed and swept values, train solid and test dashed. Points get markers when
    there are few of them, so a short run or a single test point still shows."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (loss_ax, acc_ax, lr_ax) = plt.subplots(1, 3, figsize=(15, 4))
    runs = sorted({r.get("replica", -1) for r in records})
    replicated = runs != [-1]
    for index, run in enumerate(runs):
        own = [r for r in records if r.get("replica", -1) == run]
        name = replica_label(own[0]) if replicated else None
        for split, style in (("train", "-"), ("test", "--")):
            points = [r for r in own if r.get(f"{split}_loss") is not None]
            if replicated:
                color, label = f"C{index % 10}", name if split == "train" else None
            else:
                color = "tab:blue" if split == "train" else "tab:orange"
                label = f"{split} ({len(points)} point{'s' if len(points) != 1 else ''})"
            steps = [r["step"] for r in points]
            line = dict(color=color, label=label, linestyle=style if replicated else "-",
                        marker="o" if split == "test" or len(points) <= 60 else None,
                        markersize=4 if split == "train" else 5)
            loss_ax.plot(steps, [r[f"{split}_loss"] for r in points], **line)
            acc_ax.plot(steps, [r[f"{split}_accuracy"] for r in points], **line)
        rates = [r for r in own if "learning_rate" in r]
        lr_ax.plot([r["step"] for r in rates], [r["learning_rate"] for r in rates],
                   color=f"C{index % 10}" if replicated else "tab:green",
                   marker="o" if len(rates) <= 60 else None, markersize=3)
    last = records[-1] if records else {}
    for ax, name in ((loss_ax, "loss"), (acc_ax, "accuracy"), (lr_ax, "learning rate")):
        ax.set_xlabel("step")
        ax.set_title(name + (" (train solid, test dashed)" if replicated and ax is not lr_ax
                             else ""))
        ax.grid(alpha=0.3)
        ax.set_xlim(0, max(last.get("step", 1), 1) * 1.02)
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    for ax in (loss_ax, acc_ax):
        ax.legend(fontsize="small" if len(runs) > 8 else None, ncol=2 if len(runs) > 8 else 1)
    acc_ax.yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
    lr_ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    if last:
        fig.suptitle(f"{last['step']} steps, {last.get('epoch', 0):g} epochs")
    # fixed margins for this fixed size: tight_layout measures every label first, 40%
    # of the plot's time, which every run's end pays
    fig.subplots_adjust(left=0.045, right=0.985, bottom=0.13, top=0.86, wspace=0.2)
    return fig
