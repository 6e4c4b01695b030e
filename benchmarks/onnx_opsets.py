"""Which ONNX opsets each built-in model exports at, on this machine's CPU:

    python3 benchmarks/onnx_opsets.py [--opsets=13-23] [--tta=none,flip,flip_translate]

For every built-in model (and resnet18 with the ImageNet stem: a max-pool with padding)
and each test-time augmentation, the classifier goes through exporters.to_onnx, as
`python -m jaxtrain.export --format=onnx --opset=N` sends it, at every opset. A cell is
`ok` when the file passed ONNX's checker and onnxruntime's probabilities for 8 random
images are within the tests' 1e-4 of predict's; `R1`, `R2`... when the export refused
that opset (the lines below the table: what the command prints, N the cell's opset);
`E1`... an error the command would end in a traceback for. The models are their
smallest forms (the ResNets one block a stage, the ViTs one block; tests/test_export.py
cuts them the same way): the same operations go into the files. Their weights are the
init's, perturbed so that no layer is an identity (the ResNets' zero-initialised
BatchNorm scales) and the probabilities are neither uniform nor one-hot: no run is
trained. Several minutes on a 2-core CPU.
"""
import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

IMAGE_SHAPE = (32, 32, 3)
N_IMAGES = 8
PROBABILITY_ATOL = 1.2e-4  # tests/test_export.py's (tests/tolerances.py's TRAINING_STEPS)


def smallest_forms():
    """The deep models cut to one block a stage (ResNets) or one block (ViTs)."""
    from jaxtrain.models import resnet, vit
    for name, (_, block) in list(resnet.RESNETS.items()):
        resnet.RESNETS[name] = ((1, 1, 1, 1), block)
    for name, (dim, _, heads) in list(vit.VITS.items()):
        vit.VITS[name] = (dim, 1, heads)


def perturbed_state(row: str):
    """The init state of the model `row` names ('resnet18/imagenet': that stem), perturbed:
    params + 0.05 N(0, 1), BatchNorm means + 0.1 N(0, 1), variances x exp(0.2 N(0, 1))."""
    import jax
    import jax.numpy as jnp
    import optax

    from jaxtrain import models
    from jaxtrain.config.defaults import get_config
    from jaxtrain.training import train_state
    name, _, stem = row.partition("/")
    config = get_config().model
    config.name = name
    config.batch_norm = True  # seed_cnn's and the mlp's BatchNorm, exported too
    config.pool_impl = config.conv_impl = "xla"  # what exporters.export restores with
    config.stem = stem or "auto"
    model = models.create_model(config, 10, jnp.float32, image_shape=IMAGE_SHAPE)
    state = train_state.create_train_state(jax.random.key(0), model, optax.sgd(0.1), IMAGE_SHAPE)

    @jax.jit  # one program, not one per leaf
    def perturb(params, batch_stats):
        leaves, tree = jax.tree_util.tree_flatten_with_path((params, batch_stats))
        keys = jax.random.split(jax.random.key(1), len(leaves))
        noisy = []
        for (path, x), key in zip(leaves, keys):
            noise = jax.random.normal(key, x.shape, x.dtype)
            noisy.append(x * jnp.exp(0.2 * noise) if path[-1].key == "var" else
                         x + (0.05 if path[0].idx == 0 else 0.1) * noise)
        return jax.tree.unflatten(tree, noisy)

    params, batch_stats = perturb(state.params, state.batch_stats)
    return state.replace(params=params, batch_stats=batch_stats)


def classifier(state, tta: str):
    from jaxtrain.inference import classifier as classifier_lib
    meta = {"class_names": [str(i) for i in range(10)], "image_shape": IMAGE_SHAPE,
            "mean": (0.49, 0.48, 0.45), "std": (0.25, 0.24, 0.26)}
    return classifier_lib.Classifier(state, meta, tta, pad_mode="reflect", batch_size=N_IMAGES)


def cell(model, tta: str, opset: int, images, expected, notes: dict) -> str:
    """One cell: `model` exported at `opset`, run and compared with `expected`. A refusal
    or an error is a mark: notes maps its line (less the leading '--opset=N: ', the same
    at every opset) to it."""
    import onnxruntime

    from jaxtrain.inference import exporters
    try:
        data = exporters.to_onnx(model, tta=tta, opset=opset)
    except exporters.ExportError as error:  # the command's one line
        line = str(error).removeprefix(f"--opset={opset}: ")
        return notes.setdefault(line, f"R{len(notes) + 1}")
    except Exception as error:  # what the command would end in a traceback for
        line = f"{type(error).__name__} (a traceback): {str(error).strip().splitlines()[0]}"
        return notes.setdefault(line, f"E{len(notes) + 1}")
    session = onnxruntime.InferenceSession(data, providers=["CPUExecutionProvider"])
    difference = np.abs(session.run(None, {"images": images})[0] - expected).max()
    return "ok" if difference <= PROBABILITY_ATOL else f"{difference:.0e}"


def opset_range(text: str) -> list[int]:
    first, _, last = text.partition("-")
    return list(range(int(first), int(last or first) + 1))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--opsets", default="13-23", help="FIRST-LAST or one opset.")
    parser.add_argument("--tta", default="none,flip,flip_translate",
                        help="The test-time augmentations inside the export, comma-separated.")
    parser.add_argument("--models", default=None, help="Rows, comma-separated (default: every "
                        "built-in model and resnet18/imagenet).")
    args = parser.parse_args()
    from importlib import metadata

    from jaxtrain import models
    smallest_forms()
    opsets = opset_range(args.opsets)
    rows = args.models.split(",") if args.models else [*models.MODEL_NAMES, "resnet18/imagenet"]
    images = np.random.default_rng(0).integers(0, 256, (N_IMAGES, *IMAGE_SHAPE), np.uint8)
    versions = ", ".join(f"{name} {metadata.version(name)}"
                         for name in ("jax", "jax2onnx", "onnx", "onnxruntime"))
    print(f"ONNX exports at opsets {opsets[0]}-{opsets[-1]} ({versions}); ok: checked by "
          f"onnx.checker, onnxruntime within {PROBABILITY_ATOL:g} of predict")
    print(f"{'model':<19}{'tta':<15}" + "".join(f"{opset:>6}" for opset in opsets)
          + "  seconds")
    notes, start = {}, time.perf_counter()
    for row in rows:
        began = time.perf_counter()
        state = perturbed_state(row)
        for tta in args.tta.split(","):
            model = classifier(state, tta)
            _, expected = model.predict(images)
            cells = [cell(model, tta, opset, images, expected, notes) for opset in opsets]
            print(f"{row:<19}{tta:<15}" + "".join(f"{c:>6}" for c in cells)
                  + f"  {time.perf_counter() - began:7.1f}", flush=True)
            began = time.perf_counter()
    for line, mark in notes.items():
        print(f"{mark}: {'' if mark.startswith('E') else '--opset=N: '}{line}")
    print(f"{time.perf_counter() - start:.0f} s in all")


if __name__ == "__main__":
    main()
