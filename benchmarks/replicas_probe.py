"""Issue #18's premise, probed at the chunk level: N runs trained together by jax.vmap
(chunks.compile_chunks(replicas=True)) against the same N runs one after another.

    python3 benchmarks/replicas_probe.py --data_dir=DIR [--replicas=8] [--json=PATH]

DIR holds cifar-10-batches-py. For configs/cifar_seed_cnn.py (one compiled call per step
on the CPU) and configs/fashion_mnist_mlp.py (scanned), one chunk of STEPS steps is
compiled for one run and for N runs, timed (best of 2 after a warm-up), and N x the
single run's time is set against the vmapped chunk's. All replicas start from the same
state here: only the arithmetic and the dispatch are being measured.
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from configs import cifar_seed_cnn, fashion_mnist_mlp  # noqa: E402
from jaxtrain import models
from jaxtrain.training import chunks, placement, prepare  # noqa: E402

RECIPES = (("seed_cnn", cifar_seed_cnn, 500), ("mlp", fashion_mnist_mlp, 468))


def best_seconds(run_chunk, state, key, steps: int) -> float:
    def once():
        start = time.perf_counter()
        jax.block_until_ready(run_chunk(jax.tree.map(jnp.copy, state), key, 0, 0, steps))
        return time.perf_counter() - start
    once()
    return min(once() for _ in range(2))


def probe(module, steps: int, replicas: int, data_dir: str) -> dict:
    config = module.get_config()
    if config.data.name == "cifar10":
        config.data.dir, config.data.source = data_dir, "files"
    run = prepare.setup(config)
    kind = chunks.resolve_loop("auto", models.xla_convolutions(config.model))
    spec = prepare.step_spec(config, run)
    x_train, y_train = placement.put_train_data(run)
    together = jax.tree.map(lambda leaf: jnp.stack([leaf] * replicas), run.state)
    keys = jnp.stack([run.data_key] * replicas)
    single = chunks.compile_chunks(kind, run.state, x_train, y_train, run.data_key, {steps},
                                   spec)
    many = chunks.compile_chunks(kind, together, x_train, y_train, keys, {steps}, spec,
                                 replicas=True)
    one = best_seconds(single, run.state, run.data_key, steps)
    vmapped = best_seconds(many, together, keys, steps)
    return {"loop": kind, "steps": steps, "replicas": replicas,
            "single_run_ms_per_step": one / steps * 1e3,
            "sequential_seconds": replicas * one, "vmapped_seconds": vmapped,
            "speedup": replicas * one / vmapped}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data_dir", required=True)
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--json")
    args = parser.parse_args()
    report = {"backend": jax.default_backend(), "device": jax.devices()[0].device_kind}
    for name, module, steps in RECIPES:
        report[name] = probe(module, steps, args.replicas, os.path.abspath(args.data_dir))
        entry = report[name]
        print(f"{name} ({entry['loop']} loop): one run {entry['single_run_ms_per_step']:.2f} ms "
              f"a step; {args.replicas} one after another {entry['sequential_seconds']:.2f} s, "
              f"vmapped {entry['vmapped_seconds']:.2f} s: x{entry['speedup']:.2f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
