"""What passing the optimiser and the loss from Python costs: configs/fashion_mnist_mlp.py,
its 10 epochs, trained by the built-in Adam and softmax cross-entropy and by
`optimizer=lambda learning_rate: optax.adam(learning_rate)` with `loss=` the per-example
cross-entropy (jaxtrain.train_and_evaluate), in alternating rounds, each in a fresh workdir.

    python3 benchmarks/own_parts.py --rounds=3 --json=benchmarks/results/own_parts_cpu.json

Prints and records each round's test loss and training seconds (evaluation excluded);
the test losses should agree to 1e-6 and the medians within the noise. Timings on a
shared CPU are noisy: read the ratio within one run.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile

import optax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import jaxtrain  # noqa: E402
from jaxtrain.perf import machine  # noqa: E402


def per_example_xent(logits, targets):
    return optax.softmax_cross_entropy(logits, targets)


VARIANTS = {
    "built_in": {},
    "passed": {"optimizer": lambda learning_rate: optax.adam(learning_rate),
               "loss": per_example_xent},
}


def run(name: str, root: str) -> dict:
    config = jaxtrain.config.load("fashion_mnist_mlp")
    config.train.compilation_cache = ""  # each variant compiles as a first run does
    summary = jaxtrain.train_and_evaluate(config, os.path.join(root, name), **VARIANTS[name])
    return {"test_loss": summary["test_loss"], "test_accuracy": summary["test_accuracy"],
            "train_seconds": summary["train_only_seconds"],
            "compile_seconds": summary["compile_seconds"]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default="", help="write the results here")
    args = parser.parse_args()
    import jax
    rounds = {name: [] for name in VARIANTS}
    for _ in range(args.rounds):
        for name in VARIANTS:
            with tempfile.TemporaryDirectory() as root:
                rounds[name].append(run(name, root))
    median = {name: statistics.median(r["train_seconds"] for r in runs)
              for name, runs in rounds.items()}
    result = {"what": "configs/fashion_mnist_mlp.py: the built-in Adam and cross-entropy "
                      "against the same passed from Python",
              "command": "python3 benchmarks/own_parts.py " + " ".join(sys.argv[1:]),
              "machine": {"cpu_count": os.cpu_count(), **machine.describe_cpu(),
                          "jax": jax.__version__},
              "rounds": rounds, "median_train_seconds": median,
              "passed_over_built_in": median["passed"] / median["built_in"],
              "largest_test_loss_difference": max(
                  abs(a["test_loss"] - b["test_loss"])
                  for a, b in zip(rounds["built_in"], rounds["passed"]))}
    print(json.dumps({key: result[key] for key in ("median_train_seconds",
                                                     "passed_over_built_in",
                                                     "largest_test_loss_difference")}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"-> {args.json}")


if __name__ == "__main__":
    main()
