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
  ONNX runtimes, at opset 23 or an older one (--opset). An operation jax2onnx cannot
  convert is one line naming it, and so is a graph ONNX's checker refuses."""
import contextlib
import io
import json
import logging
import math
import os
import re
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
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
# jax2onnx 0.12.5 writes two kinds of node in a later opset's form whatever the opset:
# these reductions with their axes as an input (ReduceSum's became one at 13, theirs at 18),
# and Gelu, an operator from opset 20 on. in_opset rewrites them into the older form.
AXES_INPUT_OPSET = 18
AXES_INPUT_REDUCTIONS = ("ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceMax",
                         "ReduceMean", "ReduceMin", "ReduceProd", "ReduceSumSquare")
GELU_OPSET = 20
# Gelu as ONNX defines it (Gelu-20's function body), one operation a step on the input x
# and the step before's result t: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) or
# 0.5 x (1 + erf(x / sqrt(2))), by its attribute approximate
GELU_STEPS = {
    "tanh": (("Mul", "x", "x"), ("Mul", "t", "x"), ("Mul", "t", 0.044715), ("Add", "x", "t"),
             ("Mul", "t", math.sqrt(2 / math.pi)), ("Tanh", "t"), ("Add", "t", 1.0),
             ("Mul", "t", 0.5), ("Mul", "x", "t")),
    "none": (("Div", "x", math.sqrt(2)), ("Erf", "t"), ("Add", "t", 1.0), ("Mul", "t", 0.5),
             ("Mul", "x", "t")),
}
ONNX_DOMAINS = ("", "ai.onnx")  # the standard operators' domain, by either name


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

    Inputs 'images' (uint8 NHWC), output 'probabilities'. While jax2onnx 0.12.5 traces
    it, a max-pool's explicit padding is a pad of its own (explicit_pool_padding); the
    nodes it writes in a later opset's form are rewritten in `opset`'s (in_opset). It
    also leaves stale NHWC shapes in the graph's value_info for some tensors it turned
    NCHW (a ResNet's residual adds); onnxruntime's shape inference then refuses the
    model, so the intermediate value_info is dropped: runtimes infer those shapes
    anyway. ONNX's checker has the last word (check_onnx).
    """
    try:
        import jax2onnx
        import onnx  # noqa: F401 (in_opset's and check_onnx's)
    except ImportError as error:
        raise ExportError(f"--format=onnx needs jax2onnx and onnx ({error.name} is missing): "
                          "pip install 'jaxtrain[export]'") from None
    check_opset(opset, classifier.tta if tta is None else tta)
    spec = input_spec(classifier, batch, "batch")
    probabilities = probabilities_function(classifier, tta)

    def traced(images):
        with explicit_pool_padding():
            return probabilities(images)

    with quiet_exporter():
        try:
            model = jax2onnx.to_onnx(traced, [spec], model_name="jaxtrain", opset=opset,
                                     input_names=["images"], output_names=["probabilities"])
        except Exception as error:
            raise ExportError(onnx_failure(error)) from error
    in_opset(model.graph, opset)
    del model.graph.value_info[:]
    check_onnx(model, opset)
    return model.SerializeToString()


@contextlib.contextmanager
def explicit_pool_padding():
    """While jax2onnx 0.12.5 traces, flax.linen.max_pool is its own, which reads an
    explicit padding (the ImageNet-stem ResNets' ((1, 1), (1, 1))) as none: its file
    computes something else. Inside this, such a pool pads with -inf first and then
    pools unpadded, which is what flax's max_pool computes."""
    from flax import linen
    from flax.linen import pooling
    tracing = [(module, module.max_pool) for module in (linen, pooling)]
    for module, max_pool in tracing:
        module.max_pool = padded_first(max_pool)
    try:
        yield
    finally:
        for module, max_pool in tracing:
            module.max_pool = max_pool


def padded_first(max_pool):
    """`max_pool`, given (low, high) pairs as its padding, pads with -inf first."""
    def pool(inputs, window_shape, strides=None, padding="VALID"):
        if not isinstance(padding, str):
            spatial = [tuple(pair) for pair in padding]
            batch = [(0, 0)] * (inputs.ndim - len(spatial) - 1)
            inputs = jnp.pad(inputs, [*batch, *spatial, (0, 0)], constant_values=-jnp.inf)
            padding = "VALID"
        return max_pool(inputs, window_shape=window_shape, strides=strides, padding=padding)
    return pool


def check_opset(opset: int, tta: str = "none") -> None:
    if not MIN_ONNX_OPSET <= opset <= ONNX_OPSET:
        raise ExportError(f"--opset={opset}: jax2onnx writes these models at opsets "
                          f"{MIN_ONNX_OPSET} to {ONNX_OPSET}")
    if tta != "none" and opset < MIN_TTA_OPSET:
        raise ExportError(f"--opset={opset}: the test-time augmentation inside the export "
                          f"(tta={tta!r}) needs opset {MIN_TTA_OPSET} or later: --tta=none, "
                          f"or --opset={MIN_TTA_OPSET}")


def in_opset(graph, opset: int) -> None:
    """Rewrites in place the nodes jax2onnx wrote in a later opset's form than `opset`,
    the one the model declares, as the same computation in `opset`'s operators (in every
    graph: a Loop's body too): below 18 a reduction's constant axes input becomes its
    `axes` attribute, below 20 Gelu becomes the arithmetic ONNX defines it by."""
    types = value_types(graph) if opset < GELU_OPSET else None
    for inner in list(subgraphs(graph)):
        if opset < AXES_INPUT_OPSET:
            axes_as_attributes(inner)
        if opset < GELU_OPSET:
            gelu_as_arithmetic(inner, types)


def subgraphs(graph):
    """Every graph inside `graph`'s nodes' attributes, at any depth, then `graph`: each
    after those inside it, so that rewriting one (which copies its nodes) comes after
    its subgraphs' rewrites."""
    import onnx
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                yield from subgraphs(attribute.g)
            for inner in attribute.graphs:
                yield from subgraphs(inner)
    yield graph


def axes_as_attributes(graph) -> None:
    """AXES_INPUT_REDUCTIONS' axes, an input holding a constant of this graph, as the
    `axes` attribute of opsets 13 to 17; the constants no node reads any more go
    (onnxruntime warns of each one it finds). Axes computed at run time, which JAX's
    reductions never give, stay: the checker refuses those."""
    import onnx
    constants = {tensor.name: tensor for tensor in graph.initializer}
    taken = set()
    for node in graph.node:
        if (node.domain in ONNX_DOMAINS and node.op_type in AXES_INPUT_REDUCTIONS
                and len(node.input) == 2 and node.input[1] in constants):
            axes = onnx.numpy_helper.to_array(constants[node.input[1]])
            node.attribute.append(onnx.helper.make_attribute("axes", axes.tolist()))
            taken.add(node.input[1])
            del node.input[1]
    read = {name for inner in subgraphs(graph) for node in inner.node for name in node.input}
    for name in taken - read:
        graph.initializer.remove(constants[name])


def value_types(graph) -> dict:
    """name -> ONNX element type of every tensor jax2onnx typed, subgraphs' too."""
    return {value.name: value.type.tensor_type.elem_type for inner in subgraphs(graph)
            for value in (*inner.input, *inner.value_info, *inner.output)}


def gelu_as_arithmetic(graph, types: dict) -> None:
    """Every Gelu node of `graph` as GELU_STEPS' nodes, in its place."""
    nodes = []
    for node in graph.node:
        if node.domain in ONNX_DOMAINS and node.op_type == "Gelu":
            steps, constants = gelu_steps(node, types)
            nodes.extend(steps)
            graph.initializer.extend(constants)
        else:
            nodes.append(node)
    del graph.node[:]
    graph.node.extend(nodes)


def gelu_steps(node, types: dict):
    """(nodes, constants) computing Gelu `node`'s output: its constants in its input's
    type (float32, what an ONNX export computes in, where jax2onnx left it untyped)."""
    import onnx
    x, y = node.input[0], node.output[0]
    dtype = onnx.helper.tensor_dtype_to_np_dtype(types.get(x) or onnx.TensorProto.FLOAT)
    approximate = next((a.s.decode() for a in node.attribute if a.name == "approximate"),
                       "none")
    steps = GELU_STEPS[approximate]
    nodes, constants, t = [], [], None
    for i, (op, *operands) in enumerate(steps):
        inputs = []
        for operand in operands:
            if isinstance(operand, float):
                constants.append(onnx.numpy_helper.from_array(np.array(operand, dtype),
                                                              f"{y}/gelu_{i}_constant"))
                operand = constants[-1].name
            inputs.append({"x": x, "t": t}.get(operand, operand))
        t = y if i == len(steps) - 1 else f"{y}/gelu_{i}"
        nodes.append(onnx.helper.make_node(op, inputs, [t], name=f"{y}/gelu_{i}"))
    return nodes, constants


def check_onnx(model, opset: int) -> None:
    """ONNX's checker: a model it refuses is one line, naming the opset to ask for where
    operators this opset lacks are why."""
    import onnx
    try:
        onnx.checker.check_model(model)
    except onnx.checker.ValidationError as error:
        first = newer_operators(model.graph, opset)
        if first and None not in first.values():
            lowest = max(first.values())
            raise ExportError(f"--opset={opset}: this model's ONNX graph needs opset {lowest} "
                              f"or later (for {', '.join(sorted(first))}): "
                              f"--opset={lowest}") from None
        raise ExportError(f"--opset={opset}: ONNX's checker refuses the graph "
                          f"{JAX2ONNX_VERSIONS} wrote for this model: "
                          f"{str(error).strip().splitlines()[0]}") from None


def newer_operators(graph, opset: int) -> dict:
    """{operator in `graph` that `opset` lacks: the first opset to ONNX_OPSET with it
    (None: none)}."""
    import onnx
    return {node.op_type: next((newer for newer in range(opset + 1, ONNX_OPSET + 1)
                                if onnx.defs.has(node.op_type, newer)), None)
            for inner in subgraphs(graph) for node in inner.node
            if node.domain in ONNX_DOMAINS and not onnx.defs.has(node.op_type, opset)}


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
