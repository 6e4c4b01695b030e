"""model.init_from: torchvision's and timm's weights give jaxtrain's models their logits;
heads re-initialised, wrong architectures and pickled code refused, frozen groups and
statistics untouched, workdirs as starting points, exact resume."""
import functools
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import require_module, small_models_main
from tolerances import ELEMENTWISE, TRAINING_STEPS
import fork_server

from jaxtrain.config.defaults import get_config, param_group
from jaxtrain.training import checkpoint, prepare, step
from jaxtrain.training.optim import param_path
from jaxtrain.weights import readers

REPO = Path(__file__).resolve().parents[1]
torch = require_module("torch", "pip install -e '.[weights]'")
torchvision = require_module("torchvision", "pip install -e '.[weights]'")


def upscaled(images, factor=2):
    return np.repeat(np.repeat(images, factor, 1), factor, 2)


@pytest.fixture(scope="module")
def arrays_64(tmp_path_factory, cifar_subset):
    """Real CIFAR-10 images at 64 px (2x nearest) as a data.name='arrays' file: 256
    training and 64 test images."""
    path = tmp_path_factory.mktemp("arrays64") / "cifar64.npz"
    np.savez(path, x_train=upscaled(cifar_subset["x_train"][:256]),
             y_train=cifar_subset["y_train"][:256],
             x_test=upscaled(cifar_subset["x_test"][:64]), y_test=cifar_subset["y_test"][:64])
    return path


def arrays_config(npz, model_name, init_from, **model):
    config = get_config()
    config.data.name = "arrays"
    config.data.dir = str(npz)
    config.model.name = model_name
    config.model.init_from = str(init_from)
    config.model.update(model)
    config.train.precision = "float32"
    config.train.batch_size = 32
    config.train.num_steps = 4
    return config


