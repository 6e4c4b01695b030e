"""A CPU stand-in for airbench94_muon.py (github.com/KellerJordan/cifar10-airbench), which
needs CUDA: what benchmarks/gpu.py's airbench item runs under --dry and in CI.

It reads what airbench reads, cifar10/train.pt and test.pt in the working folder, as
airbench's loader does (uint8 images N x 32 x 32 x 3, int64 labels, the class names;
a wrong layout fails here), and prints what airbench prints, in its format: a table
row per epoch (with the run's seconds so far) and one at each run's end ('eval', with
the TTA accuracy and the run's seconds), the untimed 'warmup' run first, then runs 0,
1, ... up to 200, then
`Mean: A    Std: S`. It trains nothing: its accuracy is a nearest-class-mean
classifier's on the test images (above chance only when images and labels line up),
its seconds a short sleep. AIRBENCH_STANDIN_RUNS and AIRBENCH_STANDIN_EPOCH_SECONDS
shorten it for tests.
"""
import os
import statistics
import time

import torch

RUNS = int(os.environ.get("AIRBENCH_STANDIN_RUNS", "200"))
EPOCH_SECONDS = float(os.environ.get("AIRBENCH_STANDIN_EPOCH_SECONDS", "0.02"))
EPOCHS = 8
COLUMNS = ["run   ", "epoch", "train_acc", "val_acc", "tta_val_acc", "time_seconds"]


def load(split: str) -> tuple:
    data = torch.load(os.path.join("cifar10", f"{split}.pt"), map_location="cpu")
    images, labels, classes = data["images"], data["labels"], data["classes"]
    assert images.dtype == torch.uint8 and images.shape[1:] == (32, 32, 3), images.shape
    assert labels.dtype == torch.int64 and labels.shape == images.shape[:1], labels.shape
    assert len(classes) == 10 and all(isinstance(name, str) for name in classes), classes
    return images.float().permute(0, 3, 1, 2) / 255, labels  # as airbench: N, C, H, W


def nearest_class_mean_accuracy(train, test) -> float:
    (x_train, y_train), (x_test, y_test) = train, test
    means = torch.stack([x_train[y_train == c].mean(0) for c in range(10)]).flatten(1)
    predicted = torch.cdist(x_test.flatten(1), means).argmin(1)
    return (predicted == y_test).float().mean().item()


def row(values: dict | None, rule_before: bool = False, rule_after: bool = False) -> None:
    """One table row: each value right-aligned to its column's title, floats to 4 places;
    None: the titles."""
    cells = []
    for column in COLUMNS:
        value = column if values is None else values.get(column.strip())
        text = f"{value:0.4f}" if isinstance(value, float) else "" if value is None else str(value)
        cells.append(text.rjust(len(column)))
    line = "".join(f"|  {cell}  " for cell in cells) + "|"
    if rule_before:
        print("-" * len(line))
    print(line)
    if rule_after:
        print("-" * len(line))


def run(name, accuracy: float) -> float:
    start = time.perf_counter()
    for epoch in range(EPOCHS):
        time.sleep(EPOCH_SECONDS)
        row({"run": name if epoch == 0 else None, "epoch": epoch, "train_acc": accuracy,
             "val_acc": accuracy, "time_seconds": time.perf_counter() - start})
    seconds = time.perf_counter() - start
    row({"epoch": "eval", "train_acc": accuracy, "val_acc": accuracy, "tta_val_acc": accuracy,
         "time_seconds": seconds}, rule_after=True)
    return accuracy


def main() -> None:
    accuracy = nearest_class_mean_accuracy(load("train"), load("test"))
    row(None, rule_before=True, rule_after=True)
    run("warmup", accuracy)
    accuracies = [run(index, accuracy) for index in range(RUNS)]
    print(f"Mean: {statistics.fmean(accuracies):.4f}    Std: {statistics.pstdev(accuracies):.4f}")


if __name__ == "__main__":
    main()
