"""jaxtrain.export: every built-in model, after a short run, as ONNX (checked by
onnxruntime) and StableHLO (checked by jax.export in a process without Flax or
jaxtrain), both matching restore().predict on real CIFAR-10 test images. The deep
models run cut to their smallest form (smallest_deep_models): the same operations go
into the files."""
import json
import os
import select
import subprocess
import sys
from pathlib import Path

import flax.linen as nn
import jax
import numpy as np
import pytest
from conftest import require_module
from tolerances import ELEMENTWISE, NETWORK_PASS, TRAINING_STEPS
import fork_server

import jaxtrain
from jaxtrain import models
from jaxtrain.config.defaults import get_config
from jaxtrain.inference import exporters
from jaxtrain.run import loop

REPO = Path(__file__).resolve().parents[1]
ort = require_module("onnxruntime", "pip install -e '.[export]'")
require_module("jax2onnx", "pip install -e '.[export]'")

pytestmark = pytest.mark.slow  # every test here trains a run or starts a process

N_IMAGES = 37  # an odd batch: the dynamic batch dimension is not a multiple of anything


@pytest.fixture(scope="module")
def arrays_npz(tmp_path_factory, cifar_subset):
    """Real CIFAR-10 images as a data.name='arrays' file: 64 training, 40 test."""
    path = tmp_path_factory.mktemp("arrays") / "cifar.npz"
    np.savez(path, x_train=cifar_subset["x_train"][:64], y_train=cifar_subset["y_train"][:64],
             x_test=cifar_subset["x_test"][:40], y_test=cifar_subset["y_test"][:40],
             class_names=np.array(cifar_subset["class_names"]))
    return path


def short_run_config(npz, model_name, **changes):
    config = get_config()
    config.data.name = "arrays"
    config.data.dir = str(npz)
    config.model.name = model_name
    if model_name == "cifar_cnn":
        config.model.stem_init = "whiten"
    if model_name == "seed_cnn":
        config.model.batch_norm = True
    config.train.precision = "float32"
    config.train.batch_size = 16
    config.train.num_steps = 2
    config.optimizer.learning_rate = 0.01
    for key, value in changes.items():
        section, name = key.split("__")
        config[section][name] = value
    return config


@pytest.fixture(scope="module", autouse=True)
def smallest_deep_models():
    """The deep built-in models cut to their smallest form in this module's runs and
    restores: the ResNets one block a stage, vit_tiny two blocks of its twelve. The same
    layers and operations go into the files (a stage's first block is the one with the
    stride and the projection), at a fraction of the compile time (ResNet-50 and
    vit_tiny's tests took ~50 s each)."""
    from jaxtrain.models import resnet, vit
    with pytest.MonkeyPatch.context() as patch:
        for name in ("resnet18", "resnet50"):
            patch.setitem(resnet.RESNETS, name, ((1, 1, 1, 1), resnet.RESNETS[name][1]))
        dim, _, heads = vit.VITS["vit_tiny"]
        patch.setitem(vit.VITS, "vit_tiny", (dim, 2, heads))
        yield


RUNS = {}  # model name -> workdir, shared by this module's tests
# the mlp's run, which the command's tests share, evaluates with a flip: its exports carry
# the run's TTA (the others' eval.tta is 'none'); resnet50's has the ImageNet stem (its
# 7x7/2 conv and padded 3x3/2 max-pool; 'auto' takes it above 64 px), resnet18's the CIFAR one
RUN_CHANGES = {"mlp": {"eval__tta": "flip"}, "resnet50": {"model__stem": "imagenet"}}


@pytest.fixture(scope="module")
def run_of(arrays_npz, tmp_path_factory):
    def run(model_name):
        if model_name not in RUNS:
            workdir = str(tmp_path_factory.mktemp(f"run_{model_name}"))
            loop.train_and_evaluate(short_run_config(arrays_npz, model_name,
                                                     **RUN_CHANGES.get(model_name, {})), workdir)
            RUNS[model_name] = workdir
        return RUNS[model_name]
    return run


@pytest.fixture(scope="module")
def test_images(cifar_subset):
    return cifar_subset["x_test"][100:100 + N_IMAGES]


