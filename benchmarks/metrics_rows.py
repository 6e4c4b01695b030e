"""What logging often costs: the MLP recipe (10 epochs, 4,680 steps, scanned chunks) with
one metrics row per epoch against about 50 rows a run (the default) and a row every step.

    python3 benchmarks/metrics_rows.py [--before=CHECKOUT] [--rounds=3] [--json=PATH]

Rows come from each chunk's per-step metrics, so every setting runs the same compiled
chunks (one per epoch); what differs is the host's work per row. --before runs the
recipe in an older checkout too (there a row needed a chunk of its own, and chunks
returned no per-step metrics). Figures are each setting's median training time
(train_seconds - eval_seconds, summary.json: the compiled chunks) and of the whole
training phase with the host's rows, TensorBoard and console work (phase_seconds'
train; not in --before's), over the rounds, settings interleaved.
CPU timings here are noisy: compare within one run of this script.
"""
import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def train_only_seconds(repo: str, workdir: str, *overrides: str) -> tuple[float, float, int]:
    command = [sys.executable, "main.py", "--config=configs/fashion_mnist_mlp.py",
               f"--workdir={workdir}", *overrides]
    done = subprocess.run(command, cwd=repo, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"error: {' '.join(command)}:\n{done.stderr[-2000:]}")
    with open(os.path.join(workdir, "summary.json")) as f:
        summary = json.load(f)
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        rows = sum(1 for _ in f)
    phase = summary.get("phase_seconds", {}).get("train", float("nan"))
    return summary["train_seconds"] - summary["eval_seconds"], phase, rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args()
    settings = {"one row per epoch": (HERE, "--config.train.log_every_steps=468"),
                "about 50 rows (default)": (HERE,),
                "a row every step": (HERE, "--config.train.log_every_steps=1")}
    if args.before:
        settings["before: one row per epoch"] = (args.before,)
    seconds = {name: [] for name in settings}
    phase = {name: [] for name in settings}
    rows = {}
    with tempfile.TemporaryDirectory() as scratch:
        for round_ in range(args.rounds):
            for name, (repo, *overrides) in settings.items():
                workdir = os.path.join(scratch, f"{len(rows)}-{round_}-{name[:3]}")
                took, train_phase, rows[name] = train_only_seconds(repo, workdir, *overrides)
                seconds[name].append(took)
                phase[name].append(train_phase)
    report = {name: {"rows": rows[name], "median_train_seconds": statistics.median(values),
                     "rounds": [round(v, 3) for v in values],
                     "median_train_phase_seconds": (None if math.isnan(phase[name][0])
                                                    else statistics.median(phase[name])),
                     "images_per_second": 4680 * 128 / statistics.median(values)}
              for name, values in seconds.items()}
    base = report["one row per epoch"]["median_train_seconds"]
    for name, entry in report.items():
        entry["vs_one_row_per_epoch"] = round(entry["median_train_seconds"] / base, 3)
        print(f"{name:28s} {entry['rows']:5d} rows  chunks {entry['median_train_seconds']:.3f} s "
              f"x{entry['vs_one_row_per_epoch']:.3f} (rounds {entry['rounds']}); train phase "
              f"{entry['median_train_phase_seconds'] or float('nan'):.3f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
