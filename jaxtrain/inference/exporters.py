"""A trained run as a file other programs run: `python -m jaxtrain.export WORKDIR
--format=onnx|stablehlo --out=FILE [--batch=N]`.

The exported function is the whole classifier: uint8 NHWC images of the run's
size in, float32 class probabilities out, with the normalisation inside,
BatchNorm in inference mode and the run's test-time augmentation (eval.tta, as
jaxtrain.predict applies it; --tta=none for none). The batch dimension is dynamic
unless --batch fixes it. FILE.json beside it says what goes in and comes out, how
an image file becomes the input (decoder, resize filter, crop), the class names and
the run it came from.

- stablehlo: `jax.export` serialised, the weights inside as constants; any JAX
  program loads it with `jax.export.deserialize(bytes).call(images)`, no Flax or
  jaxtrain needed. Lowered for the CPU and CUDA GPUs unless --platforms says.
- onnx: through jax2onnx (the `export` extra), for onnxruntime and the other
  ONNX runtimes. An operation jax2onnx cannot convert is one line naming it."""
import contextlib
import io
import json
import logging
import os
import re
import tempfile

import jax
import jax.numpy as jnp
import PIL

from jaxtrain.data import folder
from jaxtrain.errors import ConfigError
from jaxtrain.inference import classifier as classifier_lib

FORMATS = ("onnx", "stablehlo")
PLATFORMS = ("cpu", "cuda")  # what a StableHLO export is lowered for by default
ONNX_OPSET = 23  # the default --opset: the newest jax2onnx 0.12.5 writes
MIN_ONNX_OPSET = 13  # the oldest it writes these models in (at 11 its Squeeze has no axes input)
MIN_TTA_OPSET = 15  # with TTA inside: its Shape nodes carry `start`, an attribute of opset 15
JAX2ONNX_VERSIONS = "jax2onnx 0.12.5"  # what the `export` extra pins (0.13-0.17 pin an older orbax)


class ExportError(ConfigError):
    """The model cannot be exported as asked; the message says what to change."""


def with_lax_convolutions(state):
    """state whose model computes its convolutions with lax's (model.conv_impl='xla'):
    oneDNN's custom calls exist only in a process that loaded jaxtrain, so neither a
    StableHLO file nor ONNX could hold them. The same function (tests/test_onednn.py)."""
    model = getattr(state.apply_fn, "__self__", None)
    if getattr(model, "conv_impl", "xla") != "xla":
        state = state.replace(apply_fn=model.clone(conv_impl="xla").apply)
    return state


def probabilities_function(classifier, tta: str | None = None):
    """images uint8 (N, H, W, C) -> float32 probabilities (N, classes): the classifier's
    own prediction (the same jitted code as Classifier.predict, with lax's convolutions),
    its weights closed over so that an exporter writes them into the file."""
    state = with_lax_convolutions(classifier.state)
    tta = classifier.tta if tta is None else tta

    def probabilities(images):
        return classifier.probabilities(state, images, tta=tta)

    return probabilities


def input_spec(classifier, batch: int | None, symbolic):
    """The exported function's argument: uint8 (batch, H, W, C); batch None: `symbolic`."""
    if batch is not None and batch < 1:
        raise ExportError(f"--batch={batch}: must be >= 1 (or left out for a dynamic batch)")
    return jax.ShapeDtypeStruct((symbolic if batch is None else batch,
                                 *classifier.image_shape), jnp.uint8)


def to_stablehlo(classifier, batch: int | None = None, tta: str | None = None,
                 platforms=PLATFORMS) -> bytes:
    """The serialised jax.export.Exported of probabilities_function."""
    batch_dim, = jax.export.symbolic_shape("batch")
    function = jax.jit(probabilities_function(classifier, tta))
    try:
        exported = jax.export.export(function, platforms=tuple(platforms))(
            input_spec(classifier, batch, batch_dim))
    except Exception as error:  # a user's model that will not lower for a platform
        raise ExportError(f"StableHLO export for {', '.join(platforms)} failed: "
                          f"{type(error).__name__}: {str(error).splitlines()[0]}") from error
    return bytes(exported.serialize())