def run_onnx(path, images):
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, {"images": images})[0]


# A fresh interpreter whose imports of Flax, optax, Orbax and jaxtrain fail: what a
# serving process that only has JAX would see. It serves this module's tests one after
# another (its JAX started once): each line of its stdin names a StableHLO file, the
# images (.npy) and the two .npy files to write, the probabilities of all the images and
# of the first alone; it answers each with a line, the platforms the file was lowered for.
NO_FLAX = """
import json, sys
BLOCKED = ("flax", "jaxtrain", "optax", "orbax")
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{name} is blocked in this process")
sys.meta_path.insert(0, Block())
import jax, numpy as np
for request in sys.stdin:
    model, images, everything, first = json.loads(request)
    exported = jax.export.deserialize(open(model, "rb").read())
    images = np.load(images)
    np.save(everything, np.asarray(exported.call(images)))
    np.save(first, np.asarray(exported.call(images[:1])))
    assert not any(m.split(".")[0] in BLOCKED for m in sys.modules), sorted(sys.modules)
    print(json.dumps(list(exported.platforms)), flush=True)
"""


@pytest.fixture(scope="module")
def without_flax(tmp_path_factory):
    """run(StableHLO file, images, folder) -> (probabilities of all the images, of the
    first alone, the platforms): NO_FLAX's answers."""
    folder = tmp_path_factory.mktemp("no_flax")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    with open(folder / "stderr", "w") as stderr:
        process = subprocess.Popen([sys.executable, "-c", NO_FLAX], cwd=folder, env=env,
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                   stderr=stderr, text=True)

    def run(path, images, tmp_path):
        np.save(tmp_path / "images.npy", images)
        request = [str(path)] + [str(tmp_path / name) for name in ("images.npy", "all.npy",
                                                                    "one.npy")]
        try:
            process.stdin.write(json.dumps(request) + "\n")
            process.stdin.flush()
            answered, _, _ = select.select([process.stdout], [], [], 300)
            line = process.stdout.readline() if answered else ""
        except BrokenPipeError:  # it has stopped
            line = ""
        assert line, (folder / "stderr").read_text()[-3000:]
        return (np.load(tmp_path / "all.npy"), np.load(tmp_path / "one.npy"),
                json.loads(line))

    yield run
    process.stdin.close()
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


# Wider or deeper versions of the models below, built by the same code (resnet.RESNETS,
# vit.VITS) and exported by the same path: left out of CI, where their 86M-parameter
# exports took ~2 min of its 25 (all nine passed here when they were in).
VARIANTS = ("resnet34", "vit_small", "vit_base")
# The models whose graphs hold nodes jax2onnx writes in a later opset's form, which
# exporters.in_opset rewrites below opsets 18 and 20: resnet18's global average pool
# (ReduceMean; resnet50's too), cifar_cnn's global max-pool (ReduceMax) and tanh
# Gelu, vit_tiny's LayerNorm (ReduceSumSquare) and erf Gelu. Each exports at opset 13 too.
REWRITTEN_AT_OLDER_OPSETS = ("resnet18", "cifar_cnn", "vit_tiny")


@pytest.mark.parametrize("model_name", [n for n in models.MODEL_NAMES if n not in VARIANTS])
def test_every_built_in_model_exports_both_ways_and_matches_predict(
        model_name, run_of, test_images, without_flax, tmp_path):
    workdir = run_of(model_name)
    classifier = jaxtrain.restore(workdir)
    labels, expected = classifier.predict(test_images)

    onnx_file = tmp_path / "model.onnx"
    description = exporters.save(classifier, "onnx", str(onnx_file))
    probabilities = run_onnx(onnx_file, test_images)
    np.testing.assert_allclose(probabilities, expected, atol=TRAINING_STEPS, rtol=0)
    np.testing.assert_array_equal(probabilities.argmax(-1), labels)
    np.testing.assert_allclose(run_onnx(onnx_file, test_images[:1]), expected[:1],
                               atol=TRAINING_STEPS, rtol=0)
    assert description["input"]["shape"] == [None, 32, 32, 3]
    assert description["run"]["model"] == model_name
    assert json.loads((tmp_path / "model.onnx.json").read_text()) == description
    if model_name in REWRITTEN_AT_OLDER_OPSETS:
        exporters.save(classifier, "onnx", str(onnx_file), opset=exporters.MIN_ONNX_OPSET)
        np.testing.assert_allclose(run_onnx(onnx_file, test_images), expected,
                                   atol=TRAINING_STEPS, rtol=0)

    hlo_file = tmp_path / "model.stablehlo"
    exporters.save(classifier, "stablehlo", str(hlo_file))
    everything, first, platforms = without_flax(hlo_file, test_images, tmp_path)
    np.testing.assert_allclose(first, expected[:1], atol=TRAINING_STEPS, rtol=0)
    np.testing.assert_allclose(everything, expected, atol=TRAINING_STEPS, rtol=0)
    np.testing.assert_array_equal(np.argmax(everything, -1), labels)
    assert "cuda" in platforms and "cpu" in platforms