def randomised_statistics(module):
    """BatchNorm statistics and affine values away from their 0/1 init, so a mix-up of
    mean and var, or of scale and bias, shows in the logits."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                for tensor, (low, high) in ((m.running_mean, (-0.5, 0.5)),
                                            (m.running_var, (0.5, 2.0)),
                                            (m.weight, (0.5, 1.5)), (m.bias, (-0.2, 0.2))):
                    tensor.copy_(torch.rand(tensor.shape, generator=generator)
                                 * (high - low) + low)
    return module.eval()


@functools.lru_cache(maxsize=None)
def compiled_apply(model):
    """model.apply in inference mode, jitted once per model (equal models share it)."""
    return jax.jit(functools.partial(model.apply, train=False))


def jax_logits(run, images):
    """The run's logits of uint8 images, in one compiled program (op by op, a ResNet-50's
    forward pass takes 3x as long on the CPU)."""
    variables = {"params": run.state.params, "batch_stats": run.state.batch_stats}
    inputs = step.normalize(images, run.mean, run.std)
    return np.asarray(compiled_apply(run.model)(variables, inputs))


def torch_logits(module, images, mean, std):
    inputs = (images.astype(np.float32) / 255.0 - np.float32(mean)) / np.float32(std)
    with torch.no_grad():
        return module(torch.from_numpy(inputs.astype(np.float32).transpose(0, 3, 1, 2))).numpy()


def relative_error(ours, theirs):
    return float(np.abs(ours - theirs).max() / np.abs(theirs).max())


@pytest.mark.slow
@pytest.mark.parametrize("name", ["resnet18", "resnet50"])
def test_torchvision_resnets_give_their_logits(name, arrays_64, tmp_path, cifar_subset):
    torch.manual_seed(0)
    reference = randomised_statistics(getattr(torchvision.models, name)(weights=None,
                                                                        num_classes=10))
    path = tmp_path / f"{name}.pth"
    torch.save(reference.state_dict(), path)
    run = prepare.setup(arrays_config(arrays_64, name, path, stem="imagenet"))
    assert run.mean == readers.IMAGENET_MEAN and run.std == readers.IMAGENET_STD
    images = upscaled(cifar_subset["x_test"][:8])
    error = relative_error(jax_logits(run, images), torch_logits(reference, images, run.mean,
                                                                 run.std))
    assert error < TRAINING_STEPS
    tensors = len([k for k in reference.state_dict() if not k.endswith("num_batches_tracked")])
    assert run.init_from["tensors_loaded"] == tensors and run.init_from["reinitialised"] == []


def randomised_parameters(module):
    """Every float parameter of a timm ViT moved off its init (LayerNorm scales near 1,
    biases away from 0), so a swapped or untransposed tensor shows in the logits."""
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, tensor in module.named_parameters():
            noise = torch.randn(tensor.shape, generator=generator)
            tensor.copy_(1.0 + 0.1 * noise if name.endswith("norm1.weight") or name.endswith(
                "norm2.weight") or name == "norm.weight" else 0.05 * noise)
    return module.eval()


@pytest.mark.slow
def test_timm_resnet50_as_safetensors_gives_its_logits(arrays_64, tmp_path, cifar_subset):
    timm = pytest.importorskip("timm")
    from safetensors.torch import save_file
    torch.manual_seed(0)
    reference = randomised_statistics(timm.create_model("resnet50", pretrained=False,
                                                        num_classes=10))
    path = tmp_path / "resnet50.safetensors"
    save_file({k: v.contiguous() for k, v in reference.state_dict().items()}, str(path))
    run = prepare.setup(arrays_config(arrays_64, "resnet50", path, stem="imagenet"))
    images = upscaled(cifar_subset["x_test"][:8])
    assert relative_error(jax_logits(run, images),
                          torch_logits(reference, images, run.mean, run.std)) < TRAINING_STEPS


@pytest.fixture(scope="module")
def arrays_32(tmp_path_factory, cifar_subset):
    path = tmp_path_factory.mktemp("arrays32") / "cifar32.npz"
    np.savez(path, x_train=cifar_subset["x_train"][:256], y_train=cifar_subset["y_train"][:256],
             x_test=cifar_subset["x_test"][:64], y_test=cifar_subset["y_test"][:64])
    return path


@pytest.mark.slow
@pytest.mark.parametrize("suffix", [".pth", ".safetensors"])
def test_timm_vit_small_gives_its_logits(suffix, arrays_32, tmp_path, cifar_subset):
    timm = pytest.importorskip("timm")
    reference = randomised_parameters(timm.create_model(
        "vit_small_patch16_224", pretrained=False, img_size=32, num_classes=10))
    path = tmp_path / f"vit_small{suffix}"
    if suffix == ".pth":
        torch.save(reference.state_dict(), path)
    else:
        from safetensors.torch import save_file
        save_file({k: v.contiguous() for k, v in reference.state_dict().items()}, str(path))
    run = prepare.setup(arrays_config(arrays_32, "vit_small", path))
    images = cifar_subset["x_test"][:8]
    assert relative_error(jax_logits(run, images),
                          torch_logits(reference, images, run.mean, run.std)) < TRAINING_STEPS
    assert run.init_from["tensors_loaded"] == len(reference.state_dict())


@pytest.mark.slow
def test_a_vit_at_another_image_size_resamples_its_position_table(arrays_64, tmp_path):
    timm = pytest.importorskip("timm")
    reference = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32,
                                  num_classes=10)
    path = tmp_path / "vit_tiny.pth"
    torch.save(reference.state_dict(), path)
    run = prepare.setup(arrays_config(arrays_64, "vit_tiny", path))
    assert run.init_from["resampled"] == [
        {"tensor": "pos_embed", "weights": [1, 5, 192], "model": [1, 17, 192]}]
    from jaxtrain.models import vit
    np.testing.assert_allclose(
        np.asarray(run.state.params["pos_embed"]),
        vit.resample_pos_embed(reference.pos_embed.detach().numpy(), (4, 4)), rtol=ELEMENTWISE)


def run_main(*args):
    return fork_server.run([sys.executable, "main.py", *map(str, args)], cwd=REPO,
                           capture_output=True, text=True, timeout=600)


def run_main_small(*args):
    """run_main with the deep models cut to their smallest form (conftest.small_models_main)."""
    return fork_server.run(small_models_main(*args), cwd=REPO, capture_output=True, text=True,
                           timeout=600)


def small_torchvision_resnet(name):
    """torchvision's ResNet `name` (random init, ImageNet's 1000 classes) with one block a
    stage, as conftest.small_models_main cuts jaxtrain's."""
    from torchvision.models import resnet
    block = resnet.Bottleneck if name == "resnet50" else resnet.BasicBlock
    return resnet.ResNet(block, [1, 1, 1, 1])


SMALL_RUN = ("--config.data.name=arrays", "--config.train.num_steps=4",
             "--config.train.batch_size=32", "--config.eval.batch_size=64",
             "--config.train.precision=float32")


