"""Your own model: docs/models.md's Linen and NNX examples, named in a config or passed in."""
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
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
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
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
        with pytest.raises(ValueError, match=r"pass it again: jaxtrain.restore\(workdir, "
                                              r"model=\.\.\.\)"):
            jaxtrain.restore(str(tmp_path / str(i)))
        restored = jaxtrain.restore(str(tmp_path / str(i)), model=module)
        assert restored.step == 10


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
