"""What each memory knob saves, from XLA's memory analysis of the compiled train step.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
        python3 benchmarks/memory.py --json=benchmarks/results/memory_cpu.json
    python3 benchmarks/memory.py --largest_batch --model=resnet50 --image_size=224 \\
        --json=FILE                      # on a GPU: benchmarks/gpu.py runs this

Table mode (default): for each model (--models; default resnet50 at 128 px and vit_base,
the largest ViT, at 128 px), batch --batch_size (64) on every device there is, five
settings: baseline; train.accumulate_steps=4; model.remat; parallel.fsdp=<devices>; all
three. Per device: the step's arguments, temporaries and peak bytes (jaxtrain/perf/memory.py),
the parameter and state bytes, and the step's time: the median of --steps timed steps
(after one untimed) of the compiled step on a real initialised state, one setting after
another (a ViT-B state on 8 devices is GBs); step times are ratios within one run.

--largest_batch: the largest batch of each of baseline, remat and accumulate 4 whose step
fits one device (memory.largest_batch: a search over compiled memory analyses, nothing
trained), within --seconds in all; --limit_gib stands in for the device's own limit where
the backend reports none (the CPU). It compiles with XLA's GPU autotuning off
(--xla_gpu_autotune_level=0), several times faster; the kernels' workspace may then
differ a little from a training run's.

The images are random uint8 of the model's size (what the bytes and times depend on).
"""
import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SETTINGS = {"baseline": {}, "accumulate4": {"accumulate_steps": 4}, "remat": {"remat": True},
            "fsdp": {"fsdp": "devices"},
            "all_three": {"accumulate_steps": 4, "remat": True, "fsdp": "devices"}}


def random_arrays(path: str, image_size: int, n_train: int, n_test: int = 16) -> str:
    rng = np.random.default_rng(0)
    shape = (image_size, image_size, 3)
    np.savez(path, x_train=rng.integers(0, 256, (n_train, *shape), np.uint8),
             y_train=rng.integers(0, 10, n_train).astype(np.int32),
             x_test=rng.integers(0, 256, (n_test, *shape), np.uint8),
             y_test=rng.integers(0, 10, n_test).astype(np.int32))
    return path


def config_for(npz: str, model: str, batch_size: int, precision: str, accumulate_steps=1,
               remat=False, fsdp=1):
    from jaxtrain.config.defaults import get_config
    config = get_config()
    config.data.name, config.data.dir = "arrays", npz
    config.model.name, config.model.remat = model, remat
    config.train.batch_size, config.train.accumulate_steps = batch_size, accumulate_steps
    config.train.precision = precision
    config.train.compilation_cache = ""
    config.optimizer.name = "adamw" if model.startswith("vit") else "sgd"
    config.optimizer.learning_rate = 1e-3 if model.startswith("vit") else 0.1
    config.parallel.fsdp = fsdp
    return config


class TimedStep:
    """The compiled step of a config on a real initialised state and one batch."""

    def __init__(self, config):
        import jax

        from jaxtrain.perf import memory
        from jaxtrain.runtime import mesh
        from jaxtrain.training import prepare
        from jaxtrain.training import placement
        # initialised, laid out
        run = prepare.setup(config, placement.create_mesh(config.parallel.fsdp))
        self.compiled, _ = memory.compile_step(config, run)
        self.state = run.state
        batch = config.train.batch_size
        sharding = mesh.batch_sharded(run.mesh)
        self.images = mesh.put(run.dataset.x_train[:batch], sharding)
        self.labels = mesh.put(run.dataset.y_train[:batch], sharding)
        self.key = jax.random.key(0)

    def __call__(self) -> float:
        import jax
        start = time.perf_counter()
        self.state, metrics = self.compiled(self.state, self.images, self.labels, self.key)
        jax.block_until_ready(metrics)
        return time.perf_counter() - start


