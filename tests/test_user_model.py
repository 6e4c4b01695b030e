"""Your own model: docs/models.md's Linen and NNX examples, named in a config or passed in."""
import json
import os
import re
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
import fork_server
from conftest import require_module
from tolerances import TRAINING_STEPS
from overrides import with_overrides

import jaxtrain
from configs import cifar_seed_cnn
from jaxtrain import models
from jaxtrain.baselines import runner
from jaxtrain.models import user

REPO = Path(__file__).resolve().parents[1]


def readme_example() -> str:
    """docs/models.md's example module (the code block that starts with '# mynets.py')."""
    blocks = re.findall(r"```python\n(.*?)```", (REPO / "docs" / "models.md").read_text(), re.S)
    found = [b for b in blocks if b.startswith("# mynets.py")]
    assert len(found) == 1, "docs/models.md must hold one ```python block starting '# mynets.py'"
    return found[0]


@pytest.fixture(scope="module")
def mynets(tmp_path_factory, monkeypatch_module):
    """docs/models.md's example written as mynets.py, importable (sys.path) in this process."""
    folder = tmp_path_factory.mktemp("mynets")
    (folder / "mynets.py").write_text(readme_example())
    monkeypatch_module.syspath_prepend(str(folder))
    return folder


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def small_config(data_dir, name, **overrides):
    config = cifar_seed_cnn.get_config()
    return with_overrides(config, {"data__dir": str(data_dir), "data__source": "files",
                                   "model__name": name, "train__batch_size": 50,
                                   "train__num_steps": 30, "eval__batch_size": 250,
                                   **overrides})


@pytest.mark.slow
def test_an_imported_model_trains_and_restores_in_a_fresh_process(mynets, cifar_batches_dir,
                                                                  tmp_path):
    config = small_config(cifar_batches_dir, "mynets:TinyNNX")  # NNX, through Flax's bridge
    summary = jaxtrain.train_and_evaluate(config, str(tmp_path))
    assert summary["steps"] == 30 and np.isfinite(summary["test_loss"])
    # TinyNet: conv 3->16 and 16->32 (3x3, with bias), BatchNorm scale+bias, dense 32->10
    assert summary["param_count"] == (27 * 16 + 16) + 32 + (144 * 32 + 32) + 64 + (32 * 10 + 10)
    code = (f"import jaxtrain, numpy as np; c = jaxtrain.restore({str(tmp_path)!r}); "
            "labels, p = c.predict(np.zeros((2, 32, 32, 3), np.uint8)); "
            "print(c.step, labels.shape, p.shape)")
    result = fork_server.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                             text=True, timeout=300,
                             env={**__import__("os").environ, "PYTHONPATH": f"{mynets}:{REPO}"})
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split()[0] == "30"


@pytest.mark.slow
def test_a_module_instance_trains_through_the_python_api(mynets, cifar_batches_dir, tmp_path):
    import flax.nnx as nnx
    import mynets as example

    config = small_config(cifar_batches_dir, "cifar_cnn", train__num_steps=10)
    assert models.create_model(small_config("/nowhere", "mynets:TinyNet").model, 10,
                               np.float32).width == 16  # the Linen class, by name
    for i, module in enumerate((example.TinyNet(num_classes=10, width=8),
                                example.TinyNNX(num_classes=10, width=8, rngs=nnx.Rngs(0)))):
        summary = jaxtrain.train_and_evaluate(config, str(tmp_path / str(i)), model=module)
        assert summary["steps"] == 10
        assert summary["param_count"] == (27 * 8 + 8) + 16 + (72 * 16 + 16) + 32 + (16 * 10 + 10)
        restored = jaxtrain.restore(str(tmp_path / str(i)), model=module)
        assert restored.step == 10
        images = np.zeros((2, 32, 32, 3), np.uint8)
        if isinstance(module, example.TinyNet):  # a Linen instance records its fields
            by_class = jaxtrain.restore(str(tmp_path / str(i)))  # TinyNet(width=8) again
            np.testing.assert_array_equal(by_class.predict(images)[1],
                                          restored.predict(images)[1])
        else:  # an NNX instance does not: its class with width=16 does not fit
            with pytest.raises(jaxtrain.CheckpointError, match=(
                    r"does not fit this model: .* a model passed from Python "
                    r"\(mynets:TinyNNX\), which its class as built here is not: pass it "
                    r"again: jaxtrain.restore\(workdir, model=\.\.\.\), or on the command "
                    r"line --model=package.module:ClassName$")):
                jaxtrain.restore(str(tmp_path / str(i)))