def to_onnx(classifier, batch: int | None = None, tta: str | None = None,
            opset: int = ONNX_OPSET) -> bytes:
    """The ONNX model (at `opset`, MIN_ONNX_OPSET to ONNX_OPSET: older runtimes and
    converters read the older ones) of probabilities_function, through jax2onnx.

    Inputs 'images' (uint8 NHWC), output 'probabilities'. jax2onnx 0.12.5 leaves
    stale NHWC shapes in the graph's value_info for some tensors it turned NCHW (a
    ResNet's residual adds); onnxruntime's shape inference then refuses the model,
    so the intermediate value_info is dropped: runtimes infer those shapes anyway.
    """
    try:
        import jax2onnx
        import onnx
    except ImportError as error:
        raise ExportError(f"--format=onnx needs jax2onnx and onnx ({error.name} is missing): "
                          "pip install 'jaxtrain[export]'") from None
    check_opset(opset, classifier.tta if tta is None else tta)
    spec = input_spec(classifier, batch, "batch")
    with quiet_exporter():
        try:
            model = jax2onnx.to_onnx(probabilities_function(classifier, tta), [spec],
                                     model_name="jaxtrain", opset=opset,
                                     input_names=["images"], output_names=["probabilities"])
        except Exception as error:
            raise ExportError(onnx_failure(error)) from error
    del model.graph.value_info[:]
    onnx.checker.check_model(model)
    return model.SerializeToString()


def check_opset(opset: int, tta: str = "none") -> None:
    if not MIN_ONNX_OPSET <= opset <= ONNX_OPSET:
        raise ExportError(f"--opset={opset}: jax2onnx writes these models at opsets "
                          f"{MIN_ONNX_OPSET} to {ONNX_OPSET}")
    if tta != "none" and opset < MIN_TTA_OPSET:
        raise ExportError(f"--opset={opset}: the test-time augmentation inside the export "
                          f"(tta={tta!r}) needs opset {MIN_TTA_OPSET} or later: --tta=none, "
                          f"or --opset={MIN_TTA_OPSET}")


def onnx_failure(error: Exception) -> str:
    """One line for a jax2onnx failure, naming the operation when it says which."""
    message = str(error).strip().splitlines()[0] if str(error).strip() else ""
    missing = re.search(r"primitive '([^']+)'", message)
    if missing:
        return (f"ONNX export: {JAX2ONNX_VERSIONS} cannot convert the operation "
                f"'{missing.group(1)}' this model uses (--format=stablehlo takes nearly "
                "every JAX operation)")
    return f"ONNX export failed in jax2onnx: {type(error).__name__}: {message}"


@contextlib.contextmanager
def quiet_exporter():
    """jax2onnx logs a warning per plugin that does not import with this JAX (for
    libraries jaxtrain does not use), onnx_ir one per untyped constant, and 0.12.5's
    Conv plugin prints DEBUG lines to stdout: noise here, and stdout is the user's."""
    loggers = [logging.getLogger(name) for name in ("jax2onnx", "onnx_ir")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def check_writable(out: str) -> None:
    """Fails before any work if `out` cannot be written (creating a file beside it)."""
    directory = os.path.dirname(os.path.abspath(out)) or "."
    if os.path.isdir(out):
        raise ExportError(f"--out={out} is a folder; name the file to write")
    if not os.path.isdir(directory):
        raise ExportError(f"--out={out}: no folder {directory} to write it in")
    try:
        fd, probe = tempfile.mkstemp(dir=directory, prefix=".jaxtrain-export-")
    except OSError as error:
        raise ExportError(f"--out={out}: cannot write in {directory} "
                          f"({error.strerror or error})") from None
    os.close(fd)
    os.remove(probe)


def write_atomically(path: str, data: bytes) -> None:
    """A complete file or none: written beside `path`, then renamed over it."""
    fd, temporary = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)),
                                     prefix=".jaxtrain-export-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(temporary)
        raise


