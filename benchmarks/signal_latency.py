"""Seconds from a signal to the process's exit, in every phase of the CPU recipes' runs.

    python3 benchmarks/signal_latency.py --cifar_dir=DIR [--json=PATH] [--signal=SIGINT]

DIR holds cifar-10-batches-py (configs/cifar_seed_cnn.py's data); Fashion-MNIST comes from
/usr/share/datasets/fashion-mnist. Each figure is one `python main.py` process of the
recipe, sent the signal at a point of its run recognised from its console lines (printed
unbuffered): while importing, loading or building, compiling, training (3 s into the
first chunk), evaluating (a run that evaluates after every step; tried again, up to
three times, until the signal lands in an evaluation) and writing the reports after the
last step. It records the exit status and what the process said (the phase, the step
it saved). CPU timings are noisy: rerun to compare.
"""
import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = {
    "fashion_mnist_cnn": ["--config=configs/fashion_mnist_cnn.py"],
    "fashion_mnist_mlp": ["--config=configs/fashion_mnist_mlp.py"],
    "cifar_seed_cnn": ["--config=configs/cifar_seed_cnn.py", "--config.data.source=files"],
}
TABLE_HEADER = "  epoch     step"


def after_line(prefix: str, wait: float = 0.0):
    """A trigger: `wait` seconds after the first stdout line starting with `prefix`."""
    def trigger(process, workdir):
        for line in process.stdout:
            if line.startswith(prefix):
                time.sleep(wait)
                return True
        return False
    return trigger


def after_seconds(wait: float):
    def trigger(process, workdir):
        time.sleep(wait)
        return process.poll() is None
    return trigger


# (phase, extra flags, trigger, what the process must say it was doing: else tried again)
PHASES = (
    ("importing", [], after_seconds(0.5), "while starting"),
    ("loading and building", [], after_line("loaded "), "while loading"),
    ("compiling", [], after_line("built ", 0.2), "while compiling"),
    ("training", ["--config.train.num_steps=100000"], after_line(TABLE_HEADER, 3.0), " at step "),
    # an evaluation after every step: most of the run's time, so the signal lands in one
    ("evaluating", ["--config.train.num_steps=100000", "--config.eval.every_steps=1",
                    "--config.train.log_every_steps=1"], after_line(TABLE_HEADER, 3.0),
     "while evaluating step"),
    ("writing the reports", ["--config.train.num_steps=10", "--config.eval.every_steps=10"],
     after_line("time: "), "writing the reports"),
)
TRIES = 3


def measure(recipe: list, flags: list, trigger, signum: int, data_dir: str) -> dict:
    workdir = tempfile.mkdtemp(prefix="signal_latency_")
    command = [sys.executable, "main.py", *recipe, f"--workdir={workdir}", *flags]
    if data_dir and any("cifar" in part for part in recipe):
        command.append(f"--config.data.dir={data_dir}")
    process = subprocess.Popen(command, cwd=HERE, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True,
                               env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        if not trigger(process, workdir):
            out, err = process.communicate()
            return {"error": "the process ended before the signal", "stderr": err[-500:]}
        sent = time.perf_counter()
        process.send_signal(signum)
        out, err = process.communicate(timeout=600)
        seconds = time.perf_counter() - sent
    finally:
        if process.poll() is None:
            process.kill()
        shutil.rmtree(workdir, ignore_errors=True)
    said = [line for line in err.splitlines() if line.startswith(("stopped:", "error:"))]
    return {"seconds": round(seconds, 2), "exit_status": process.returncode,
            "said": said[-1] if said else err.strip().splitlines()[-1:]}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cifar_dir", required=True)
    parser.add_argument("--json", default=os.path.join(HERE, "benchmarks", "results",
                                                       "signal_latency_cpu.json"))
    parser.add_argument("--signal", default="SIGINT", choices=("SIGINT", "SIGTERM"))
    args = parser.parse_args()
    signum = getattr(signal, args.signal)
    results = {"signal": args.signal, "command": " ".join(sys.argv), "runs": []}
    for name, recipe in RECIPES.items():
        for phase, flags, trigger, mark in PHASES:
            for _ in range(TRIES):
                found = measure(recipe, flags, trigger, signum, args.cifar_dir)
                if mark in str(found.get("said")):
                    break
            results["runs"].append({"recipe": name, "phase": phase, **found})
            print(f"{name:18} {phase:22} {found.get('seconds', '-'):>6} s  exit "
                  f"{found.get('exit_status')}  {found.get('said') or found.get('error')}",
                  flush=True)
    with open(args.json, "w") as f:
        json.dump(results, f, indent=2)
        f.write("\n")


if __name__ == "__main__":
    main()
