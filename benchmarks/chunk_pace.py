"""What cutting scanned chunks by time costs on the CPU: train.chunk_seconds=2 (the
default: calls of about 2 s, one while-loop program for every length) against 0 (every
chunk one lax.scan call, a program per chunk length), recipe by recipe.

    python3 benchmarks/chunk_pace.py --cifar_dir=DIR [--repeats=3] [--json=PATH]

DIR holds cifar-10-batches-py. Each figure is one `python main.py` process; the two
settings alternate, `repeats` times each, and the script reports summary.json's
train_only_seconds (training alone: compilation and evaluation excluded), its
compile_seconds, and whether the two settings ended with the same weights
(params_sha256). CPU timings are noisy: compare the medians within one run.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = {
    "fashion_mnist_cnn_300_steps": ["--config=configs/fashion_mnist_cnn.py",
                                    "--config.train.num_steps=300"],
    "fashion_mnist_mlp_2_epochs": ["--config=configs/fashion_mnist_mlp.py",
                                   "--config.train.num_epochs=2"],
    "cifar_seed_cnn_6000_steps": ["--config=configs/cifar_seed_cnn.py",
                                  "--config.data.source=files", "--config.train.num_steps=6000"],
}
SETTINGS = {"paced (chunk_seconds=2)": "2.0", "whole chunks (chunk_seconds=0)": "0"}


def run(recipe: list, chunk_seconds: str, data_dir: str) -> dict:
    workdir = tempfile.mkdtemp(prefix="chunk_pace_")
    try:
        command = [sys.executable, "main.py", *recipe, f"--workdir={workdir}",
                   f"--config.train.chunk_seconds={chunk_seconds}"]
        if any("cifar" in part for part in recipe):
            command.append(f"--config.data.dir={data_dir}")
        done = subprocess.run(command, cwd=HERE, capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(done.stderr[-2000:])
        with open(os.path.join(workdir, "summary.json")) as f:
            summary = json.load(f)
        return {key: summary[key] for key in ("train_only_seconds", "compile_seconds",
                                              "params_sha256")}
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cifar_dir", required=True)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=os.path.join(HERE, "benchmarks", "results",
                                                       "chunk_pace_cpu.json"))
    args = parser.parse_args()
    results = {"command": " ".join(sys.argv), "recipes": {}}
    for name, recipe in RECIPES.items():
        runs = {setting: [] for setting in SETTINGS}
        for _ in range(args.repeats):
            for setting, seconds in SETTINGS.items():
                runs[setting].append(run(recipe, seconds, args.cifar_dir))
        hashes = {one["params_sha256"] for found in runs.values() for one in found}
        entry = {setting: {"train_only_seconds": [round(r["train_only_seconds"], 2)
                                                  for r in found],
                           "median_train_only_seconds": round(statistics.median(
                               r["train_only_seconds"] for r in found), 2),
                           "median_compile_seconds": round(statistics.median(
                               r["compile_seconds"] for r in found), 2)}
                 for setting, found in runs.items()}
        entry["same_weights"] = len(hashes) == 1
        results["recipes"][name] = entry
        paced, whole = (entry[s]["median_train_only_seconds"] for s in SETTINGS)
        print(f"{name:30} paced {paced:7.2f} s  whole {whole:7.2f} s  ratio "
              f"{paced / whole:.3f}  same weights: {entry['same_weights']}", flush=True)
    with open(args.json, "w") as f:
        json.dump(results, f, indent=2)
        f.write("\n")


if __name__ == "__main__":
    main()
