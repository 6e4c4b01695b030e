"""Eight runs of a recipe as a user would run them: eight main.py processes one after
another (seeds 0..7) against one main.py with train.replicas=8 (the same eight seeds in
one program). Wall time of the whole processes, training-only seconds and images/s per
replica (from each summary.json).

    python3 benchmarks/replicas.py --data_dir=DIR [--replicas=8] [--seed_steps=2000] [--json=PATH]

DIR holds cifar-10-batches-py; Fashion-MNIST comes from its usual places. CPU timings
here are noisy: compare within one run of this script. The persistent compilation cache
is warmed by one run of each recipe first, so neither side pays for compiling twice.
The seed recipe (batch 4) is cut to --seed_steps steps of its 25,000: on this CPU its
8 replicas take ~30 ms a step.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = (("seed_cnn", "configs/cifar_seed_cnn.py", True),
           ("mlp", "configs/fashion_mnist_mlp.py", False))  # (name, config, on CIFAR-10)


def main_py(config: str, workdir: str, data_dir: str | None, *extra) -> tuple[dict, float]:
    """One main.py process; (its summary.json, its wall seconds)."""
    command = [sys.executable, "main.py", f"--config={config}", f"--workdir={workdir}", *extra]
    if data_dir:
        command.append(f"--config.data.dir={data_dir}")
    start = time.perf_counter()
    subprocess.run(command, cwd=HERE, check=True, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    with open(os.path.join(workdir, "summary.json")) as f:
        return json.load(f), seconds


def measure(name: str, config: str, data_dir: str | None, replicas: int, scratch: str,
            extra=()) -> dict:
    def run(label, *args):
        return main_py(config, os.path.join(scratch, f"{name}_{label}"), data_dir, *extra,
                       *args)
    run("warm")  # fills the persistent compilation cache
    run("warm_replicas", f"--config.train.replicas={replicas}")
    singles = [run(f"seed{seed}", f"--config.seed={seed}") for seed in range(replicas)]
    together, wall = run("replicas", f"--config.train.replicas={replicas}")
    sequential_wall = sum(seconds for _, seconds in singles)
    sequential_train = sum(s["train_only_seconds"] for s, _ in singles)
    single_rate = sum(s["images_per_second"] for s, _ in singles) / replicas
    result = {
        "replicas": replicas, "overrides": list(extra), "steps": together["steps"],
        "sequential": {"wall_seconds": sequential_wall, "train_only_seconds": sequential_train,
                       "images_per_second_per_run": single_rate,
                       "test_accuracy": [s["test_accuracy"] for s, _ in singles]},
        "replicated": {"wall_seconds": wall, "train_only_seconds": together["train_only_seconds"],
                       "images_per_second_per_replica": together["images_per_second_per_replica"],
                       "test_accuracy": [r["test_accuracy"] for r in together["replicas"]],
                       "test_accuracy_mean": together["test_accuracy"],
                       "test_accuracy_std": together["test_accuracy_std"]},
        "wall_speedup": sequential_wall / wall,
        "train_throughput_ratio": sequential_train / together["train_only_seconds"],
    }
    print(f"{name}: {replicas} runs in turn {sequential_wall:.1f} s wall "
          f"({sequential_train:.1f} s training), {replicas} replicas in one program "
          f"{wall:.1f} s wall ({together['train_only_seconds']:.1f} s training): "
          f"x{result['wall_speedup']:.2f} wall, x{result['train_throughput_ratio']:.2f} "
          f"training throughput; images/s per run {single_rate:.0f} vs "
          f"{together['images_per_second_per_replica']:.0f}", flush=True)
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data_dir", required=True, help="holds cifar-10-batches-py")
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--seed_steps", type=int, default=2000,
                        help="train.num_steps of the seed recipe (0: its 25,000)")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    import jax
    results = {"device": jax.devices()[0].device_kind, "cores": os.cpu_count(), "recipes": {}}
    with tempfile.TemporaryDirectory() as scratch:
        for name, config, needs_cifar in RECIPES:
            extra = ([f"--config.train.num_steps={args.seed_steps}"]
                     if name == "seed_cnn" and args.seed_steps else [])
            results["recipes"][name] = measure(name, config, args.data_dir if needs_cifar
                                               else None, args.replicas, scratch, extra)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