@pytest.fixture(scope="module")
def torchvision_resnet18_file(tmp_path_factory):
    """torchvision's ResNet-18 as its ImageNet weights come: 1000 classes (random init)."""
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tv") / "resnet18.pth"
    torch.save(torchvision.models.resnet18(weights=None).state_dict(), path)
    return path


@pytest.mark.slow
def test_another_architecture_is_one_line_and_writes_nothing(arrays_64, tmp_path,
                                                            torchvision_resnet18_file):
    workdir = tmp_path / "run"
    result = run_main("--config=configs/folder.py", f"--workdir={workdir}",
                      f"--config.data.dir={arrays_64}", "--config.model.name=resnet34",
                      f"--config.model.init_from={torchvision_resnet18_file}", *SMALL_RUN)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    message = result.stderr.strip().splitlines()[-1]
    # 64 px takes the CIFAR stem (3x3 conv) where the weights have ImageNet's 7x7, and
    # ResNet-34 has a third block in its first stage where ResNet-18 has two
    assert message.startswith(f"error: config.model.init_from='{torchvision_resnet18_file}' "
                              "does not fit model.name='resnet34': shapes differ: conv1.weight "
                              "is 64x3x7x7 there, params/Conv_0/kernel is 3x3x3x64 here; "
                              "missing in the weights: params/ResNetBlock_2/BatchNorm_0/bias "
                              "(64), ")
    assert not workdir.exists()


class WritesAFile:
    """A pickle that would create a file if it were ever unpickled with code allowed."""
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_pickled_object_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "ran"
    path = tmp_path / "evil.pth"
    with open(path, "wb") as f:
        torch.save({"conv1.weight": torch.zeros(1), "extra": WritesAFile(str(marker))}, f)
    with pytest.raises(readers.WeightsError, match="refused, it holds pickled objects other "
                                                   "than tensors"):
        readers.read(readers.source(str(path)))
    assert not marker.exists()
    not_a_state_dict = tmp_path / "list.pth"
    torch.save([torch.zeros(2)], not_a_state_dict)
    with pytest.raises(readers.WeightsError, match="holds a list, not a state_dict of tensors"):
        readers.read(readers.source(str(not_a_state_dict)))
    damaged = tmp_path / "damaged.pth"
    damaged.write_bytes(path.read_bytes()[:100])
    with pytest.raises(readers.WeightsError, match="not a readable PyTorch file"):
        readers.read(readers.source(str(damaged)))


def test_a_missing_source_fails_before_the_data_loads(tmp_path):
    config = get_config()
    config.data.dir = str(tmp_path / "no_data_here")
    config.model.name = "resnet18"
    config.model.init_from = str(tmp_path / "nothing.pth")
    with pytest.raises(readers.WeightsError, match="no such file or directory"):
        prepare.setup(config)


# ---------------------------------------------------------------- a jaxtrain run as the start

SEED_RUN = ("--config=configs/cifar_seed_cnn.py", "--config.model.batch_norm=True",
            "--config.train.batch_size=32",
            "--config.eval.batch_size=100", "--config.data.source=files")


@pytest.fixture(scope="module")
def cifar_workdir(tmp_path_factory, cifar_batches_dir):
    """A finished 20-step seed-CNN run on real CIFAR-10 (10 classes): SEED_RUN's, trained
    in this process (a process of its own took ~2.5 s more to start)."""
    from configs import cifar_seed_cnn
    from jaxtrain.run import loop
    config = cifar_seed_cnn.get_config()
    config.model.batch_norm = True
    config.train.batch_size = 32
    config.eval.batch_size = 100
    config.data.source = "files"
    config.data.dir = str(cifar_batches_dir)
    config.train.num_steps = 20
    workdir = tmp_path_factory.mktemp("source") / "cifar"
    loop.train_and_evaluate(config, str(workdir))
    return workdir


@pytest.fixture(scope="module")
def five_class_folder(tmp_path_factory, cifar_jpeg_folder):
    """The real-JPEG CIFAR folder with only its first five classes."""
    import shutil
    root = tmp_path_factory.mktemp("five") / "photos"
    for split in ("train", "test"):
        for name in sorted(os.listdir(cifar_jpeg_folder / split))[:5]:
            shutil.copytree(cifar_jpeg_folder / split / name, root / split / name)
    return root


