"""What an EMA, the best checkpoint and MLflow add to a run's evaluations (issue #42 item 8
reported 23.7 s against 3.9 s): the fine-tuning recipe with ResNet-18 at 64 px in float32,
from scratch, two epochs of 512 CIFAR-10 images with an evaluation of 256 after each,
run plain, with each of the three, and with all three.

    python3 benchmarks/evaluation_cost.py --data_dir=DIR [--json=PATH]

DIR holds cifar-10-batches-py (python3 ../shared/data/cifar10_jpeg.py batches DIR); the
images are taken at 64 px (each pixel 2 x 2). Every run compiles its own programs
(train.compilation_cache=''), so that a run is not cheaper for coming after another
one that filled the cache. Printed per setting: the run's phases (summary.json's
phase_seconds) and the evaluations' seconds. CPU timings here are noisy: compare within
one run of this script.
"""
import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from configs import finetune
from jaxtrain import data
from jaxtrain.run import loop


def settings(scratch: str) -> dict:
    return {"plain": {},
            "ema": {"train.ema_decay": 0.99},
            "best checkpoint": {"checkpoint.best_metric": "test_accuracy"},
            "mlflow": {"logging.mlflow": f"sqlite:///{scratch}/mlflow1.db"},
            "all three": {"train.ema_decay": 0.99, "checkpoint.best_metric": "test_accuracy",
                          "logging.mlflow": f"sqlite:///{scratch}/mlflow2.db"}}


def arrays_64px(data_dir: str, path: str) -> None:
    """512 training and 256 test images of data_dir's CIFAR-10, at 64 px."""
    dataset = data.load("cifar10", "files", data_dir)

    def up(images):
        return np.repeat(np.repeat(images, 2, axis=1), 2, axis=2)
    np.savez(path, x_train=up(dataset.x_train[:512]), y_train=dataset.y_train[:512],
             x_test=up(dataset.x_test[:256]), y_test=dataset.y_test[:256],
             class_names=np.array(dataset.class_names))


def config_for(npz: str, overrides: dict):
    config = finetune.get_config()
    config.data.name, config.data.dir, config.data.image_size = "arrays", npz, 64
    config.model.name, config.model.init_from = "resnet18", ""
    config.train.precision = "float32"  # bfloat16 convolutions are ~20x slower on a CPU
    config.train.batch_size, config.train.num_epochs = 16, 2
    config.train.compilation_cache = ""
    config.eval.batch_size = 64
    config.update_from_flattened_dict(overrides)
    return config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data_dir", required=True)
    parser.add_argument("--json")
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as scratch:
        npz = os.path.join(scratch, "cifar64.npz")
        arrays_64px(args.data_dir, npz)
        for name, overrides in settings(scratch).items():
            began = time.perf_counter()
            summary = loop.train_and_evaluate(config_for(npz, overrides),
                                              os.path.join(scratch, name.replace(" ", "_")))
            phases = {key: round(value, 2) for key, value in summary["phase_seconds"].items()
                      if value >= 0.05}
            results[name] = {"wall_seconds": round(time.perf_counter() - began, 2),
                             "eval_seconds": round(summary["eval_seconds"], 2),
                             "phase_seconds": phases}
            print(f"{name}: {results[name]['wall_seconds']} s in all, evaluations "
                  f"{results[name]['eval_seconds']} s; phases {phases}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"recipe": "configs/finetune.py, resnet18 at 64 px, float32, 2 epochs "
                       "of 512 images, 256 evaluated after each", "settings": results}, f,
                      indent=1)


if __name__ == "__main__":
    main()