@pytest.mark.slow
def test_predict_and_export_take_the_class_of_a_model_passed_from_python(
        mynets, cifar_batches_dir, cifar_subset, tmp_path):
    """A run given an NNX instance of a class defined where the commands cannot import it
    (trainer_nets, the training script's module): predict and export say how to pass the
    class (--model), and with it give restore's probabilities."""
    import importlib.util

    import flax.nnx as nnx
    spec = importlib.util.spec_from_file_location("trainer_nets", mynets / "mynets.py")
    trainer_nets = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(trainer_nets)
    workdir = tmp_path / "run"
    config = small_config(cifar_batches_dir, "cifar_cnn", train__num_steps=10)
    jaxtrain.train_and_evaluate(config, str(workdir), model=trainer_nets.TinyNNX(rngs=nnx.Rngs(0)))
    from PIL import Image
    photo, image = tmp_path / "photo.png", cifar_subset["x_test"][0]
    Image.fromarray(image).save(photo)
    env = {**os.environ, "PYTHONPATH": f"{mynets}:{REPO}"}

    def command(*args):
        return fork_server.run([sys.executable, *args], cwd=REPO, capture_output=True,
                               text=True, timeout=300, env=env)
    failed = command("-m", "jaxtrain.predict", str(workdir), str(photo))
    assert failed.returncode == 2 and failed.stderr.strip().splitlines() == [
        "error: this run trained a model passed from Python (trainer_nets:TinyNNX), whose "
        "class cannot be imported here (model.name='trainer_nets:TinyNNX': cannot import "
        "'trainer_nets' (No module named 'trainer_nets'); it must be installed or on sys.path "
        "(e.g. PYTHONPATH)): pass it again: jaxtrain.restore(workdir, model=...), or on the "
        "command line --model=package.module:ClassName"]
    predicted = command("-m", "jaxtrain.predict", str(workdir), str(photo), "--json",
                        "--model=mynets:TinyNNX")
    assert predicted.returncode == 0, predicted.stderr[-2000:]
    top = json.loads(predicted.stdout)["top"]
    out = tmp_path / "model.onnx"
    exported = command("-m", "jaxtrain.export", str(workdir), "--format=onnx", f"--out={out}",
                       "--model=mynets:TinyNNX")
    assert exported.returncode == 0, exported.stderr[-2000:]
    onnxruntime = require_module("onnxruntime", "pip install -e '.[export]'")
    probabilities = onnxruntime.InferenceSession(str(out)).run(None, {"images": image[None]})[0]
    for entry in top:  # the same weights through both commands (onnxruntime's and XLA's)
        assert entry["probability"] == pytest.approx(float(probabilities[0, entry["label"]]),
                                                     abs=TRAINING_STEPS)
    assert top[0]["probability"] >= probabilities.max() - TRAINING_STEPS


def test_bad_model_names_say_what_is_wrong(mynets):
    cases = {"nosuchpackage:Net": r"cannot import 'nosuchpackage'",
             "mynets:Nope": r"module 'mynets' has no 'Nope'",
             "mynets:nn": r"not a Flax Linen or NNX module class",
             "mynets:": r"expected 'package.module:ClassName'"}
    for name, message in cases.items():
        with pytest.raises(ValueError, match=message):
            models.create_model(small_config("/nowhere", name).model, 10, np.float32)


def test_compare_refuses_a_model_without_a_twin(mynets, cifar_batches_dir, tmp_path):
    config = small_config(cifar_batches_dir, "mynets:TinyNet")
    assert runner.torch_unsupported(config) == [
        "model.name='mynets:TinyNet' (your own model has no PyTorch twin)"]
    assert user.is_user_model("a.b:C") and not user.is_user_model("resnet18")


# Models whose init needs a random stream besides 'params' (dropout built with `rngs`), and
# one with a bug of its own: docs/models.md's forms, written as dropnets.py.
DROPNETS = '''
import flax.linen as nn
from flax import nnx


class DropNNX(nnx.Module):
    def __init__(self, num_classes: int, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(32 * 32 * 3, 32, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)  # takes the 'dropout' stream at init
        self.head = nnx.Linear(32, num_classes, rngs=rngs)

    def __call__(self, x, train: bool = False):
        x = nnx.relu(self.hidden(x.reshape(x.shape[0], -1)))
        return self.head(self.dropout(x, deterministic=not train))


class DropLinen(nn.Module):
    num_classes: int

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.relu(nn.Dense(32)(x.reshape(x.shape[0], -1)))
        return nn.Dense(self.num_classes)(nn.Dropout(0.5, deterministic=not train)(x))


class Misspelt(nn.Module):
    num_classes: int

    @nn.compact
    def __call__(self, x, train: bool = False):
        return nn.Dense(self.num_classes)(x.reshape(x.shape[0], -1)) * scael  # noqa: F821
'''


@pytest.fixture(scope="module")
def dropnets(tmp_path_factory, monkeypatch_module):
    folder = tmp_path_factory.mktemp("dropnets")
    (folder / "dropnets.py").write_text(DROPNETS)
    monkeypatch_module.syspath_prepend(str(folder))
    import dropnets
    return dropnets


