"""What starting from a trained network buys: scratch vs fine-tuned vs frozen backbone.

    python3 benchmarks/transfer.py --data_dir=D [--json=benchmarks/results/transfer_cpu.json]

D holds CIFAR-10 (cifar-10-batches-py; `python3 ../shared/data/cifar10_jpeg.py batches D`
writes it from the shared copy). A network is pretrained on classes 0-4 (all their 25,000
training images); then a run on only 1,000 training images of classes 5-9 (200 each)
trains three ways, the same recipe and number of steps each:
  scratch   - random init;
  finetune  - model.init_from the pretrained run, its head re-initialised for the new
              classes (model.init_from_exclude), every layer trained;
  frozen    - the same start with the backbone frozen (optimizer group freeze=True and
              model.freeze_batch_stats): a linear probe, only the head trains.
Each is scored on the 5,000 test images of classes 5-9, over --seeds seeds. The JSON
holds `scratch_accuracy`, `finetune_accuracy`, `frozen_accuracy` (a list over seeds each),
their means and spreads, and the recipe.

The model is the seed article's LeNet-style CNN with BatchNorm (model.name='seed_cnn'):
small enough that the 10 runs take minutes on a 2-core CPU; on a GPU, pass
--model=resnet18 for the same comparison at a size people fine-tune.
"""
import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SOURCE_CLASSES = (0, 1, 2, 3, 4)
TARGET_CLASSES = (5, 6, 7, 8, 9)
TARGET_PER_CLASS = 200  # 1,000 training images of the target classes


def split_arrays(dataset, classes, per_class=None):
    """The images of `classes` (labels renumbered 0..len-1): all, or the first
    per_class training images of each; every test image of those classes."""
    def take(x, y, limit):
        keep = np.zeros(len(y), bool)
        for c in classes:
            where = np.flatnonzero(y == c)
            keep[where[:limit] if limit else where] = True
        relabel = np.full(10, -1, np.int64)
        relabel[list(classes)] = np.arange(len(classes))
        return x[keep], relabel[y[keep]].astype(np.int32)
    x_train, y_train = take(dataset.x_train, dataset.y_train, per_class)
    x_test, y_test = take(dataset.x_test, dataset.y_test, None)
    return dict(x_train=x_train, y_train=y_train, x_test=x_test, y_test=y_test)


def recipe(npz: str, model: str, steps: int, batch_size: int, seed: int, lr: float):
    from jaxtrain.config.defaults import get_config
    config = get_config()
    config.seed = seed
    config.data.name = "arrays"
    config.data.dir = npz
    config.model.name = model
    config.model.batch_norm = True
    config.optimizer.name = "sgd"
    config.optimizer.momentum = 0.9
    config.optimizer.nesterov = True
    config.optimizer.learning_rate = lr
    config.optimizer.weight_decay = 5e-4
    config.optimizer.schedule = "warmup_cosine"
    config.optimizer.warmup_fraction = 0.1
    config.augment.flip = True
    config.augment.translate = 2
    config.train.batch_size = batch_size
    config.train.num_steps = steps
    config.train.precision = "float32"
    config.eval.every_epochs = 0
    config.eval.batch_size = 1000
    config.checkpoint.every_epochs = 0
    return config


HEADS = {"seed_cnn": "Dense_2", "resnet18": "Dense_0"}  # the layer a new class count re-initialises


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data_dir", required=True)
    parser.add_argument("--json", default="benchmarks/results/transfer_cpu.json")
    parser.add_argument("--model", default="seed_cnn", choices=("seed_cnn", "resnet18"))
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--pretrain_epochs", type=int, default=10)
    parser.add_argument("--steps", type=int, default=300, help="steps of each target run")
    parser.add_argument("--batch_size", type=int, default=100)
    parser.add_argument("--workdir", default="")
    args = parser.parse_args()

    import jax

    from jaxtrain import data
    from jaxtrain.run import loop
    started = time.time()
    cifar = data.load("cifar10", "files", args.data_dir)
    work = args.workdir or tempfile.mkdtemp(prefix="transfer_")
    os.makedirs(work, exist_ok=True)
    source_npz, target_npz = os.path.join(work, "source.npz"), os.path.join(work, "target.npz")
    np.savez(source_npz, **split_arrays(cifar, SOURCE_CLASSES))
    target = split_arrays(cifar, TARGET_CLASSES, TARGET_PER_CLASS)
    np.savez(target_npz, **target)

    pretrain_dir = os.path.join(work, "pretrain")
    shutil.rmtree(pretrain_dir, ignore_errors=True)
    pretrain_steps = args.pretrain_epochs * (25_000 // 256)
    source = loop.train_and_evaluate(recipe(source_npz, args.model, pretrain_steps, 256, 0, 0.1),
                                     pretrain_dir)
    print(f"pretrained on classes {SOURCE_CLASSES}: test accuracy {source['test_accuracy']:.4f}",
          flush=True)

    results = {"scratch": [], "finetune": [], "frozen": []}
    seconds = {way: [] for way in results}
    for seed in range(args.seeds):
        for way in results:
            config = recipe(target_npz, args.model, args.steps, args.batch_size, seed, 0.05)
            if way != "scratch":  # the pretrained run's head knows the old classes: a new one
                config.model.init_from = pretrain_dir
                config.model.init_from_exclude = f"{HEADS[args.model]}/.*"
            if way == "frozen":
                from jaxtrain.config.defaults import param_group
                config.optimizer.groups.backbone = param_group(f"(?!{HEADS[args.model]}/).*",
                                                               freeze=True)
                config.model.freeze_batch_stats = True
            workdir = os.path.join(work, f"{way}_{seed}")
            shutil.rmtree(workdir, ignore_errors=True)
            summary = loop.train_and_evaluate(config, workdir)
            results[way].append(summary["test_accuracy"])
            seconds[way].append(summary["train_seconds"])
            print(f"seed {seed} {way}: test accuracy {summary['test_accuracy']:.4f}", flush=True)

    output = {
        "command": "python3 benchmarks/transfer.py " + " ".join(sys.argv[1:]),
        "model": args.model, "source_classes": SOURCE_CLASSES, "target_classes": TARGET_CLASSES,
        "source_train_images": int(len(np.load(source_npz)["y_train"])),
        "source_test_accuracy": source["test_accuracy"], "pretrain_steps": pretrain_steps,
        "target_train_images": int(len(target["y_train"])),
        "target_test_images": int(len(target["y_test"])),
        "steps": args.steps, "batch_size": args.batch_size, "seeds": list(range(args.seeds)),
        **{f"{way}_accuracy": values for way, values in results.items()},
        **{f"{way}_accuracy_mean": float(np.mean(v)) for way, v in results.items()},
        **{f"{way}_accuracy_std": float(np.std(v)) for way, v in results.items()},
        **{f"{way}_train_seconds": v for way, v in seconds.items()},
        "device": jax.devices()[0].device_kind, "jax_version": jax.__version__,
        "machine": platform.machine(), "cpu_count": os.cpu_count(),
        "total_seconds": time.time() - started,
        "date": time.strftime("%Y-%m-%d"),
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(output, f, indent=1)
    for way in results:
        print(f"{way:9s} {output[f'{way}_accuracy_mean']:.4f} +- "
              f"{output[f'{way}_accuracy_std']:.4f}  {results[way]}")
    print(f"-> {args.json}")


if __name__ == "__main__":
    main()