def folder_config(folder, init_from):
    config = get_config()
    config.data.name = "folder"
    config.data.dir = str(folder)
    config.model.name = "seed_cnn"
    config.model.batch_norm = True
    config.model.init_from = str(init_from)
    config.train.batch_size = 32
    return config


@pytest.mark.slow
def test_a_run_whose_arrays_are_cut_short_is_one_line_in_a_real_process(
        cifar_workdir, cifar_batches_dir, tmp_path):
    """model.init_from a run whose checkpoint's array files were cut short (its metadata
    whole): one line naming TensorStore's error (exit 2), none of the reports of the
    reads Orbax abandons, and the source run as it was."""
    import shutil
    source = tmp_path / "cifar"
    shutil.copytree(cifar_workdir, source)
    step_dir = readers.jaxtrain_step_dir(str(source), "")
    arrays = [p for p in Path(step_dir, "state").rglob("*") if p.is_file() and p.parent.name == "d"]
    assert len(arrays) > 1
    for path in arrays:
        path.write_bytes(path.read_bytes()[:100])
    before = {str(p): p.stat().st_size for p in source.rglob("*")}
    done = run_main("--config=configs/cifar_seed_cnn.py", f"--workdir={tmp_path / 'new'}",
                    "--config.data.source=files", f"--config.data.dir={cifar_batches_dir}",
                    "--config.model.batch_norm=True", f"--config.model.init_from={source}")
    assert done.returncode == 2, done.stderr[-3000:]
    assert re.fullmatch(rf"error: config.model.init_from='{source}': checkpoint {step_dir} "
                        r"cannot be read \((ValueError|OSError): [^\n]+\)\n", done.stderr), \
        done.stderr[-3000:]
    assert {str(p): p.stat().st_size for p in source.rglob("*")} == before


@pytest.mark.slow
def test_a_cifar_run_starts_a_five_class_folder_run(cifar_workdir, five_class_folder):
    run = prepare.setup(folder_config(five_class_folder, cifar_workdir))
    source = readers.read_jaxtrain(readers.jaxtrain_step_dir(str(cifar_workdir), ""), "")
    flat = {f"{c}/{param_path(p)}": np.asarray(leaf)
            for c, tree in (("params", run.state.params), ("batch_stats", run.state.batch_stats))
            for p, leaf in jax.tree_util.tree_leaves_with_path(tree)}
    head = [k for k in flat if k.startswith("params/Dense_2/")]
    assert sorted(head) == ["params/Dense_2/bias", "params/Dense_2/kernel"]
    assert flat["params/Dense_2/kernel"].shape == (84, 5)
    for key, value in flat.items():
        if key not in head:
            np.testing.assert_array_equal(value, source[key], err_msg=key)
    assert run.init_from["tensors_loaded"] == len(flat) - 2
    assert run.init_from["reinitialised"] == [
        {"tensor": "Dense_2", "weights": [84, 10], "model": [84, 5]}]
    # the source run's normalisation comes with its weights
    meta = json.loads((Path(readers.jaxtrain_step_dir(str(cifar_workdir), ""))
                       / "meta" / "metadata").read_text())
    assert run.mean == tuple(meta["mean"]) and run.std == tuple(meta["std"])


