"""What a run tells its user: console table and progress bar, metrics.jsonl,
TensorBoard event files, a PNG of the curves, and summary.json."""
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


def write_json_atomically(path: str, obj) -> None:
    """Writes JSON so that a reader never sees a half-written file."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True, default=str)
        f.write("\n")
    os.replace(tmp, path)


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


class Reporter:
    """Writes every logged record to metrics.jsonl and TensorBoard as it arrives.

    With write=False (every process of a multi-process run but the first) it
    only keeps the records: nothing is printed or written.
    """

    def __init__(self, workdir: str, total_steps: int, start_step: int = 0, stream=None,
                 write: bool = True):
        """start_step > 0 continues a resumed run: records up to it are kept, later ones
        (written after the checkpoint the run resumed from) are dropped."""
        import tensorboardX  # deferred: only runs that report need it

        self.workdir = workdir
        self.write = write
        self.stream = stream or sys.stdout
        path = os.path.join(workdir, METRICS_FILE)
        self.records: list[dict] = []
        if not write:
            return
        if start_step > 0 and os.path.exists(path):
            self.records = [r for r in read_metrics(workdir) if r["step"] <= start_step]
        os.makedirs(workdir, exist_ok=True)
        self._metrics = open(path, "w")
        for record in self.records:
            self._metrics.write(json.dumps(record) + "\n")
        self._tensorboard = tensorboardX.SummaryWriter(os.path.join(workdir, TENSORBOARD_DIR))
        # tqdm hides itself when stderr is not a terminal (disable=None).
        self._progress = tqdm.tqdm(total=total_steps, initial=start_step, unit="step",
                                   disable=None, leave=False, dynamic_ncols=True)

    def print_line(self, line: str) -> None:
        if self.write:
            tqdm.tqdm.write(line, file=self.stream)

    def print_header(self, **info) -> None:
        self.print_line("  ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}"
                              for k, v in info.items()))
        self.print_line(" ".join(f"{header:>{width}}" for _, header, width, _ in COLUMNS))

    def print_row(self, row: dict) -> None:
        self.print_line(" ".join(f"{row[key]:>{width}{spec}}" if row.get(key) is not None
                             else f"{'-':>{width}}" for key, _, width, spec in COLUMNS))

    def log(self, record: dict) -> None:
        self.records.append(record)
        if not self.write:
            return
        self._metrics.write(json.dumps(record) + "\n")
        self._metrics.flush()
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                self._tensorboard.add_scalar(key, value, record["step"])
        self._tensorboard.flush()
        self._progress.update(record["step"] - self._progress.n)

    def close(self) -> None:
        if not self.write:
            return
        self._progress.close()
        self._tensorboard.close()
        self._metrics.close()

    def plot(self) -> str:
        """Loss and accuracy against step, train and test, as workdir/curves.png."""
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (loss_ax, acc_ax) = plt.subplots(1, 2, figsize=(10, 4))
        for split, style in (("train", "-"), ("test", "o-")):
            points = [r for r in self.records if f"{split}_loss" in r]
            steps = [r["step"] for r in points]
            loss_ax.plot(steps, [r[f"{split}_loss"] for r in points], style, label=split)
            acc_ax.plot(steps, [r[f"{split}_accuracy"] for r in points], style, label=split)
        for ax, name in ((loss_ax, "loss"), (acc_ax, "accuracy")):
            ax.set_xlabel("step")
            ax.set_ylabel(name)
            ax.grid(alpha=0.3)
            ax.legend()
        fig.tight_layout()
        path = os.path.join(self.workdir, PLOT_FILE)
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path

    def write_summary(self, summary: dict) -> None:
        if not self.write:
            return
        write_json_atomically(os.path.join(self.workdir, SUMMARY_FILE), summary)
        self.print_line(f"test_accuracy={summary['test_accuracy']:.2%}  "
                    f"test_loss={summary['test_loss']:.4f}  "
                    f"train_seconds={summary['train_seconds']:.2f}  "
                    f"compile_seconds={summary['compile_seconds']:.2f}  "
                    f"images/s={summary['images_per_second']:.0f}  -> {self.workdir}")
