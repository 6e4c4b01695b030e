"""What the open loop costs: the MLP recipe (10 epochs, 4,680 scanned steps) before the
loop became actions and callbacks, after it with no callbacks, and after it with the
MLflow tracker logging every row into a SQLite store.

    python3 benchmarks/loop_cost.py --before=CHECKOUT [--rounds=3] [--json=PATH]

CHECKOUT: a checkout of the commit before the change (git worktree add DIR 2d11c8c).
Figures are each setting's median, over the rounds with the settings interleaved, of
the training time (train_seconds - eval_seconds in summary.json: the compiled
chunks) and of the whole training phase (phase_seconds' train: the chunks plus the
host's rows, TensorBoard, console and callbacks). CPU timings here are noisy:
compare within one run of this script.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(repo: str, workdir: str, *overrides: str) -> tuple[float, float]:
    command = [sys.executable, "main.py", "--config=configs/fashion_mnist_mlp.py",
               f"--workdir={workdir}", *overrides]
    done = subprocess.run(command, cwd=repo, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"error: {' '.join(command)}:\n{done.stderr[-2000:]}")
    with open(os.path.join(workdir, "summary.json")) as f:
        summary = json.load(f)
    return (summary["train_seconds"] - summary["eval_seconds"],
            summary["phase_seconds"]["train"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        settings = {"before (one function)": (args.before,),
                    "after, no callbacks": (HERE,),
                    "after, MLflow tracker": (
                        HERE, f"--config.logging.mlflow=sqlite:///{scratch}/mlflow.db")}
        figures = {name: {"train_only": [], "train_phase": []} for name in settings}
        for round_ in range(args.rounds):
            for index, (name, (repo, *overrides)) in enumerate(settings.items()):
                workdir = os.path.join(scratch, f"round{round_}-setting{index}")  # a fresh run
                train_only, phase = run(repo, workdir, *overrides)
                figures[name]["train_only"].append(train_only)
                figures[name]["train_phase"].append(phase)
                print(f"round {round_ + 1} {name}: training {train_only:.2f} s, training "
                      f"phase {phase:.2f} s", flush=True)
    result = {"recipe": "configs/fashion_mnist_mlp.py (4,680 steps)", "rounds": args.rounds,
              "settings": {}}
    base = statistics.median(figures["before (one function)"]["train_phase"])
    for name, values in figures.items():
        median = {key: statistics.median(v) for key, v in values.items()}
        result["settings"][name] = {**values, "median_train_only_seconds": median["train_only"],
                                    "median_train_phase_seconds": median["train_phase"],
                                    "train_phase_vs_before": median["train_phase"] / base}
        print(f"{name:24s} training {median['train_only']:.2f} s, training phase "
              f"{median['train_phase']:.2f} s (x{median['train_phase'] / base:.2f} before)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