def test_a_fixed_batch_and_tta_inside_the_export(run_of, test_images, tmp_path):
    workdir = run_of("mlp")  # the run the command's tests share
    _, expected = jaxtrain.restore(workdir, tta="flip").predict(test_images[:5])
    _, plain = jaxtrain.restore(workdir, tta="none").predict(test_images[:5])
    assert np.abs(expected - plain).max() > 1e-3  # the flip changes something to check
    out = tmp_path / "fixed.onnx"
    description = exporters.export(workdir, "onnx", str(out), batch=5, tta="flip")
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    assert session.get_inputs()[0].shape == [5, 32, 32, 3]
    assert session.get_inputs()[0].type == "tensor(uint8)"
    np.testing.assert_allclose(session.run(None, {"images": test_images[:5]})[0], expected,
                               atol=TRAINING_STEPS, rtol=0)
    assert description["tta"] == "flip" and description["input"]["shape"][0] == 5
    with pytest.raises(Exception):  # a fixed batch is fixed
        session.run(None, {"images": test_images[:6]})


def test_an_older_opset_is_written_and_read_by_a_second_consumer(run_of, test_images, tmp_path):
    """The oldest opsets jax2onnx writes these models in, for runtimes and converters that
    lag behind (13; 15 with TTA inside): the file records it, and ONNX's own reference
    evaluator (a second consumer beside onnxruntime) gives predict's probabilities."""
    onnx = require_module("onnx", "pip install -e '.[export]'")
    from onnx.reference import ReferenceEvaluator
    workdir = run_of("seed_cnn")
    _, expected = jaxtrain.restore(workdir, tta="flip").predict(test_images[:4])
    out = tmp_path / "old.onnx"
    description = exporters.export(workdir, "onnx", str(out), tta="flip",
                                   opset=exporters.MIN_TTA_OPSET)
    model = onnx.load(str(out))
    assert exporters.MIN_TTA_OPSET == 15 == description["exporter"]["opset"]
    assert [o.version for o in model.opset_import if o.domain in ("", "ai.onnx")] == [15]
    read = ReferenceEvaluator(model).run(None, {"images": test_images[:4]})[0]
    np.testing.assert_allclose(read, expected, atol=TRAINING_STEPS, rtol=0)
    np.testing.assert_allclose(run_onnx(out, test_images[:4]), expected, atol=TRAINING_STEPS,
                               rtol=0)
    # without TTA, opset 13 (its BatchNormalization-9 onnxruntime runs as predict does;
    # ONNX's reference evaluator computes that version differently, so not it here)
    _, plain = jaxtrain.restore(workdir, tta="none").predict(test_images[:4])
    exporters.export(workdir, "onnx", str(out), tta="none", opset=exporters.MIN_ONNX_OPSET)
    assert [o.version for o in onnx.load(str(out)).opset_import if o.domain in ("", "ai.onnx")
            ] == [13]
    np.testing.assert_allclose(run_onnx(out, test_images[:4]), plain, atol=TRAINING_STEPS,
                               rtol=0)
    with pytest.raises(exporters.ExportError, match=r"^--opset=13: the test-time augmentation "
                                                    r"inside the export \(tta='flip'\) needs "
                                                    r"opset 15 or later: --tta=none, or "
                                                    r"--opset=15$"):
        exporters.export(workdir, "onnx", str(out), tta="flip", opset=13)