@pytest.mark.slow
def test_init_from_is_read_at_step_0_only_and_resume_stays_exact(cifar_workdir,
                                                                  cifar_batches_dir, tmp_path):
    import shutil
    source = tmp_path / "source"
    shutil.copytree(cifar_workdir, source)
    flags = (*SEED_RUN, f"--config.data.dir={cifar_batches_dir}", f"--config.model.init_from={source}",
             "--config.train.num_steps=200", "--config.checkpoint.every_steps=50",
             "--config.eval.every_epochs=0")
    reference = run_main(*flags, f"--workdir={tmp_path / 'reference'}")
    assert reference.returncode == 0, reference.stderr[-2000:]
    workdir = tmp_path / "killed"
    first = fork_server.Popen([sys.executable, "main.py", *flags, f"--workdir={workdir}"],
                              cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 300
    while not checkpoint.saved_steps(str(workdir / "checkpoints")):
        assert first.poll() is None and time.time() < deadline, first.communicate()
        time.sleep(0.05)
    first.send_signal(signal.SIGKILL)
    first.wait()
    shutil.rmtree(source)  # a resumed run reads no weights
    rerun = run_main(*flags, f"--workdir={workdir}")
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert "resumed from checkpoint step" in rerun.stdout
    summaries = [json.loads((tmp_path / name / "summary.json").read_text())
                 for name in ("reference", "killed")]
    assert summaries[1]["resumed_from_step"] > 0
    assert summaries[0]["params_sha256"] == summaries[1]["params_sha256"]
    assert summaries[1]["init_from"] == summaries[0]["init_from"]  # kept in the checkpoint
    changed = run_main(*flags, f"--config.model.init_from={cifar_workdir}",
                       f"--workdir={workdir}")
    assert changed.returncode == 2
    assert f"(model.init_from: '{source}' -> '{cifar_workdir}')" in changed.stderr


# ---------------------------------------------------------------- freezing

def frozen_backbone_config(folder, init_from, workdir_steps=10):
    config = folder_config(folder, init_from)
    config.train.num_steps = workdir_steps
    config.eval.every_epochs = 0
    config.optimizer.groups.backbone = param_group(r"(?!Dense_2/).*", freeze=True)
    config.optimizer.groups.head = param_group(r"Dense_2/.*", lr_scale=10.0)
    return config


@pytest.mark.slow
def test_a_frozen_group_is_bitwise_unchanged_and_keeps_no_optimiser_state(
        cifar_workdir, five_class_folder, tmp_path):
    from jaxtrain.run import loop
    config = frozen_backbone_config(five_class_folder, cifar_workdir)
    config.model.freeze_batch_stats = True
    start = prepare.setup(config)
    backbone = jax.tree.leaves(start.state.opt_state.inner_states["backbone"])
    head = jax.tree.leaves(start.state.opt_state.inner_states["head"])
    assert backbone == []
    assert sorted(leaf.shape for leaf in head if leaf.ndim) == [(5,), (84, 5)]  # momentum
    loop.train_and_evaluate(config, str(tmp_path / "run"))
    end = readers.read_jaxtrain(readers.jaxtrain_step_dir(str(tmp_path / "run"), ""), "")
    assert int(json.loads((Path(readers.jaxtrain_step_dir(str(tmp_path / "run"), ""))
                           / "meta" / "metadata").read_text())["step"]) == 10
    for key, value in jax.tree_util.tree_leaves_with_path(start.state.params):
        path = "params/" + param_path(key)
        if path.startswith("params/Dense_2/"):
            assert not np.array_equal(end[path], np.asarray(value)), path  # trained
        else:
            assert np.asarray(value).tobytes() == end[path].tobytes(), path
    statistics = jax.tree_util.tree_leaves_with_path(start.state.batch_stats)
    assert len(statistics) == 8  # mean and var of four BatchNorm layers
    for key, value in statistics:
        path = "batch_stats/" + param_path(key)
        assert np.asarray(value).tobytes() == end[path].tobytes(), path


@pytest.mark.slow
def test_without_freezing_the_statistics_move(cifar_workdir, five_class_folder, tmp_path):
    from jaxtrain.run import loop
    config = frozen_backbone_config(five_class_folder, cifar_workdir, workdir_steps=2)
    start = prepare.setup(config)
    loop.train_and_evaluate(config, str(tmp_path / "run"))
    end = readers.read_jaxtrain(readers.jaxtrain_step_dir(str(tmp_path / "run"), ""), "")
    moved = [param_path(k) for k, v in
             jax.tree_util.tree_leaves_with_path(start.state.batch_stats)
             if not np.array_equal(np.asarray(v), end["batch_stats/" + param_path(k)])]
    assert len(moved) == 8


# ---------------------------------------------------------------- compare: the same start

@pytest.mark.slow
def test_the_pytorch_twin_starts_from_the_same_weights(arrays_64, torchvision_resnet18_file,
                                                       cifar_subset):
    from jaxtrain.baselines import runner
    config = arrays_config(arrays_64, "resnet18", torchvision_resnet18_file, stem="imagenet")
    config.optimizer.groups.backbone = param_group(r"(?!Dense_0/).*", freeze=True)
    config.model.freeze_batch_stats = True
    run = prepare.setup(config)
    initial = {"params": run.state.params, "batch_stats": run.state.batch_stats}
    model, optimizer, _ = runner.torch_recipe(config, run.dataset, "cpu", 4, initial=initial)
    model.train()  # frozen statistics: BatchNorm stays in eval mode
    images = upscaled(cifar_subset["x_test"][:8])
    assert relative_error(torch_logits(model, images, run.mean, run.std),
                          jax_logits(run, images)) < TRAINING_STEPS
    trained = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert sorted(p.shape for p in model.parameters() if id(p) in trained) == [
        (10,), (10, 512)]  # the head only


# ---------------------------------------------------------------- the README's recipes

@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["finetune", "finetune_vit"])
def test_the_fine_tuning_recipes_run_as_the_readme_says(recipe, five_class_folder, tmp_path):
    """configs/finetune.py and configs/finetune_vit.py on a five-class folder, from local
    random-init copies of the weights they name (no network in tests), a few steps at a
    small size, the models cut to their smallest form (run_main_small: ResNet-50 with one
    bottleneck a stage, ViT-S with two blocks; the files alike); the linear probe's flags
    on the ResNet. A new class count re-initialises the head and says so, in a line and in
    summary.json."""
    torch.manual_seed(0)
    if recipe == "finetune":
        start = tmp_path / "resnet50.pth"
        torch.save(small_torchvision_resnet("resnet50").state_dict(), start)
        extra = ("--config.data.image_size=64", "--config.optimizer.groups.backbone.freeze=True",
                 "--config.model.freeze_batch_stats=True")
        # 265 tensors in the whole ResNet-50; with one block a stage: the stem's conv and BN
        # (5), four bottlenecks of three convs and BNs and a projection (4 x 20)
        head, loaded = {"tensor": "Dense_0", "weights": [2048, 1000], "model": [2048, 5]}, 85
    else:
        timm = pytest.importorskip("timm")
        from safetensors.torch import save_file
        start = tmp_path / "vit_small.safetensors"
        save_file(timm.create_model("vit_small_patch16_224", pretrained=False, img_size=32,
                                    depth=2).state_dict(), str(start))
        extra = ("--config.data.image_size=32",)
        # 150 with twelve blocks: 6 outside them (patch conv's 2, cls token, position table,
        # final norm's 2), 12 in each
        head, loaded = {"tensor": "head", "weights": [384, 1000], "model": [384, 5]}, 6 + 2 * 12
    workdir = tmp_path / "run"
    result = run_main_small(f"--config=configs/{recipe}.py",
                            f"--config.data.dir={five_class_folder}", f"--workdir={workdir}",
                            f"--config.model.init_from={start}", *extra,
                            "--config.train.num_steps=2", "--config.train.batch_size=16",
                            "--config.eval.batch_size=50", "--config.train.precision=float32")
    assert result.returncode == 0, result.stderr[-3000:]
    line = (f"initialised from {start}: {loaded} tensors loaded; re-initialised head "
            f"{head['tensor']} ({'x'.join(map(str, head['weights']))} -> "
            f"{'x'.join(map(str, head['model']))})")
    assert line in result.stdout, result.stdout[-3000:]
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["init_from"]["reinitialised"] == [head]
    assert summary["init_from"]["tensors_loaded"] == loaded
    assert summary["steps"] == 2 and summary["test_accuracy"] >= 0