def table(args) -> dict:
    import jax

    from jaxtrain.perf import memory
    devices = jax.device_count()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models.split(","):
            npz = random_arrays(os.path.join(tmp, f"{model}.npz"), args.image_size,
                                args.batch_size)
            infos, timings = {}, {}
            for name, setting in SETTINGS.items():  # one at a time: a ViT-B state is GBs
                setting = {k: devices if v == "devices" else v for k, v in setting.items()}
                config = config_for(npz, model, args.batch_size, args.precision, **setting)
                infos[name] = memory.step_memory(config)
                if args.steps:
                    step = TimedStep(config)
                    step()  # untimed: first-run costs
                    timings[name] = [step() for _ in range(args.steps)]
                    del step
                print(f"{model} {name}: peak {infos[name]['peak_bytes'] / 2**20:.0f} MiB, "
                      f"temporaries {infos[name]['temporaries_bytes'] / 2**20:.0f} MiB per "
                      "device", flush=True)
            results[model] = {}
            for name, info in infos.items():
                row = {key: info[key] for key in (
                    "arguments_bytes", "temporaries_bytes", "outputs_bytes", "alias_bytes",
                    "peak_bytes", "params_bytes_per_device", "state_bytes_per_device",
                    "accumulate_steps", "remat", "fsdp", "devices", "batch_size",
                    "image_shape", "precision")}
                if timings.get(name):
                    row["step_seconds"] = statistics.median(timings[name])
                    row["step_seconds_all"] = [round(t, 3) for t in timings[name]]
                results[model][name] = row
            base = results[model]["baseline"]
            print(f"\n{model} at {args.image_size} px, batch {args.batch_size}, {devices} "
                  f"devices ({args.precision}); per device:")
            print(f"{'setting':<12} {'args MiB':>9} {'temps MiB':>10} {'peak MiB':>9} "
                  f"{'params MiB':>11} {'step s':>8} {'x time':>7}")
            for name, row in results[model].items():
                seconds = row.get("step_seconds")
                ratio = seconds / base["step_seconds"] if seconds and base.get("step_seconds") \
                    else None
                print(f"{name:<12} {row['arguments_bytes'] / 2**20:>9.1f} "
                      f"{row['temporaries_bytes'] / 2**20:>10.1f} "
                      f"{row['peak_bytes'] / 2**20:>9.1f} "
                      f"{row['params_bytes_per_device'] / 2**20:>11.1f} "
                      f"{seconds or float('nan'):>8.2f} {ratio or float('nan'):>7.2f}",
                      flush=True)
    return {"mode": "table", "devices": devices, "results": results}


def largest(args) -> dict:
    import jax

    from jaxtrain.perf import memory
    limit = memory.device_limit_bytes()
    if limit is None:
        if not args.limit_gib:
            sys.exit("error: this backend reports no memory limit: pass --limit_gib")
        limit = int(args.limit_gib * 2**30)
    devices = jax.device_count()
    results = {}
    began = time.monotonic()
    variants = {"baseline": {}, "remat": {"remat": True},
                "accumulate4": {"accumulate_steps": 4}}
    with tempfile.TemporaryDirectory() as tmp:
        npz = random_arrays(os.path.join(tmp, "images.npz"), args.image_size, 64)
        for i, (name, setting) in enumerate(variants.items()):
            left = args.seconds - (time.monotonic() - began)
            share = left / (len(variants) - i)
            if share <= 0:
                break
            config = config_for(npz, args.model, args.start, args.precision, **setting)
            multiple = max(8, devices * setting.get("accumulate_steps", 1))
            results[name] = memory.largest_batch(config, limit, multiple=multiple,
                                                 start=args.start, max_probes=args.max_probes,
                                                 seconds=share)
            found = results[name]
            print(f"{args.model} at {args.image_size} px, {name}: largest batch "
                  f"{found['largest_batch']} (first failing {found['smallest_failing_batch']}"
                  f", {len(found['probes'])} compiles, {found['seconds']:.0f} s)", flush=True)
    return {"mode": "largest_batch", "model": args.model, "image_size": args.image_size,
            "precision": args.precision, "devices": devices, "limit_bytes": limit,
            "device_kind": jax.devices()[0].device_kind, "results": results}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="resnet50,vit_base")
    parser.add_argument("--model", default="resnet50", help="--largest_batch's model")
    parser.add_argument("--image_size", type=int, default=None,
                        help="default: 128 (table), 224 (--largest_batch)")
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--precision", default=None,
                        help="default: float32 on a CPU, bfloat16 elsewhere")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per setting (0: none)")
    parser.add_argument("--largest_batch", action="store_true")
    parser.add_argument("--start", type=int, default=256, help="--largest_batch: first probe")
    parser.add_argument("--max_probes", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=50.0)
    parser.add_argument("--limit_gib", type=float, default=None)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    if args.largest_batch:  # compiles only to size them: skip the GPU's kernel autotuning
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + " --xla_gpu_autotune_level=0").strip()

    import jax
    args.precision = args.precision or ("float32" if jax.default_backend() == "cpu"
                                        else "bfloat16")
    args.image_size = args.image_size or (224 if args.largest_batch else 128)
    report = largest(args) if args.largest_batch else table(args)
    report.update({"command": "python3 benchmarks/memory.py " + " ".join(sys.argv[1:]),
                   "jax": jax.__version__, "backend": jax.default_backend(),
                   "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform()}})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