def later_forms_model(opset: int):
    """A model declaring `opset` with the nodes jax2onnx 0.12.5 writes in a later opset's
    form at any opset: each AXES_INPUT_REDUCTIONS reduction with its axes an input (opset
    18's form) and Gelu, both approximations (an operator of opset 20)."""
    from onnx import TensorProto, helper, numpy_helper
    nodes = [helper.make_node(op, ["x", "axes"], [op], keepdims=0)
             for op in exporters.AXES_INPUT_REDUCTIONS]
    nodes += [helper.make_node("Gelu", ["x"], [f"gelu_{a}"], approximate=a)
              for a in ("none", "tanh")]
    graph = helper.make_graph(
        nodes, "later_forms", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4])],
        [helper.make_tensor_value_info(node.output[0], TensorProto.FLOAT,
                                       [2, 3, 4] if node.op_type == "Gelu" else [2])
         for node in nodes],
        [numpy_helper.from_array(np.array([1, 2], np.int64), "axes")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=9)


@pytest.mark.parametrize("opset", [13, 17, 19])
def test_nodes_in_a_later_opset_s_form_are_rewritten_as_the_same_computation(opset):
    """Every reduction jax2onnx writes with opset 18's axes input, and Gelu both ways,
    rewritten for an older opset: the checker passes them and onnxruntime computes what
    it computes for the later forms at opset 20 (no run: a graph made here)."""
    x = np.random.default_rng(0).uniform(0.1, 3, (2, 3, 4)).astype(np.float32)
    expected = ort.InferenceSession(later_forms_model(20).SerializeToString()).run(None, {"x": x})
    model = later_forms_model(opset)
    exporters.in_opset(model.graph, opset)
    exporters.check_onnx(model, opset)
    ops = {node.op_type for node in model.graph.node}
    assert ("Gelu" in ops) == (opset >= 20) and ("Erf" in ops) == (opset < 20)
    assert ("axes" in {t.name for t in model.graph.initializer}) == (opset >= 18)
    session = ort.InferenceSession(model.SerializeToString())
    for name, got, want in zip(session.get_outputs(), session.run(None, {"x": x}), expected):
        np.testing.assert_allclose(got, want, rtol=ELEMENTWISE, atol=ELEMENTWISE,
                                   err_msg=name.name)