@pytest.mark.slow
def test_init_from_exclude_keeps_a_fresh_head_of_the_same_shape(cifar_workdir, cifar_subset,
                                                                 tmp_path):
    """Ten new classes for ten old ones: the shapes match, so only model.init_from_exclude
    gives the new task a fresh head."""
    npz = tmp_path / "cifar.npz"
    np.savez(npz, **{k: cifar_subset[k][:256] for k in ("x_train", "y_train", "x_test",
                                                         "y_test")})
    config = arrays_config(npz, "seed_cnn", cifar_workdir, batch_norm=True,
                           init_from_exclude=r"Dense_2/.*")
    run = prepare.setup(config)
    assert run.init_from["reinitialised"] == [
        {"tensor": "Dense_2", "weights": [84, 10], "model": [84, 10]}]
    source = readers.read_jaxtrain(readers.jaxtrain_step_dir(str(cifar_workdir), ""), "")
    assert not np.array_equal(np.asarray(run.state.params["Dense_2"]["kernel"]),
                              source["params/Dense_2/kernel"])
    np.testing.assert_array_equal(np.asarray(run.state.params["Dense_1"]["kernel"]),
                                  source["params/Dense_1/kernel"])
    config.model.init_from_exclude = "Head/.*"
    with pytest.raises(readers.WeightsError, match=r"init_from_exclude='Head/\.\*' matches no "
                                                   "parameter"):
        prepare.setup(config)


