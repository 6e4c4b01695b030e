"""How soon a run starts and how soon a trained model answers: whole process, time to the
first console line and to the first training step, and jaxtrain.restore + a first predict.

    python3 benchmarks/quick_start.py --data_dir=DIR [--repo=CHECKOUT] [--json=PATH]

DIR holds cifar-10-batches-py. Each figure is one fresh process, run twice: first with an
empty HOME (so an empty ~/.cache/jaxtrain), then again (the same HOME, so a checkout
with a persistent compilation cache there starts warm). --repo measures another checkout
with the same commands (a `git worktree` of an older commit gives the "before" figures).
CPU timings here are noisy: compare within one run of this script.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = (("seed_cnn_20_steps", "configs/cifar_seed_cnn.py", "cifar10"),
        ("mlp_20_steps", "configs/fashion_mnist_mlp.py", "fashion_mnist"))
# The header line the loop prints just before its first step, in every version so far.
FIRST_STEP_MARK = "model="

RESTORE = """
import sys, time
start = time.perf_counter()
import numpy as np
import jaxtrain
classifier = jaxtrain.restore(sys.argv[1])
restored = time.perf_counter() - start
images = np.zeros((8, *classifier.image_shape), np.uint8)
labels, _ = classifier.predict(images)
print(f"{restored} {time.perf_counter() - start}")
"""


def timed_lines(command, cwd, env):
    """Runs command; (exit status, seconds, [(seconds, stdout line)])."""
    start = time.perf_counter()
    process = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, bufsize=1)
    lines = [(time.perf_counter() - start, line.rstrip("\n")) for line in process.stdout]
    err = process.stderr.read()
    process.wait()
    seconds = time.perf_counter() - start
    if process.returncode:
        raise SystemExit(f"error: {' '.join(command)} exited {process.returncode}:\n{err[-2000:]}")
    return seconds, lines


def measure(repo: str, data_dir: str, home: str) -> dict:
    env = dict(os.environ, HOME=home, PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="")
    results = {}
    for name, config, dataset in RUNS:
        workdir = tempfile.mkdtemp(prefix=f"{name}-", dir=home)
        data = ([f"--config.data.dir={data_dir}", "--config.data.source=files"]
                if dataset == "cifar10" else [])
        seconds, lines = timed_lines(
            [sys.executable, "main.py", f"--config={config}", f"--workdir={workdir}",
             "--config.train.num_steps=20", *data], repo, env)
        first_step = next((t for t, line in lines if line.startswith(FIRST_STEP_MARK)), None)
        with open(os.path.join(workdir, "summary.json")) as f:
            summary = json.load(f)
        restore = subprocess.run([sys.executable, "-c", RESTORE, workdir], cwd=repo, env=env,
                                 capture_output=True, text=True)
        if restore.returncode:
            raise SystemExit(f"error: restore failed:\n{restore.stderr[-2000:]}")
        restored, predicted = map(float, restore.stdout.split()[-2:])
        results[name] = {
            "process_seconds": round(seconds, 2),
            "first_line_seconds": round(lines[0][0], 2) if lines else None,
            "first_step_seconds": round(first_step, 2) if first_step is not None else None,
            "summary_total_seconds": round(summary.get("total_seconds", float("nan")), 2),
            "summary_parts": summary.get("phase_seconds"),
            "restore_seconds": round(restored, 2),
            "restore_and_predict_8_seconds": round(predicted, 2)}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data_dir", required=True)
    parser.add_argument("--repo", default=HERE)
    parser.add_argument("--json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="quick-start-") as home:
        report = {"repo": os.path.abspath(args.repo),
                  "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=args.repo,
                                           capture_output=True, text=True).stdout.strip(),
                  "cold_cache": measure(args.repo, os.path.abspath(args.data_dir), home),
                  "warm_cache": measure(args.repo, os.path.abspath(args.data_dir), home)}
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