def test_a_graph_the_checker_refuses_is_one_line_naming_the_opset_it_needs():
    """Where an operator is missing from the opset, the line names the first opset with
    it; any other refusal is the checker's first line (here: axes computed at run time,
    which the rewrite cannot make an attribute)."""
    from onnx import TensorProto, helper
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])
    mish = helper.make_model(helper.make_graph([helper.make_node("Mish", ["x"], ["y"])], "g",
                                               [x], [y]),
                             opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    with pytest.raises(exporters.ExportError, match=r"^--opset=17: this model's ONNX graph "
                                                    r"needs opset 18 or later \(for Mish\): "
                                                    r"--opset=18$"):
        exporters.check_onnx(mish, 17)
    axes = helper.make_tensor_value_info("axes", TensorProto.INT64, [1])
    computed = helper.make_model(helper.make_graph(
        [helper.make_node("ReduceMean", ["x", "axes"], ["y"], name="mean")], "g", [x, axes], [y]),
        opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    exporters.in_opset(computed.graph, 17)
    with pytest.raises(exporters.ExportError) as error:
        exporters.check_onnx(computed, 17)
    assert str(error.value) == (
        "--opset=17: ONNX's checker refuses the graph jax2onnx 0.12.5 wrote for this model: "
        "Node(mean) with schema(::ReduceMean:13) has input size 2 not in range [min=1, max=1].")


def test_a_bfloat16_run_exports_float32_by_default(arrays_npz, test_images, tmp_path):
    workdir = str(tmp_path / "bf16")
    # the mlp: what precision a run computed in and what the export computes in are the
    # same for every model (a cifar_cnn's bfloat16 run took 3x as long: XLA's bfloat16
    # convolutions are slow to compile and run on a CPU)
    loop.train_and_evaluate(short_run_config(arrays_npz, "mlp", train__precision="bfloat16"),
                            workdir)
    _, expected = jaxtrain.restore(workdir, precision="float32").predict(test_images)
    _, bfloat16 = jaxtrain.restore(workdir).predict(test_images)
    assert np.abs(expected - bfloat16).max() > 1e-5  # the two precisions do differ
    description = exporters.export(workdir, "onnx", str(tmp_path / "m.onnx"))
    assert description["precision"] == "float32"
    np.testing.assert_allclose(run_onnx(tmp_path / "m.onnx", test_images), expected,
                               atol=TRAINING_STEPS, rtol=0)
    with pytest.raises(exporters.ExportError, match="float32"):
        exporters.export(workdir, "onnx", str(tmp_path / "b.onnx"), precision="bfloat16")


class HostLookupNet(nn.Module):
    """A user's model that calls host code at inference (jax.pure_callback), which
    neither ONNX nor a serialised StableHLO module can carry."""
    num_classes: int = 10

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.Dense(self.num_classes)(x.reshape((x.shape[0], -1)))
        if train:
            return x
        return jax.pure_callback(lambda a: np.tanh(a), jax.ShapeDtypeStruct(x.shape, x.dtype), x)


def test_an_operation_the_exporter_cannot_take_is_one_line_naming_it(arrays_npz, tmp_path):
    config = short_run_config(arrays_npz, "mlp")
    loop.train_and_evaluate(config, str(tmp_path / "run"), model=HostLookupNet())
    classifier = jaxtrain.restore(str(tmp_path / "run"), model=HostLookupNet())
    with pytest.raises(exporters.ExportError) as error:
        exporters.to_onnx(classifier)
    message = str(error.value)
    assert "'pure_callback'" in message and "\n" not in message
    with pytest.raises(exporters.ExportError) as error:
        exporters.to_stablehlo(classifier)
    assert str(error.value).startswith("StableHLO export for cpu, cuda failed: ")
    assert "\n" not in str(error.value)


def cli(*args):
    return fork_server.run([sys.executable, "-m", "jaxtrain.export", *map(str, args)], cwd=REPO,
                           capture_output=True, text=True, timeout=300)


def test_the_command_writes_the_file_and_its_json_and_applies_predict_s_tta(
        run_of, test_images, tmp_path):
    """The users' two commands on a run with eval.tta='flip' (the mlp's): the export takes
    the same TTA as predict by default, so both give the same probabilities for one image
    file; FILE.json says what goes in (--batch fixes the batch), names the run, the TTA and
    the resize filter exactly. (One export command for both: each one's first ONNX
    conversion takes ~8 s of jax2onnx's imports.)"""
    from PIL import Image
    workdir = run_of("mlp")
    image = tmp_path / "image.png"
    Image.fromarray(test_images[0]).save(image)
    result = cli(workdir, "--format=onnx", f"--out={tmp_path / 'mlp.onnx'}", "--batch=3")
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith(f"wrote {tmp_path / 'mlp.onnx'} (")
    assert "DEBUG" not in result.stdout + result.stderr and "WARNING" not in result.stderr
    description = json.loads((tmp_path / "mlp.onnx.json").read_text())
    assert description["class_names"][:2] == ["airplane", "automobile"]
    assert description["input"] == {"name": "images", "dtype": "uint8", "layout": "NHWC",
                                    "shape": [3, 32, 32, 3]}
    assert description["run"]["workdir"] == os.path.abspath(workdir)
    from_export = run_onnx(tmp_path / "mlp.onnx", test_images[:3])
    np.testing.assert_allclose(from_export, jaxtrain.restore(workdir).predict(test_images[:3])[1],
                               atol=TRAINING_STEPS, rtol=0)

    predicted = fork_server.run([sys.executable, "-m", "jaxtrain.predict", workdir, str(image),
                                "--json", "--top=10"], cwd=REPO, capture_output=True,
                                text=True, timeout=300)
    assert predicted.returncode == 0, predicted.stderr[-2000:]
    line = json.loads(predicted.stdout.strip().splitlines()[-1])
    from_predict = {entry["label"]: entry["probability"] for entry in line["top"]}
    for label, probability in from_predict.items():
        assert abs(from_export[0][label] - probability) < NETWORK_PASS, (label, probability)
    _, plain = jaxtrain.restore(workdir, tta="none").predict(test_images[:1])
    assert np.abs(plain[0] - from_export[0]).max() > 1e-4  # the flip is in there
    assert description["tta"] == "flip"
    files = description["preprocessing"]["files"]
    assert files["filter"] == "PIL.Image.Resampling.BILINEAR" and files["reducing_gap"] == 3.0
    assert files["resize"] == "crop" and files["size"] == [32, 32] and files["mode"] == "RGB"


# `python -m jaxtrain.export ARGS...` once per argument list given (JSON, argv[1]), each in a
# child forked from one process that has imported what the command imports (~2.5 s a
# process here): runpy runs the module's __main__ block as -m does. argv[2]: a folder for
# each command's stdout and stderr (I.out, I.err); prints the exit statuses (JSON).
COMMANDS = """
import json, os, runpy, sys
import absl.app, absl.flags, jaxtrain.inference.exporters, jaxtrain.predict
commands, folder = json.loads(sys.argv[1]), sys.argv[2]
statuses = []
for i, args in enumerate(commands):
    pid = os.fork()
    if pid == 0:
        for fd, name in ((1, "out"), (2, "err")):
            os.dup2(os.open(os.path.join(folder, f"{i}.{name}"),
                            os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
        sys.argv = ["-m", *args]
        try:
            runpy.run_module("jaxtrain.export", run_name="__main__", alter_sys=True)
            status = 0
        except SystemExit as stop:
            status = stop.code if isinstance(stop.code, int) else int(stop.code is not None)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    statuses.append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
print(json.dumps(statuses))
"""

BAD_INPUTS = ("no checkpoint", "not a run", "unknown format", "unwritable out",
              "out is a folder", "unknown step", "opset too old")


@pytest.fixture(scope="module")
def bad_input_results(run_of, tmp_path_factory):
    """{case: (exit status, stderr, its folder)}: the export command given each bad input,
    each in a folder of its own (out/ to write in, empty_run/ holding a run's config only)."""
    workdir = run_of("mlp")
    root = tmp_path_factory.mktemp("bad_input")
    folders, commands = [], []
    for i, case in enumerate(BAD_INPUTS):
        folder = root / str(i)
        out = folder / "out" / "model.onnx"
        out.parent.mkdir(parents=True)
        empty_run = folder / "empty_run"
        empty_run.mkdir()
        (empty_run / "config.json").write_text(Path(workdir, "config.json").read_text())
        args = {"no checkpoint": (empty_run, "--format=onnx", f"--out={out}"),
                "not a run": (folder / "nowhere", "--format=onnx", f"--out={out}"),
                "unknown format": (workdir, "--format=tflite", f"--out={out}"),
                "unwritable out": (workdir, "--format=onnx",
                                   f"--out={folder / 'missing' / 'm.onnx'}"),
                "out is a folder": (workdir, "--format=stablehlo", f"--out={out.parent}"),
                "unknown step": (workdir, "--format=onnx", f"--out={out}", "--checkpoint=7"),
                "opset too old": (workdir, "--format=onnx", f"--out={out}", "--opset=11")}[case]
        folders.append(folder)
        commands.append([str(arg) for arg in args])
    done = subprocess.run([sys.executable, "-c", COMMANDS, json.dumps(commands), str(root)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    statuses = json.loads(done.stdout.strip().splitlines()[-1])
    return {case: (status, (root / f"{i}.err").read_text(), folders[i])
            for i, (case, status) in enumerate(zip(BAD_INPUTS, statuses))}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_is_one_line_exit_2_and_writes_nothing(case, bad_input_results):
    status, stderr, folder = bad_input_results[case]
    assert status == 2, stderr[-2000:]
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr[-2000:]
    expected = {"no checkpoint": "no checkpoint in", "not a run": "not a jaxtrain run",
                "unknown format": "--format", "unwritable out": "no folder",
                "out is a folder": "is a folder", "unknown step": "saved steps: 2",
                "opset too old": "--opset=11: jax2onnx writes these models at opsets 13 to "
                                 "23"}[case]
    assert expected in lines[0]
    assert list((folder / "out").iterdir()) == [] and not (folder / "missing").exists()
