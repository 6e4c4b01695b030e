"""jaxtrain against PyTorch on this CPU: three recipes end to end, two models' steps.

    python3 ../shared/data/cifar10_jpeg.py batches /tmp/cifar   # once: CIFAR-10 for the seed recipe
    python3 benchmarks/cpu_speed.py --cifar_dir=/tmp/cifar --json=benchmarks/results/cpu_speed.json

Recipes, through jaxtrain.compare (the numbers a user of `python -m jaxtrain.compare` gets),
--rounds (3) alternating rounds of all of them, the median training seconds of each
framework (compare's train_seconds less its eval_seconds: evaluation is timed apart):
- configs/fashion_mnist_mlp.py, its 10 epochs: jax, torch_fast;
- configs/cifar_seed_cnn.py, 6,000 steps (LeNet, batch 4): jax, torch_fast, torch_article,
  and jax with model.conv_impl='xla';
- configs/fashion_mnist_cnn.py, 300 steps (cifar_cnn 16/32/64, batch 256): jax, torch_fast,
  jax with model.conv_impl='xla' (what the recipe cost before model.conv_impl) and with
  both model.pool_impl and model.conv_impl 'xla' (before model.pool_impl too).

Steps (--steps, after the recipes): one forward and backward pass of a training batch,
float32, BatchNorm in training mode, the median of 5 after one untimed: cifar_cnn
(64, 256, 256) on batch 256 at 32 px and resnet18 (CIFAR stem) on batch 32 at 64 px, in
jaxtrain (as configured, 'auto'; with model.conv_impl='xla'; with both it and
model.pool_impl 'xla') and in its PyTorch twin (NCHW and channels_last). Timings on a shared CPU are noisy: read ratios within one run.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from jaxtrain.perf import machine  # noqa: E402

RECIPES = {
    "fashion_mnist_mlp": ("configs/fashion_mnist_mlp.py", {}, ("jax", "torch_fast")),
    "cifar_seed_cnn": ("configs/cifar_seed_cnn.py", {"train.num_steps": 6000},
                       ("jax", "torch_fast", "torch_article", "jax_conv_xla")),
    "fashion_mnist_cnn": ("configs/fashion_mnist_cnn.py", {"train.num_steps": 300},
                          ("jax", "torch_fast", "jax_conv_xla", "jax_pool_xla")),
}
# jaxtrain as it was before an option: the config keys that undo it
VARIANTS = {"jax_conv_xla": {"model.conv_impl": "xla"},
            "jax_pool_xla": {"model.conv_impl": "xla", "model.pool_impl": "xla"}}


def load_config(path: str, overrides: dict, cifar_dir: str):
    import importlib.util
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location("recipe", os.path.join(repo, path))
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, repo)
    spec.loader.exec_module(module)
    config = module.get_config()
    if config.data.name == "cifar10":
        config.data.dir, config.data.source = cifar_dir, "files"
    for key, value in overrides.items():
        block, name = key.split(".")
        setattr(config[block], name, value)
    return config


def run_recipe(name: str, cifar_dir: str, workdir: str) -> dict:
    """One round of one recipe: {framework: (training seconds, test accuracy)}."""
    from jaxtrain.baselines import runner
    path, overrides, frameworks = RECIPES[name]
    seconds = {}
    torch_side = [f for f in frameworks if f.startswith("torch")]
    output = runner.run(load_config(path, overrides, cifar_dir), ["jax", *torch_side],
                        os.path.join(workdir, name))
    for result in output["results"]:
        seconds[result["framework"]] = (result["train_seconds"] - result["eval_seconds"],
                                        result["test_accuracy"])
    for variant in (f for f in frameworks if f in VARIANTS):
        config = load_config(path, {**overrides, **VARIANTS[variant]}, cifar_dir)
        output = runner.run(config, ["jax"], os.path.join(workdir, f"{name}_{variant}"))
        result = output["results"][0]
        seconds[variant] = (result["train_seconds"] - result["eval_seconds"],
                            result["test_accuracy"])
    return seconds


def recipes(args) -> dict:
    rounds = {name: [] for name in args.recipes}
    with tempfile.TemporaryDirectory() as workdir:
        for round_index in range(args.rounds):
            for name in args.recipes:
                print(f"=== round {round_index + 1} of {args.rounds}: {name}", flush=True)
                rounds[name].append(run_recipe(name, args.cifar_dir, workdir))
    table = {}
    for name, results in rounds.items():
        entry = {"config": RECIPES[name][0], "overrides": RECIPES[name][1],
                 "rounds": results}
        for framework in RECIPES[name][2]:
            entry[f"{framework}_seconds"] = statistics.median(r[framework][0] for r in results)
            entry[f"{framework}_test_accuracy"] = statistics.median(
                r[framework][1] for r in results)
        entry["jax_vs_torch_fast"] = entry["torch_fast_seconds"] / entry["jax_seconds"]
        table[name] = entry
        print(f"{name}: jax {entry['jax_seconds']:.2f} s, torch_fast "
              f"{entry['torch_fast_seconds']:.2f} s: "
              + (f"jaxtrain {entry['jax_vs_torch_fast']:.2f}x ahead"
                 if entry["jax_vs_torch_fast"] >= 1
                 else f"jaxtrain {1 / entry['jax_vs_torch_fast']:.2f}x behind"), flush=True)
    return table


# ---------------------------------------------------------------- one step, both frameworks

STEP_MODELS = {"cifar_cnn": dict(widths=(64, 256, 256), stem_width=24, batch=256, size=32),
               "resnet18": dict(stem="cifar", batch=32, size=64)}


def median_seconds(run, repeats: int = 5) -> float:
    run()  # untimed: first-run costs
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def jax_step_seconds(name: str, pool_impl: str, conv_impl: str) -> float:
    import jax
    import jax.numpy as jnp

    from jaxtrain import models
    from jaxtrain.config import defaults
    shape = STEP_MODELS[name]
    config = defaults.get_config().model
    config.name, config.pool_impl, config.conv_impl = name, pool_impl, conv_impl
    for key in ("widths", "stem_width", "stem"):
        if key in shape:
            setattr(config, key, shape[key])
    model = models.create_model(config, 10, jnp.float32)
    images = jax.random.normal(jax.random.key(0), (shape["batch"], shape["size"], shape["size"], 3))
    labels = jnp.arange(shape["batch"]) % 10
    variables = model.init(jax.random.key(1), images)

    def loss(params):
        logits, updates = model.apply({**variables, "params": params}, images, train=True,
                                      mutable=["batch_stats"])
        log_probs = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(log_probs, labels[:, None], 1)), updates

    step = jax.jit(jax.grad(loss, has_aux=True)).lower(variables["params"]).compile()
    return median_seconds(lambda: jax.block_until_ready(step(variables["params"])))


def torch_step_seconds(name: str, channels_last: bool) -> float:
    import torch

    from jaxtrain.baselines import torch_models
    from jaxtrain.config import defaults
    shape = STEP_MODELS[name]
    config = defaults.get_config().model
    config.name = name
    for key in ("widths", "stem_width", "stem"):
        if key in shape:
            setattr(config, key, shape[key])
    image_shape = (shape["size"], shape["size"], 3)
    model = torch_models.create_model(config, 10, image_shape).train()
    images = torch.randn(shape["batch"], 3, shape["size"], shape["size"])
    labels = torch.arange(shape["batch"]) % 10
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
        images = images.contiguous(memory_format=torch.channels_last)

    def step():
        model.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(images), labels).backward()

    return median_seconds(step)


def steps() -> dict:
    table = {}
    for name in STEP_MODELS:
        row = {**STEP_MODELS[name],
               "jax_seconds": jax_step_seconds(name, "auto", "auto"),
               "jax_conv_xla_seconds": jax_step_seconds(name, "auto", "xla"),
               "jax_pool_xla_seconds": jax_step_seconds(name, "xla", "xla"),
               "torch_seconds": torch_step_seconds(name, channels_last=False),
               "torch_channels_last_seconds": torch_step_seconds(name, channels_last=True)}
        table[name] = row
        print(f"{name} forward+backward: jaxtrain {row['jax_seconds']:.3f} s (conv_impl='xla': "
              f"{row['jax_conv_xla_seconds']:.3f} s; and pool_impl='xla': "
              f"{row['jax_pool_xla_seconds']:.3f} s), PyTorch {row['torch_seconds']:.3f} s "
              f"(channels_last {row['torch_channels_last_seconds']:.3f} s)", flush=True)
    return table


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cifar_dir", default=os.environ.get("JAXTRAIN_DATA_DIR", ""),
                        help="a folder holding cifar-10-batches-py (the seed recipe)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--recipes", default=",".join(RECIPES),
                        help="comma-separated, from: " + ", ".join(RECIPES) + " ('' for none)")
    parser.add_argument("--no_steps", action="store_true", help="skip the one-step figures")
    parser.add_argument("--json", default="", help="write the results here")
    args = parser.parse_args()
    args.recipes = [name for name in args.recipes.split(",") if name]
    unknown = [name for name in args.recipes if name not in RECIPES]
    if unknown:
        parser.error(f"--recipes: unknown {', '.join(unknown)}; choose from {', '.join(RECIPES)}")
    if "cifar_seed_cnn" in args.recipes and not args.cifar_dir:
        parser.error("the seed recipe needs CIFAR-10: --cifar_dir=D, where `python3 "
                     "../shared/data/cifar10_jpeg.py batches D` wrote cifar-10-batches-py")
    import jax
    import torch
    result = {"what": "training seconds (evaluation excluded) and one forward+backward pass, "
                      "jaxtrain against PyTorch on the CPU",
              "command": "python3 benchmarks/cpu_speed.py " + " ".join(sys.argv[1:]),
              "machine": {"cpu_count": os.cpu_count(), **machine.describe_cpu(),
                          "jax": jax.__version__, "torch": torch.__version__},
              "rounds": args.rounds,
              "recipes": recipes(args) if args.recipes else {},
              "steps": {} if args.no_steps else steps()}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"-> {args.json}")


if __name__ == "__main__":
    main()