def describe(classifier, format: str, out: str, batch, tta: str, platforms,
             opset: int = ONNX_OPSET) -> dict:
    """FILE.json: what the exported function takes and gives, and where it came from."""
    workdir = classifier.workdir
    summary, config = {}, {}
    for name, into in (("summary.json", summary), ("config.json", config)):
        with contextlib.suppress(OSError, ValueError, TypeError):  # TypeError: no workdir
            with open(os.path.join(workdir, name)) as f:
                into.update(json.load(f))
    description = {
        "format": format,
        "file": os.path.basename(out),
        "input": {"name": "images", "dtype": "uint8", "layout": "NHWC",
                  "shape": [batch, *classifier.image_shape]},  # null: any batch size
        "output": {"name": "probabilities", "dtype": "float32",
                   "shape": [batch, len(classifier.class_names)],
                   "meaning": "class probabilities (softmax); class_names[i] is class i"},
        "class_names": list(classifier.class_names),
        "preprocessing": {"inside": "x / 255, minus mean, divided by std, per channel",
                          "mean": list(classifier.mean), "std": list(classifier.std),
                          "files": file_preprocessing(classifier)},
        "tta": tta,
        "precision": classifier.precision,
        "run": {"workdir": workdir and os.path.abspath(workdir), "step": classifier.step,
                "model": config.get("model", {}).get("name"), "weights": classifier.weights,
                "replica": classifier.replica,
                "test_accuracy": summary.get("test_accuracy")},
        "exporter": {"jax": jax.__version__},
    }
    if format == "stablehlo":
        description["platforms"] = list(platforms)
        description["load"] = "jax.export.deserialize(open(FILE, 'rb').read()).call(images)"
    else:
        from importlib import metadata
        description["exporter"].update(jax2onnx=metadata.version("jax2onnx"), opset=opset)
        description["load"] = ("onnxruntime.InferenceSession(FILE).run(None, "
                               "{'images': images})[0]")
    return description


def file_preprocessing(classifier) -> dict:
    """How jaxtrain.predict makes an image file into one input row (data/folder.py's
    decoding), exactly enough for another program to do the same."""
    height, width, channels = classifier.image_shape
    crop = classifier.resize == "crop"
    return {
        "decoder": f"Pillow {PIL.__version__}: JPEG, PNG, BMP or WebP; EXIF orientation not "
                   "applied",
        "mode": "RGB" if channels == 3 else "L",  # alpha dropped, 16-bit grey scaled to 8
        "resize": classifier.resize,
        "size": [width, height],
        "filter": "PIL.Image.Resampling.BILINEAR",
        "reducing_gap": folder._REDUCING_GAP,
        "jpeg_draft": f"JPEGs: Image.draft(None, (ceil(w' * {folder._REDUCING_GAP:g}), "
                      f"ceil(h' * {folder._REDUCING_GAP:g}))) before resizing",
        "steps": ("w' x h' = the image scaled so its short side is the size (round(), at "
                  "least the size); resize to w' x h' unless already so; crop the box "
                  "((w' - W) // 2, (h' - H) // 2) of W x H" if crop else
                  "w' x h' = W x H; resize to it unless already so"),
    }


def export(workdir: str, format: str, out: str, batch: int | None = None, *,
           checkpoint: str | None = None, tta: str | None = None, weights: str = "raw",
           precision: str = "float32", platforms=PLATFORMS, opset: int = ONNX_OPSET,
           model=None) -> dict:
    """Writes the run's classifier to `out` (and `out`.json) and returns that JSON. tta:
    None = the run's eval.tta, as jaxtrain.predict and jaxtrain.restore use it."""
    check_format(format, precision)
    check_opset(opset)
    check_writable(out)
    # lax's own max-pooling: ONNX's MaxPool, and the backend's pooling where it runs
    classifier = classifier_lib.restore_for(workdir, checkpoint, weights, tta, precision,
                                            pool_impl="xla", model=model)
    return save(classifier, format, out, batch, tta, platforms, opset)


def check_format(format: str, precision: str) -> None:
    if format not in FORMATS:
        raise ExportError(f"--format={format}: must be one of {', '.join(FORMATS)}")
    if format == "onnx" and precision != "float32":
        raise ExportError("--format=onnx exports float32 (onnxruntime's CPU kernels have "
                          "no bfloat16 arithmetic); --precision=bfloat16 is for stablehlo")


def save(classifier, format: str, out: str, batch: int | None = None,
         tta: str | None = None, platforms=PLATFORMS, opset: int = ONNX_OPSET) -> dict:
    """Writes a restored classifier (jaxtrain.restore) to `out` and `out`.json, with its
    own TTA (the run's eval.tta unless restore was told another) unless `tta` says."""
    tta = classifier.tta if tta is None else tta
    check_format(format, classifier.precision)
    check_writable(out)
    if format == "stablehlo":
        data = to_stablehlo(classifier, batch, tta, platforms)
    else:
        data = to_onnx(classifier, batch, tta, opset)
    description = describe(classifier, format, out, batch, tta, platforms, opset)
    description["bytes"] = len(data)
    write_atomically(out, data)
    write_atomically(out + ".json", (json.dumps(description, indent=1) + "\n").encode())
    return description