def test_the_committed_transfer_measurement_holds_every_way_over_its_seeds():
    result = json.loads((REPO / "benchmarks" / "results" / "transfer_cpu.json").read_text())
    for way in ("scratch", "finetune", "frozen"):
        values = result[f"{way}_accuracy"]
        assert len(values) == len(result["seeds"]) == 3 and all(0 < v < 1 for v in values)
        assert result[f"{way}_accuracy_mean"] == pytest.approx(np.mean(values))
    assert result["target_train_images"] == 1000 and result["target_test_images"] == 5000


def test_a_run_saved_before_freeze_existed_resumes_and_freezing_it_is_a_change():
    from jaxtrain.config import checks
    config = get_config()
    config.optimizer.groups.head = param_group(r"Dense_0/.*", lr_scale=10.0)
    saved = config.to_dict()
    del saved["optimizer"]["groups"]["head"]["freeze"]  # as param_group wrote it before
    assert checks.recipe_changes(saved, config) == []
    config.optimizer.groups.head.freeze = True
    assert checks.recipe_changes(saved, config) == [
        ("optimizer.groups.head.freeze", "(not set)", True)]


def finetune(folder, workdir, *overrides):
    """The README's fine-tuning command on `folder`, as a user types it."""
    return fork_server.run([sys.executable, "main.py", "--config=configs/finetune.py",
                           f"--config.data.dir={folder}", f"--workdir={workdir}", *overrides],
                           cwd=REPO, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_the_finetune_recipe_offline_says_how_to_get_the_weights(cifar_jpeg_folder, tmp_path):
    """No network (the tests' mirror is a closed port): one line that names the mirror
    variable and passing the downloaded file, and nothing trained."""
    done = finetune(cifar_jpeg_folder, tmp_path / "run", "--config.model.name=resnet18",
                    "--config.model.init_from=torchvision:resnet18")
    assert done.returncode == 1, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert "set $JAXTRAIN_DOWNLOAD_MIRROR to a mirror serving weights/torchvision/" in errors[0]
    assert "model.init_from=/path/to/resnet18-f37072fd.pth" in errors[0]
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.slow
def test_bfloat16_asked_of_a_convolutional_model_on_a_cpu_is_said_to_be_slow(cifar_jpeg_folder,
                                                                           tmp_path):
    """configs/finetune.py's train.precision='auto' is float32 on a CPU, said in one line;
    bfloat16 asked for is honoured, and one line says it is many times slower there and
    names the flag (float32, or a model without convolutions: no line). The run is the
    recipe's with the smallest convolutional model, seed_cnn (the line is the same for
    every one: checked against ResNet-18's below): bfloat16 convolutions compile and run
    slowly on a CPU, a ResNet's took twice the time of this whole test."""
    from jaxtrain.run import start
    done = finetune(cifar_jpeg_folder, tmp_path / "bf16", "--config.model.name=seed_cnn",
                    "--config.model.init_from=", "--config.data.image_size=32",
                    "--config.train.num_steps=1", "--config.train.batch_size=16",
                    "--config.eval.tta=none", "--config.train.precision=bfloat16")
    assert done.returncode == 0, done.stderr[-2000:]
    notes = [line for line in done.stdout.splitlines() if "train.precision='bfloat16'" in line]
    assert len(notes) == 1 and "--config.train.precision=float32" in notes[0], done.stdout
    assert json.loads((tmp_path / "bf16" / "summary.json").read_text())["precision"] == "bfloat16"
    assert start.precision_note("float32", "resnet18") is None
    assert start.precision_note("bfloat16", "mlp") is None
    assert start.precision_note("bfloat16", "seed_cnn") == notes[0]
    assert start.precision_note("bfloat16", "resnet18") == notes[0]
    assert start.precision_note("auto", "resnet18").startswith(
        "train.precision='auto': float32 on cpu (")


@pytest.mark.slow
def test_weights_named_for_another_model_say_which_key_to_add(cifar_jpeg_folder, tmp_path):
    """configs/finetune.py is ResNet-50's: ResNet-18's weights alone stop the run before
    any download, with the key that picks the model they are for."""
    done = finetune(cifar_jpeg_folder, tmp_path / "run",
                    "--config.model.init_from=torchvision:resnet18")
    assert done.returncode == 2, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: config.model.init_from='torchvision:resnet18' are weights for "
                      "model.name='resnet18', not 'resnet50': add "
                      "--config.model.name=resnet18"], done.stderr[-2000:]