@pytest.mark.slow
def test_models_with_dropout_train_by_name_and_by_instance(dropnets, cifar_batches_dir,
                                                           tmp_path):
    """nnx.Dropout built with the module's rngs needs a 'dropout' stream at init (it was a
    KeyError blamed on the image size); Linen's nn.Dropout needs one in training only. Each
    trains by name and as an instance, and its training steps do drop: the same state
    evaluated twice agrees, trained twice with two keys does not."""
    import flax.nnx as nnx
    config = small_config(cifar_batches_dir, "cifar_cnn", train__num_steps=4,
                          model__batch_norm=False)
    instances = {"DropNNX": dropnets.DropNNX(num_classes=10, rngs=nnx.Rngs(0)),
                 "DropLinen": dropnets.DropLinen(num_classes=10)}
    for name, instance in instances.items():
        config.model.name = f"dropnets:{name}"
        by_name = jaxtrain.train_and_evaluate(config, str(tmp_path / name))
        config.model.name = "cifar_cnn"
        given = jaxtrain.train_and_evaluate(config, str(tmp_path / f"{name}_instance"),
                                            model=instance)
        for summary in (by_name, given):
            assert summary["steps"] == 4 and np.isfinite(summary["test_loss"]), name
        assert by_name["param_count"] == given["param_count"] == 3072 * 32 + 32 + 32 * 10 + 10
        restored = jaxtrain.restore(str(tmp_path / name))
        variables = {"params": restored.state.params}
        images = np.random.default_rng(0).normal(size=(8, 32, 32, 3)).astype(np.float32)
        apply = restored.state.apply_fn
        assert np.array_equal(apply(variables, images), apply(variables, images))
        dropped = [apply(variables, images, train=True, rngs={"dropout": jax.random.key(k)})
                   for k in (1, 2)]
        assert not np.allclose(dropped[0], dropped[1]), name


def training_logits(model, variables, images, seeds):
    """The model's training-mode logits under each seed's dropout key (one compiled call)."""
    def logits(variables, key):
        return model.apply(variables, images, train=True, rngs={"dropout": key})
    keys = jax.numpy.stack([jax.random.key(seed) for seed in seeds])
    return np.asarray(jax.jit(jax.vmap(logits, in_axes=(None, 0)))(variables, keys))


def test_an_nnx_instance_draws_its_dropout_masks_from_the_steps_key(dropnets):
    """An NNX instance's nnx.Dropout keeps the stream of the Rngs it was built with, which
    the bridge does not carry from one call to the next: it dropped the same units at
    every step. Its masks come from the step's 'dropout' key, as its class's by name do,
    and with the same parameters they are the same masks."""
    import flax.nnx as nnx
    instance = dropnets.DropNNX(num_classes=10, rngs=nnx.Rngs(0))
    given = user.from_instance(instance)
    by_name = models.create_model(small_config("/nowhere", "dropnets:DropNNX").model, 10,
                                  np.float32)
    given_variables = models.init_variables(given, jax.random.key(0), (32, 32, 3))
    by_name_variables = models.init_variables(by_name, jax.random.key(0), (32, 32, 3))
    np.testing.assert_array_equal(given_variables["params"]["head"]["kernel"],
                                  instance.head.kernel[...])  # the instance's own
    images = np.random.default_rng(0).normal(size=(4, 32, 32, 3)).astype(np.float32)
    seeds = (1, 2, 3, 1)
    logits = {"instance": training_logits(given, given_variables, images, seeds),
              "by name": training_logits(by_name, by_name_variables, images, seeds)}
    for name, dropped in logits.items():
        np.testing.assert_array_equal(dropped[0], dropped[3], err_msg=name)
        for i, j in ((0, 1), (0, 2), (1, 2)):
            assert not np.allclose(dropped[i], dropped[j]), (name, seeds[i], seeds[j])
    np.testing.assert_array_equal(training_logits(given, by_name_variables, images, seeds),
                                  logits["by name"])


def test_a_models_own_error_keeps_its_traceback_and_a_misfit_is_one_line(dropnets):
    """A NameError inside the user's model is raised as it is, with its traceback; only
    shapes that do not fit become the config message naming the key."""
    from jaxtrain import ConfigError
    from jaxtrain.training import model_state
    config = small_config("/nowhere", "dropnets:Misspelt").model
    model = models.create_model(config, 10, np.float32)
    with pytest.raises(NameError, match="scael") as raised:
        model_state.abstract_init(model, config, (32, 32, 3))
    assert any(entry.name == "__call__" and str(entry.path).endswith("dropnets.py")
               for entry in raised.traceback)
    config = small_config("/nowhere", "cifar_cnn", model__widths=(8,) * 6).model
    with pytest.raises(ConfigError, match=r"config.model.widths=\(8, 8, 8, 8, 8, 8\): cifar_cnn "
                                          r"halves the image once per block: 6 blocks are too "
                                          r"many for 32x32x3 images"):
        model_state.abstract_init(models.create_model(config, 10, np.float32), config, (32, 32, 3))
