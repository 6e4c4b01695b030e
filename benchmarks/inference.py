"""Inference speed of a trained run four ways, on this machine's CPU:

    python3 benchmarks/inference.py --data_dir=D [--json=benchmarks/results/inference_cpu.json]

D holds CIFAR-10 (cifar-10-batches-py; `python3 ../shared/data/cifar10_jpeg.py batches D`
writes it from the shared copy). For each model (--models, default cifar_cnn and resnet18)
a 2-step run trains on real CIFAR-10 images scaled to 64 px (each pixel repeated 2 x 2);
its checkpoint is then served by
  predict     - jaxtrain.restore(workdir).predict (jit-compiled, normalisation inside);
  stablehlo   - its `python -m jaxtrain.export --format=stablehlo` file, deserialised with
                jax.export and called under jax.jit;
  onnxruntime - its `--format=onnx` file in an onnxruntime CPU session;
  torch_eager - the PyTorch twin (jaxtrain.torch_models) with the run's weights copied in,
                eval mode under torch.inference_mode, normalisation in torch.
Every way takes uint8 NHWC numpy images and returns float32 probabilities as numpy, so
each timing includes the input's conversion and the output's copy back. Measured:
batch-1 latency (median over --latency_calls calls) and batch-256 throughput (images/s
of one call); each is the median over --rounds rounds, the four ways interleaved round
by round so that the machine's drift falls on all of them alike. The JSON also gives the
largest probability difference of each way from `predict` on the 256 images.
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

WAYS = ("predict", "stablehlo", "onnxruntime", "torch_eager")
BATCH = 256
IMAGE_SIZE = 64


def images_64px(data_dir: str, n: int):
    """The first n training and test images of CIFAR-10, 64 x 64 (pixels doubled)."""
    from jaxtrain import data
    dataset = data.load("cifar10", "files", data_dir)
    def up(x):
        return np.repeat(np.repeat(x[:n], 2, axis=1), 2, axis=2)
    return dataset, up(dataset.x_train), dataset.y_train[:n], up(dataset.x_test)


def short_run(npz: str, model: str, workdir: str):
    from jaxtrain.config.defaults import get_config
    from jaxtrain.run import loop
    config = get_config()
    config.data.name, config.data.dir = "arrays", npz
    config.model.name = model
    config.train.precision = "float32"
    config.train.batch_size, config.train.num_steps = 16, 2
    config.eval.batch_size = BATCH  # predict's own batches: one call of 256 is one batch
    loop.train_and_evaluate(config, workdir)
    return config


def servers(workdir: str, config, files: str):
    """way -> function(uint8 images) -> float32 probabilities, all from one checkpoint."""
    import jax
    import onnxruntime
    import torch

    import jaxtrain
    from jaxtrain.baselines import torch_models
    from jaxtrain.inference import exporters

    classifier = jaxtrain.restore(workdir)
    ways = {"predict": lambda images: classifier.predict(images)[1]}

    stablehlo = os.path.join(files, "model.stablehlo")
    exporters.save(classifier, "stablehlo", stablehlo, platforms=("cpu",))
    with open(stablehlo, "rb") as f:
        call = jax.jit(jax.export.deserialize(bytearray(f.read())).call)
    ways["stablehlo"] = lambda images: np.asarray(call(images))

    onnx_file = os.path.join(files, "model.onnx")
    exporters.save(classifier, "onnx", onnx_file)
    session = onnxruntime.InferenceSession(onnx_file, providers=["CPUExecutionProvider"])
    ways["onnxruntime"] = lambda images: session.run(None, {"images": images})[0]

    twin = torch_models.create_model(config.model, len(classifier.class_names),
                                     classifier.image_shape)
    variables = {"params": jax.device_get(classifier.state.params),
                 "batch_stats": jax.device_get(classifier.state.batch_stats or {})}
    torch_models.load_flax_variables(twin, variables, classifier.image_shape)
    twin.eval()
    mean, std = classifier.mean, classifier.std

    def torch_eager(images):
        with torch.inference_mode():
            x = torch.from_numpy(images).permute(0, 3, 1, 2)
            return torch.softmax(twin(torch_models.normalize(x, mean, std)), -1).numpy()
    ways["torch_eager"] = torch_eager
    return ways


def measure(ways, images, rounds: int, latency_calls: int):
    one, batch = images[:1], images[:BATCH]
    for serve in ways.values():  # compile, allocate, warm the caches
        for _ in range(3):
            serve(one), serve(batch)
    latency = {way: [] for way in ways}
    throughput = {way: [] for way in ways}
    for _ in range(rounds):
        for way, serve in ways.items():
            calls = []
            for _ in range(latency_calls):
                start = time.perf_counter()
                serve(one)
                calls.append(time.perf_counter() - start)
            latency[way].append(statistics.median(calls))
            start = time.perf_counter()
            serve(batch)
            throughput[way].append(BATCH / (time.perf_counter() - start))
    return latency, throughput


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data_dir", required=True)
    parser.add_argument("--models", default="cifar_cnn,resnet18")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--latency_calls", type=int, default=20)
    parser.add_argument("--json", default="")
    args = parser.parse_args()

    import jax
    import onnxruntime
    import torch

    dataset, x_train, y_train, x_test = images_64px(args.data_dir, BATCH)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        npz = os.path.join(tmp, "cifar64.npz")
        np.savez(npz, x_train=x_train, y_train=y_train, x_test=x_test,
                 y_test=dataset.y_test[:BATCH], class_names=np.array(dataset.class_names))
        for model in args.models.split(","):
            workdir = os.path.join(tmp, model)
            config = short_run(npz, model, workdir)
            ways = servers(workdir, config, workdir)
            reference = ways["predict"](x_test)
            agreement = {way: float(np.abs(serve(x_test) - reference).max())
                         for way, serve in ways.items()}
            latency, throughput = measure(ways, x_test, args.rounds, args.latency_calls)
            results[model] = {way: {
                "batch1_latency_ms": round(1e3 * statistics.median(latency[way]), 3),
                "batch1_latency_ms_rounds": [round(1e3 * t, 3) for t in latency[way]],
                "batch256_images_per_s": round(statistics.median(throughput[way]), 1),
                "batch256_images_per_s_rounds": [round(t, 1) for t in throughput[way]],
                "max_abs_probability_difference_from_predict": agreement[way],
            } for way in ways}
            print(f"\n{model} at {IMAGE_SIZE} px, median of {args.rounds} rounds")
            print(f"{'way':<12} {'batch 1 (ms)':>13} {'batch 256 (img/s)':>18} {'max |dp|':>9}")
            for way, row in results[model].items():
                print(f"{way:<12} {row['batch1_latency_ms']:>13.2f} "
                      f"{row['batch256_images_per_s']:>18.0f} "
                      f"{row['max_abs_probability_difference_from_predict']:>9.1e}", flush=True)

    report = {
        "benchmark": "inference", "image_size": IMAGE_SIZE, "batch": BATCH,
        "rounds": args.rounds, "latency_calls": args.latency_calls, "results": results,
        "versions": {"jax": jax.__version__, "onnxruntime": onnxruntime.__version__,
                     "torch": torch.__version__},
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(),
                    "processor": platform.processor(), "torch_threads": torch.get_num_threads()},
        "command": "python3 benchmarks/inference.py " + " ".join(sys.argv[1:]),
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
