"""jaxtrain against its PyTorch twins, on a real CIFAR-10 subset (2,000 train / 500 test)."""
import functools
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import fork_server
import torch  # in requirements.txt: these tests must run, not skip
from tolerances import (BFLOAT16_STEPS, ELEMENTWISE, NETWORK_PASS, TRAINING_STEPS,
                        WHITENING)

from configs import cifar, cifar_seed_cnn, cifar_speedrun, default
from jaxtrain import data, models
from jaxtrain.baselines import runner, torch_models, torch_optim
from jaxtrain.models import whitening
from jaxtrain.training import augment, evaluation, model_state, optim, prepare, train_state
from jaxtrain.training import inputs as inputs_lib
from jaxtrain.training import step as step_lib
from overrides import with_overrides

REPO = Path(__file__).resolve().parents[1]


def seed_config(data_dir, **overrides):
    config = cifar_seed_cnn.get_config()
    config.data.dir = str(data_dir)
    config.data.source = "files"
    config.train.batch_size = 50
    config.train.num_steps = 20
    config.eval.batch_size = 200  # 500 test images: the last batch is short
    return with_overrides(config, overrides)


def model_config(name, **overrides):
    config = default.get_config().model
    config.name = name
    config.update(overrides)
    return config


@pytest.fixture(scope="module")
def comparison(cifar_batches_dir, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("compare")
    config = seed_config(cifar_batches_dir, augment__flip=True, augment__translate=2,
                         eval__tta="flip_translate")
    return workdir, runner.run(config, runner.FRAMEWORKS, str(workdir))


@pytest.mark.slow
def test_all_three_frameworks_run_and_write_json_and_plot(comparison):
    workdir, output = comparison
    written = json.loads((workdir / runner.JSON_FILE).read_text())
    assert [r["framework"] for r in written["results"]] == list(runner.FRAMEWORKS)
    assert written["param_count"] == 62006 and written["steps"] == 20
    for row in written["results"]:
        for key in ("device", "warmup_seconds", "train_seconds", "eval_seconds",
                    "images_per_second", "test_accuracy", "test_loss", "precision", "version"):
            assert key in row, (row["framework"], key)
        assert row["param_count"] == 62006
        assert row["steps"] == 20 and row["examples_seen"] == 1000
        assert 0 <= row["test_accuracy"] <= 1
        assert 1.5 < row["test_loss"] < 3.5  # 20 steps at lr 0.001: near ln(10)
        assert row["train_seconds"] > row["eval_seconds"] > 0 and row["images_per_second"] > 0
        assert len(row["curve"]) == 1 and row["curve"][0]["seconds"] > 0
    assert (workdir / "jax" / "summary.json").exists()
    assert (workdir / runner.PLOT_FILE).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The same treatment of first-run costs on both sides, said in the JSON.
    assert written["timing"] == runner.TIMING
    jax_summary = json.loads((workdir / "jax" / "summary.json").read_text())
    assert jax_summary["phase_seconds"]["warmup"] > 0
    jax_row = written["results"][0]
    assert jax_row["warmup_seconds"] == pytest.approx(
        jax_summary["compile_seconds"] + jax_summary["phase_seconds"]["warmup"])
    assert written["results"][2]["torch_compile"] is None  # off on the CPU by default
    measures = written["results"][2]["measures"]
    assert measures["compile"]["mode"] is None and measures["compile"]["fallbacks"] == []
    assert measures["optimizers"] == [{"group": "default", "optimizer": "SGD",
                                       "implementation": "fused"}]
    assert measures["weights"]["dtype"] == "float32" and measures["whitening"] is None
    assert "measures" not in written["results"][1]  # torch_article: the article's way
    assert [r["start"] for r in written["results"]] == ["-", "own draw", "own draw"]


def test_the_table_says_whether_the_twins_started_equal():
    """A twin whose whitened stem is not jaxtrain's trains a different network: the
    table's start column says so, not only a warning line."""
    config = default.get_config()
    config.model.name, config.model.stem_init = "cifar_cnn", "whiten"
    differs = {"measures": {"whitening": {"matches_jaxtrain": False}}}
    same = {"measures": {"whitening": {"matches_jaxtrain": True}}}
    assert runner.start_of("torch_fast", config, None, differs) == "own draw, stem DIFFERS"
    assert runner.start_of("torch_fast", config, {"params": {}}, same) == \
        "same weights, same stem"
    assert runner.start_of("torch_article", config, None, {}) == "own draw, same stem"
    row = {"framework": "torch_fast", "device": "cpu", "precision": "float32",
           "start": "own draw, stem DIFFERS", "warmup_seconds": 1.0, "train_seconds": 2.0,
           "images_per_second": 3.0, "test_accuracy": 0.5, "test_loss": 1.0, "param_count": 7}
    header, line = runner.format_table([row]).splitlines()
    assert header.split()[3] == "start" and "own draw, stem DIFFERS" in line


@pytest.mark.slow
def test_the_warm_up_leaves_the_run_unchanged(cifar_batches_dir, tmp_path):
    from jaxtrain.run import loop

    config = seed_config(cifar_batches_dir, train__num_steps=6, eval__every_steps=3)
    plain = loop.train_and_evaluate(config, str(tmp_path / "plain"))
    warmed = loop.train_and_evaluate(config, str(tmp_path / "warmed"), warm_up=True)
    assert plain["phase_seconds"]["warmup"] == 0 < warmed["phase_seconds"]["warmup"]
    assert warmed["params_sha256"] == plain["params_sha256"]
    assert warmed["test_loss"] == plain["test_loss"]


def test_torch_without_cuda_beside_a_jax_gpu_is_one_line():
    runner.check_torch_device("cpu", False)
    runner.check_torch_device("gpu", True)
    with pytest.raises(runner.CompareError, match=r"^JAX trains on the GPU but torch 2\.x "
                       r"sees no CUDA device, so its runs would train on the CPU: install"):
        runner.check_torch_device("gpu", False, "2.x")


@pytest.mark.slow
def test_command_line_prints_the_table(cifar_batches_dir, tmp_path):
    result = fork_server.run(
        [sys.executable, "-m", "jaxtrain.compare", "--config=configs/cifar_seed_cnn.py",
         f"--workdir={tmp_path}", f"--config.data.dir={cifar_batches_dir}",
         "--config.train.num_steps=5", "--frameworks=jax,torch_fast",
         "--torch_compile_cap=30", "--torch_bfloat16=off"],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("framework"))
    assert "images/s" in lines[header] and "test acc" in lines[header]
    assert lines[header + 1].split()[:2] == ["jax", "cpu"]
    assert lines[header + 2].split()[:2] == ["torch_fast", "cpu"]
    assert lines[header + 1].split()[-1] == lines[header + 2].split()[-1] == "62,006"
    written = json.loads((tmp_path / runner.JSON_FILE).read_text())
    assert [r["steps"] for r in written["results"]] == [5, 5]
    measures = written["results"][1]["measures"]
    assert measures["compile"]["cap_seconds"] == 30
    assert measures["weights"]["why"] == "off (--torch_bfloat16=off)"


@pytest.mark.slow
def test_command_line_rejects_an_unknown_framework(tmp_path):
    result = fork_server.run(
        [sys.executable, "-m", "jaxtrain.compare", "--config=configs/cifar_seed_cnn.py",
         f"--workdir={tmp_path}", "--frameworks=jax,tensorflow"],
        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "--frameworks must be a comma-separated list of" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("config,expected", [
    (model_config("seed_cnn"), 62006),
    (model_config("seed_cnn", batch_norm=True), 62458),
    (model_config("cifar_cnn", widths=(8, 16, 16), stem_width=8), 9560),
    (model_config("cifar_cnn"), 1971640),
    (model_config("mlp", batch_norm=True), 834462),
    (model_config("mlp", batch_norm=False), 833494),
], ids=["seed_cnn", "seed_cnn_bn", "cifar_cnn_small", "cifar_cnn", "mlp_bn", "mlp"])
def test_parameter_counts_are_equal(config, expected):
    shape = (32, 32, 3)
    model = models.create_model(config, 10, jnp.float32)
    variables = jax.eval_shape(functools.partial(model.init, train=False), jax.random.key(0),
                               jnp.zeros((1, *shape)))
    assert models.count_params(variables["params"]) == expected
    twin = torch_models.create_model(config, 10, shape)
    assert torch_models.count_params(twin) == expected
    if config.name == "cifar_cnn":
        twin[0].weight.requires_grad_(False)  # a fixed (whitened) stem counts, as in Flax
        assert torch_models.count_params(twin) == expected


@pytest.mark.slow
@pytest.mark.parametrize("config", [
    model_config("seed_cnn", batch_norm=True),
    model_config("mlp", batch_norm=True, hidden_sizes=(64, 32)),
    model_config("cifar_cnn", widths=(8, 16, 16), activation="gelu", bn_epsilon=1e-12,
                 conv_init="dirac", head_init_std=1.0, head_scale=1 / 256),
], ids=["seed_cnn_bn", "mlp_bn", "cifar_cnn_record"])
def test_twins_with_copied_weights_compute_the_same_function(config):
    """Covers the layout changes: HWIO kernels, (in, out) dense kernels, the (h, w, c)
    flatten order and the BatchNorm statistics."""
    shape = (32, 32, 3)
    model = models.create_model(config, 10, jnp.float32)
    variables = jax.jit(functools.partial(model.init, train=False))(jax.random.key(0),
                                                                    jnp.zeros((1, *shape)))
    stats = jax.tree.map(lambda v: v + 0.5, variables["batch_stats"])  # not the initial 0, 1
    variables = {**variables, "batch_stats": stats}
    twin = torch_models.load_flax_variables(torch_models.create_model(config, 10, shape),
                                            variables, shape)
    x = np.random.default_rng(0).normal(size=(4, *shape)).astype(np.float32)
    expected = np.asarray(jax.jit(functools.partial(model.apply, train=False))(variables, x))
    got = twin.eval()(torch.from_numpy(x).permute(0, 3, 1, 2)).detach().numpy()
    np.testing.assert_allclose(got, expected, rtol=TRAINING_STEPS, atol=TRAINING_STEPS * 0.1)


def test_twin_initialisation_has_the_flax_scale():
    """cifar_cnn and mlp use Flax's lecun_normal (truncated normal, variance 1/fan_in)."""
    twin = torch_models.create_model(model_config("mlp", batch_norm=False), 10, (32, 32, 3))
    weight = twin[1].weight.detach().numpy()  # (256, 3072)
    assert weight.std() == pytest.approx(np.sqrt(1 / 3072), rel=0.02)
    assert np.abs(weight).max() <= 2 * np.sqrt(1 / 3072) / 0.8796 + 1e-6
    assert not twin[1].bias.detach().any()


@pytest.mark.slow
@pytest.mark.parametrize("model", [
    model_config("seed_cnn"),
    model_config("cifar_cnn", widths=(8, 16, 16), stem_width=8),
], ids=["seed_cnn", "cifar_cnn"])
def test_one_sgd_step_is_the_same_in_both_frameworks(cifar_batches_dir, model):
    config = cifar.get_config()
    config.model = model
    config.optimizer.schedule = "constant"
    config.optimizer.learning_rate = 0.05
    config.optimizer.momentum = 0.9
    config.optimizer.nesterov = True
    config.optimizer.weight_decay = 5e-3
    config.train.label_smoothing = 0.2
    dataset = data.load("cifar10", "files", str(cifar_batches_dir))
    mean, std = inputs_lib.channel_stats(dataset, config.data)
    images, labels = dataset.x_train[:32], dataset.y_train[:32]
    shape = dataset.image_shape

    # jaxtrain's own step, float32, no augmentation
    flax_model = models.create_model(config.model, 10, jnp.float32)
    tx = optim.create_optimizer(config.optimizer, optim.create_schedule(config.optimizer, 10))
    state = train_state.create_train_state(jax.random.key(0), flax_model, tx, shape)
    step = jax.jit(functools.partial(step_lib.train_step, spec=step_lib.StepSpec(
        mean=mean, std=std, num_classes=10, label_smoothing=config.train.label_smoothing)))
    new_state, metrics = step(state, images, labels, jax.random.key(1))

    # the comparison's torch step, from the same weights
    twin = torch_models.create_model(config.model, 10, shape)
    torch_models.load_flax_variables(twin, {"params": state.params,
                                            "batch_stats": state.batch_stats}, shape)
    optimizer = torch_optim.create_torch_optimizer(config.optimizer, twin, 10)
    criterion = torch.nn.CrossEntropyLoss(label_smoothing=config.train.label_smoothing)
    inputs = torch_models.normalize(torch.from_numpy(images).permute(0, 3, 1, 2), mean, std)
    loss = runner.torch_step(twin, optimizer, criterion, inputs,
                             torch.from_numpy(labels).long(), 0)
    assert loss.item() == pytest.approx(float(metrics["loss"]), rel=NETWORK_PASS)

    expected = torch_models.create_model(config.model, 10, shape)
    torch_models.load_flax_variables(expected, {"params": new_state.params,
                                                "batch_stats": new_state.batch_stats}, shape)
    moved = new_state.params["Conv_0"]["kernel"] - state.params["Conv_0"]["kernel"]
    assert float(jnp.abs(moved).max()) > 1e-4  # the step moved the weights
    stepped = twin.state_dict()
    for name, value in expected.state_dict().items():
        if name.endswith(("running_var", "num_batches_tracked")):
            continue  # torch keeps the unbiased batch variance: n / (n - 1) times Flax's
        np.testing.assert_allclose(stepped[name].numpy(), value.numpy(), rtol=TRAINING_STEPS,
                                   atol=TRAINING_STEPS * 0.1, err_msg=name)


@pytest.mark.parametrize("name,nesterov,schedule", [
    ("sgd", True, "onecycle"), ("adam", False, "linear"), ("adamw", False, "warmup_cosine")])
def test_torch_optimizers_follow_optax(name, nesterov, schedule):
    opt = default.get_config().optimizer
    opt.name, opt.nesterov, opt.schedule = name, nesterov, schedule
    opt.learning_rate, opt.weight_decay, opt.warmup_fraction = 0.05, 0.01, 0.3
    steps = 6
    tx = optim.create_optimizer(opt, optim.create_schedule(opt, steps))
    rng = np.random.default_rng(0)
    w0 = rng.normal(size=5).astype(np.float32)
    grads = rng.normal(size=(steps, 5)).astype(np.float32)

    params, opt_state = jnp.asarray(w0), tx.init(jnp.asarray(w0))
    for g in grads:
        updates, opt_state = tx.update(jnp.asarray(g), opt_state, params)
        params = optax.apply_updates(params, updates)

    layer = torch.nn.Linear(5, 1, bias=False)  # Flax path Dense_0/kernel
    with torch.no_grad():
        layer.weight.copy_(torch.from_numpy(w0)[None])
    optimizer = torch_optim.create_torch_optimizer(opt, torch.nn.Sequential(layer), steps)
    for step, g in enumerate(grads):
        torch_optim.set_step(optimizer, step)
        layer.weight.grad = torch.from_numpy(g.copy())[None]
        optimizer.step()
    np.testing.assert_allclose(layer.weight.detach().numpy()[0], np.asarray(params),
                               rtol=NETWORK_PASS, atol=NETWORK_PASS * 0.1)


@pytest.mark.slow
@pytest.mark.parametrize("nesterov", [True, False])
def test_torch_muon_follows_optax_muon(nesterov):
    """torch_optim.Muon (OIHW weights) against optax.contrib.muon through optim.py (HWIO
    kernels): momentum averaging and bias correction, Newton-Schulz, the width scale,
    decoupled weight decay, then the renormalisation."""
    opt = default.get_config().optimizer
    opt.name, opt.nesterov, opt.momentum, opt.ns_steps = "muon", nesterov, 0.6, 3
    opt.schedule, opt.learning_rate, opt.weight_decay, opt.renormalize = "linear", 0.2, 0.05, True
    steps = 5
    rng = np.random.default_rng(1)
    kernels = {"Conv_0": rng.normal(size=(3, 3, 4, 6)), "Dense_0": rng.normal(size=(6, 10))}
    grads = [{k: rng.normal(size=v.shape) for k, v in kernels.items()} for _ in range(steps)]
    as_tree = lambda arrays: {k: {"kernel": jnp.asarray(v, jnp.float32)} for k, v in arrays.items()}

    tx = optim.create_optimizer(opt, optim.create_schedule(opt, steps))
    params = as_tree(kernels)
    opt_state = tx.init(params)
    for g in grads:
        updates, opt_state = tx.update(as_tree(g), opt_state, params)
        params = optax.apply_updates(params, updates)

    conv, dense = torch.nn.Conv2d(4, 6, 3, bias=False), torch.nn.Linear(6, 10, bias=False)
    to_torch = {"Conv_0": lambda k: k.transpose(3, 2, 0, 1), "Dense_0": lambda k: k.T}
    layers = {"Conv_0": conv, "Dense_0": dense}
    with torch.no_grad():
        for name, layer in layers.items():
            layer.weight.copy_(torch.from_numpy(to_torch[name](kernels[name]).copy()))
    optimizer = torch_optim.create_torch_optimizer(opt, torch.nn.Sequential(conv, dense), steps)
    assert [type(o).__name__ for o in optimizer.optimizers] == ["Muon"]
    for step, g in enumerate(grads):
        torch_optim.set_step(optimizer, step)
        for name, layer in layers.items():
            layer.weight.grad = torch.from_numpy(to_torch[name](g[name]).astype(np.float32))
        optimizer.step()
    for name, layer in layers.items():
        expected = to_torch[name](np.asarray(params[name]["kernel"]))
        assert np.linalg.norm(expected) == pytest.approx(np.sqrt(expected.shape[0]),
                                                         rel=NETWORK_PASS)
        np.testing.assert_allclose(layer.weight.detach().numpy(), expected, rtol=TRAINING_STEPS,
                                   atol=TRAINING_STEPS * 0.1, err_msg=name)


def record_config(data_dir, **overrides):
    """configs/cifar_speedrun.py, narrow, float32, on the 2,000-image fixture."""
    config = cifar_speedrun.get_config()
    config.data.dir, config.data.source = str(data_dir), "files"
    config.model.widths = (8, 16, 16)
    config.train.precision = "float32"
    config.train.batch_size, config.eval.batch_size = 100, 250
    return with_overrides(config, overrides)


def to_torch_layout(array):
    """A Flax parameter in its twin's layout: HWIO -> OIHW, (in, out) -> (out, in)."""
    array = np.asarray(array)
    return {4: lambda a: a.transpose(3, 2, 0, 1), 2: lambda a: a.T}.get(array.ndim,
                                                                      lambda a: a)(array)


@pytest.mark.slow
def test_record_recipe_optimizers_take_the_same_steps(cifar_batches_dir):
    """Three steps of the record recipe's optimiser on the same weights and gradients
    (jaxtrain's, on real images): the four parameter groups matched on Flax paths
    (Muon with renormalised filters; Nesterov SGD at their own rates for the BatchNorm
    biases, the stem bias and the head), the fixed whitened stem, each group's
    schedule. The stem bias trains for its first step only (train_steps=1).

    The gradients come from jaxtrain for both: where a max-pool window holds equal
    values (flat image regions, GELU's exact zeros, common with the Dirac convs
    passing the whitened stem through), XLA and torch send the gradient to different,
    equally valid elements, so their own gradients differ by a few percent there."""
    config = record_config(cifar_batches_dir, optimizer__groups__stem_bias__train_steps=1)
    run = prepare.setup(config)
    dataset, state, shape = run.dataset, run.state, run.dataset.image_shape
    grad_fn = jax.jit(jax.grad(lambda params, images, labels: optax.softmax_cross_entropy(
        state.apply_fn({"params": params, "batch_stats": state.batch_stats},
                       step_lib.normalize(images, run.mean, run.std), train=True,
                       mutable=["batch_stats"])[0],
        optax.smooth_labels(jax.nn.one_hot(labels, 10), 0.2)).mean()))
    twin, optimizer, _ = runner.torch_recipe(config, dataset, torch.device("cpu"),
                                             run.total_steps, run.stem_kernel)
    torch_models.load_flax_variables(twin, {"params": state.params,
                                            "batch_stats": state.batch_stats}, shape)
    assert sorted(g["name"] for g in optimizer.param_groups) == [
        "filters", "head", "norm_biases", "stem_bias"]
    paths = torch_models.flax_param_paths(twin)
    assert paths[twin[0].weight] == "Conv_0/kernel" and not twin[0].weight.requires_grad
    paths = {p: path for p, path in paths.items() if p.requires_grad}
    assert len(paths) == 1 + 6 + 6 + 1  # stem bias, filters, BatchNorm biases, head
    flat = lambda tree: {optim.param_path(p): v for p, v in jax.tree_util.tree_leaves_with_path(tree)}
    stem_bias = [twin[0].bias.detach().clone()]
    for i in range(3):
        grads = grad_fn(state.params, dataset.x_train[i * 32:(i + 1) * 32],
                        dataset.y_train[i * 32:(i + 1) * 32])
        state = state.apply_gradients(grads=grads)
        by_path = flat(grads)
        for param, path in paths.items():
            param.grad = torch.from_numpy(to_torch_layout(by_path[path]).copy())
        torch_optim.set_step(optimizer, i)
        optimizer.step()
        stem_bias.append(twin[0].bias.detach().clone())
        expected = flat(state.params)
        for param, path in paths.items():
            np.testing.assert_allclose(param.detach().numpy(), to_torch_layout(expected[path]),
                                       rtol=TRAINING_STEPS, atol=TRAINING_STEPS * 0.1,
                                       err_msg=f"step {i}: {path}")
    assert not torch.equal(stem_bias[0], stem_bias[1])
    assert torch.equal(stem_bias[1], stem_bias[3])  # train_steps=1: frozen after step 1
    filters = twin[3][4].weight.detach()  # renormalised to norm sqrt(C_out)
    assert torch.linalg.norm(filters).item() == pytest.approx(4.0, rel=NETWORK_PASS)


def test_record_recipe_twin_initialisation():
    """Dirac block convs (identity on the first min(C_in, C_out) filters) and the
    head drawn from N(0, 1), as the Flax model's initialisers."""
    config = cifar_speedrun.get_config().model
    twin = torch_models.create_model(config, 10, (32, 32, 3))
    first = twin[2][0].weight.detach()  # ConvBlock_0/Conv_0: 24 -> 64
    assert torch.equal(first[:24, :, 1, 1], torch.eye(24))
    assert not first[:24].sum((2, 3)).sub(torch.eye(24)).any()
    assert first[24:].std() > 0
    head = twin[-2].weight.detach()
    assert head.std().item() == pytest.approx(1.0, rel=0.1)
    assert isinstance(twin[1], torch.nn.GELU) and twin[1].approximate == "none"
    assert twin[2][2].eps == 1e-12


def test_alternating_flips_mirror_each_image_once_in_two_epochs(cifar_batches_dir):
    config = record_config(cifar_batches_dir)
    flips = runner.first_epoch_flips(config, 64)
    images = torch.from_numpy(
        data.load("cifar10", "files", str(cifar_batches_dir)).x_train[:64]).permute(0, 3, 1, 2)
    seen = []
    for epoch in (0, 1):
        mirror = flips ^ (epoch % 2 == 1)
        out = torch_models.augment_batch(images, flip=True, alternate_flip=True, mirror=mirror)
        seen.append((out == images.flip(3)).flatten(1).all(1) & ~(out == images).flatten(1).all(1))
    assert 16 < int(seen[0].sum()) < 48
    assert torch.equal(seen[0] ^ seen[1], torch.ones(64, dtype=torch.bool))
    with pytest.raises(ValueError, match="mirror bits"):
        torch_models.augment_batch(images, flip=True, alternate_flip=True)


@pytest.mark.slow
def test_tta_on_the_least_confident_fraction_is_jaxtrains(cifar_batches_dir):
    """eval.tta_fraction: plain logits, then TTA on the 30% least confident images. The
    head unscaled (head_scale 1, not 1/9): the untrained net's logits are then far enough
    from uniform that TTA on a fraction and on every image differ well past the rounding
    (with 1/9 by 6e-5 of the loss, under TRAINING_STEPS)."""
    config = record_config(cifar_batches_dir, eval__tta_fraction=0.3, model__head_scale=1.0)
    run = prepare.setup(config)
    dataset, state = run.dataset, run.state
    stats = jax.tree.map(lambda v: v + 0.3, state.batch_stats)
    state = state.replace(batch_stats=stats)
    eval_arrays = inputs_lib.batch_for_eval(dataset.x_test, dataset.y_test, config.eval.batch_size)
    expected = jax.device_get(jax.jit(functools.partial(
        evaluation.evaluate, **prepare.eval_arguments(config, run)))(state, *eval_arrays))
    twin = torch_models.load_flax_variables(
        torch_models.create_model(config.model, 10, dataset.image_shape),
        {"params": state.params, "batch_stats": stats}, dataset.image_shape)
    x, y = torch.from_numpy(dataset.x_test).permute(0, 3, 1, 2), torch.from_numpy(dataset.y_test)
    batches = [(x[i:i + 250], y[i:i + 250].long()) for i in range(0, len(x), 250)]
    kwargs = dict(mean=run.mean, std=run.std, tta="flip_translate",
                  pad_mode=config.augment.pad_mode, device=torch.device("cpu"))
    got = runner.torch_evaluate(twin, batches, tta_images=runner.tta_images(config, dataset),
                                **kwargs)
    assert runner.tta_images(config, dataset) == 150
    assert got["accuracy"] == pytest.approx(float(expected["accuracy"]), abs=1 / 500)
    assert got["loss"] == pytest.approx(float(expected["loss"]), rel=TRAINING_STEPS)
    everything = runner.torch_evaluate(twin, batches, **kwargs)
    # the fraction matters: by ten times the rounding allowed above, at least
    assert everything["loss"] != pytest.approx(got["loss"], rel=10 * TRAINING_STEPS)


@pytest.mark.parametrize("mode", ["none", "flip", "flip_translate"])
@pytest.mark.parametrize("pad_mode", ["reflect", "constant"])
def test_tta_views_are_jaxtrains(cifar_subset, mode, pad_mode):
    images = cifar_subset["x_test"][:8]
    jax_views, jax_weights = augment.tta_views(jnp.asarray(images), mode, pad_mode)
    views, weights = torch_models.tta_views(torch.from_numpy(images).permute(0, 3, 1, 2),
                                            mode, pad_mode)
    assert weights == jax_weights
    for expected, view in zip(jax_views, views):
        np.testing.assert_array_equal(view.permute(0, 2, 3, 1).numpy(), np.asarray(expected))


def test_rotation_is_jaxtrains(cifar_subset):
    images = cifar_subset["x_train"][:6]
    angles = np.array([0.0, 15.0, -30.0, 90.0, 45.0, 7.3], np.float32)
    expected = np.asarray(augment.rotate(jnp.asarray(images), jnp.asarray(angles)))
    got = torch_models.rotated(torch.from_numpy(images).permute(0, 3, 1, 2),
                               torch.from_numpy(angles)).permute(0, 2, 3, 1).numpy()
    assert np.mean(got == expected) > 0.999  # a rounding tie may fall either way


@pytest.mark.slow
def test_augmentations_move_pixels_like_jaxtrains(cifar_subset):
    torch.manual_seed(0)
    images = torch.from_numpy(cifar_subset["x_train"][:64]).permute(0, 3, 1, 2)
    flipped = torch_models.augment_batch(images, flip=True)
    mirrored = (flipped == images.flip(3)).flatten(1).all(1)
    assert 16 < int(mirrored.sum()) < 48
    assert ((flipped == images).flatten(1).all(1) | mirrored).all()
    cut = torch_models.augment_batch(images, cutout=8)
    zeroed = ((cut == 0) & (images != 0)).flatten(1).sum(1) / 3
    assert zeroed.max() <= 64 and zeroed.float().mean() > 20
    for pad_mode in ("reflect", "constant"):  # every output is one of the 25 shifts
        out = torch_models.augment_batch(images[:4], translate=2, pad_mode=pad_mode)
        for i in range(4):
            shifts = [torch_models.shifted(images[i:i + 1], torch.tensor([dy]), torch.tensor([dx]),
                                           pad_mode) for dy in range(-2, 3) for dx in range(-2, 3)]
            assert any(torch.equal(out[i:i + 1], s) for s in shifts)
    # the per-sample transform: ToTensor, (no augmentation), Normalize, on CHW
    x = torch_models.article_transform(cifar_subset["x_train"][0], augment={}, mean=(0.5,),
                                       std=(0.5,))
    expected = np.asarray(step_lib.normalize(jnp.asarray(cifar_subset["x_train"][0]), (0.5,),
                                             (0.5,)))
    np.testing.assert_allclose(x.permute(1, 2, 0).numpy(), expected, atol=ELEMENTWISE)


@pytest.mark.slow
def test_torch_fast_trains_the_record_recipe_in_bfloat16(cifar_batches_dir):
    """torch_fast's measures on the CPU (torch.compile aside): bfloat16 weights with
    float32 BatchNorm and master weights (--torch_bfloat16=on), Muon's Newton-Schulz in
    bfloat16 over stacks of same-shape filters, fused SGD, the whitened stem computed
    in torch (matching jaxtrain's), the epoch augmented in one go (rotation and cutout
    too), the TTA views in one batch."""
    config = record_config(cifar_batches_dir, train__precision="bfloat16", train__batch_size=50,
                           augment__rotate=10.0, augment__cutout=6)
    dataset = data.load("cifar10", "files", str(cifar_batches_dir))
    mean, std = inputs_lib.channel_stats(dataset, config.data)
    stem_kernel = model_state.whitening_fn(config.model, mean, std)(
        dataset.x_train[:whitening.WHITENING_IMAGES])
    result = runner.run_torch_fast(config, dataset, mean, std, total_steps=4,
                                   stem_kernel=stem_kernel, bfloat16=True)
    assert result["precision"] == "bfloat16" and result["param_count"] == 10920
    assert np.isfinite(result["test_loss"]) and result["steps"] == 4
    measures = result["measures"]
    assert measures["weights"] == {
        "dtype": "bfloat16", "why": "on (--torch_bfloat16=on)", "batch_norm": "float32",
        "optimizer_steps": "float32 master weights", "autocast": None,
        "memory_format": "channels_last"}
    muon, *sgd = measures["optimizers"]
    assert muon["newton_schulz"] == {"dtype": "bfloat16", "compiled": False,
                                     "stacks": [[1, 8, 216], [1, 8, 72], [1, 16, 72],
                                                [3, 16, 144]]}
    assert {row["implementation"] for row in sgd} == {"fused"} and len(sgd) == 3
    assert measures["whitening"]["matches_jaxtrain"]
    assert 0 < measures["whitening"]["difference_from_jaxtrain"] < runner.WHITENING_TOLERANCE
    assert measures["compile"]["mode"] is None and result["torch_compile"] is None
    with pytest.raises(runner.CompareError, match="needs config.train.precision='bfloat16'"):
        runner.run_torch_fast(record_config(cifar_batches_dir), dataset, mean, std,
                              total_steps=1, bfloat16=True)


@pytest.mark.parametrize("pad_mode", ["reflect", "constant"])
def test_an_epoch_augmented_at_once_is_the_per_batch_augmentation(cifar_subset, pad_mode):
    """torch_fast augments each epoch in one go and slices it per step: the same images
    as augmenting each batch (augment_batch, then normalising) with the same draws,
    the alternating flip's bits included; the flip and the translation, one gather
    there, are the flip then the shift."""
    images = torch.from_numpy(cifar_subset["x_train"][:96]).permute(0, 3, 1, 2)
    labels = torch.from_numpy(cifar_subset["y_train"][:96]).long()
    order = torch.randperm(96, generator=torch.Generator().manual_seed(0))[:64]
    flips = torch.rand(96, generator=torch.Generator().manual_seed(1)) < 0.5
    augment_kwargs = dict(flip=True, alternate_flip=True, translate=2, rotate=10.0, cutout=6,
                          pad_mode=pad_mode)
    mean, std = (0.49, 0.48, 0.45), (0.25, 0.24, 0.26)
    mirror = flips[order] ^ True  # an odd epoch
    per_batch, draws = [], []
    for i in range(0, 64, 16):
        torch.manual_seed(i)
        batch = torch_models.augment_batch(images[order[i:i + 16]], mirror=mirror[i:i + 16],
                                           **augment_kwargs)
        per_batch.append(torch_models.normalize(batch, mean, std))
        torch.manual_seed(i)  # the same draws, for the epoch at once
        draws.append(torch_models.draw_augmentation(16, 32, 32, mirror=mirror[i:i + 16],
                                                    **augment_kwargs))
    draws = {key: torch.cat([d[key] for d in draws], dim=-1) for key in draws[0]}
    assert sorted(draws) == ["cutout", "degrees", "mirror", "shift"]
    inputs, epoch_labels = runner.augmented_epoch(images, labels, order, draws, mean=mean,
                                                  std=std, pad_mode=pad_mode, cutout=6)
    assert inputs.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(epoch_labels, labels[order])
    for i, expected in zip(range(0, 64, 16), per_batch):
        assert torch.equal(inputs[i:i + 16], expected)
    moved = (inputs != torch_models.normalize(images[order], mean, std)).flatten(1).any(1)
    assert bool(moved.all())
    # one gather for the flip and the shift: the flip, then the shift
    dy, dx = draws["shift"]
    flipped = torch.where(mirror[:, None, None, None], images[order].flip(3), images[order])
    expected = torch_models.shifted(flipped, dy, dx, pad_mode)
    got = torch_models.apply_augmentation(images[order], {"mirror": mirror, "shift": (dy, dx)},
                                          pad_mode=pad_mode)
    assert torch.equal(got, expected) and not torch.equal(got, flipped)


@pytest.mark.slow
def test_tta_views_in_one_batch_give_the_separate_views_logits(cifar_subset):
    config = model_config("cifar_cnn", widths=(8, 16, 16), stem_width=8)
    twin = torch_models.create_model(config, 10, (32, 32, 3)).eval()
    with torch.no_grad():
        for layer in twin.modules():  # statistics away from their initial 0 and 1
            if isinstance(layer, torch.nn.BatchNorm2d):
                layer.running_mean.uniform_(-0.3, 0.3)
                layer.running_var.uniform_(0.5, 1.5)
    images = torch.from_numpy(cifar_subset["x_test"][:32]).permute(0, 3, 1, 2)
    kwargs = dict(mean=(0.49, 0.48, 0.45), std=(0.25, 0.24, 0.26), pad_mode="reflect")
    with torch.no_grad():
        for mode in ("flip", "flip_translate"):
            separate = runner.tta_logits(twin, images, mode, **kwargs)
            together = runner.tta_logits(twin, images, mode, one_batch=True, **kwargs)
            assert separate.shape == together.shape == (32, 10)
            np.testing.assert_allclose(together.numpy(), separate.numpy(), rtol=NETWORK_PASS,
                                       atol=NETWORK_PASS * 0.1)
        plain = runner.tta_logits(twin, images, "none", **kwargs)
        assert not torch.allclose(plain, together, atol=1e-3)  # the views matter


@pytest.mark.slow
def test_torch_computes_jaxtrains_whitened_stem(cifar_subset):
    """torch_fast's stem, computed in torch (float64) inside its clock, against
    jaxtrain's (float32): equal to jaxtrain's rounding, most in the least-variance
    directions, whose filters are the largest. The signs are decided far from rounding:
    each eigenvector's first entry, which sets its sign, is at least 0.1 from zero (the
    rounding moves it by ~1e-3); "largest entry positive" had two filters flip on an
    AVX2 CPU (200% apart)."""
    x = cifar_subset["x_train"]
    mean, std = (0.49, 0.48, 0.45), (0.25, 0.24, 0.26)
    expected = np.asarray(whitening.whitening_kernel(x, mean, std, 24)).transpose(3, 2, 0, 1)
    got = torch_models.whitening_kernel(torch.from_numpy(x), mean, std, 24).numpy()
    assert got.shape == (24, 3, 2, 2) and got.dtype == np.float32
    difference = np.abs(got - expected).max() / np.abs(expected).max()
    assert difference < runner.WHITENING_TOLERANCE  # 0.3% (AVX2 EPYC), in the last filters
    # the first entry of each unit eigenvector (OIHW filter o: its [c=0, 0, 0] over its norm)
    first = got[:12, 0, 0, 0] / np.linalg.norm(got[:12].reshape(12, -1), axis=1)
    assert np.all(first > 0.1), first
    np.testing.assert_allclose(got[:6], expected[:6], rtol=WHITENING, atol=WHITENING * 0.1)
    np.testing.assert_array_equal(got[12:], -got[:12])
    with pytest.raises(ValueError, match="must be uint8"):
        torch_models.whitening_kernel(torch.zeros(2, 4, 4, 3), mean, std, 8)


def test_batched_newton_schulz_is_the_per_matrix_one():
    """Muon orthogonalises same-shape matrices as one stack, on their wide orientation:
    the same as newton_schulz one matrix at a time (float32); bfloat16 within its
    rounding."""
    muon = torch_optim.Muon([torch.nn.Parameter(torch.zeros(6, 4, 3, 3))], ns_steps=3)
    group = muon.param_groups[0]
    generator = torch.Generator().manual_seed(0)
    shapes = [(6, 4, 3, 3), (6, 4, 3, 3), (40, 6), (40, 6), (5, 12), (6, 4, 3, 3)]
    directions = [torch.randn(shape, generator=generator) for shape in shapes]
    batched = muon._orthogonalized(directions, group)
    for d, got in zip(directions, batched):
        matrix = d.reshape(d.shape[0], -1)  # (out, in); newton_schulz takes (in, out)
        expected = torch_optim.newton_schulz(matrix.T, group["ns_coeffs"], 3).T
        assert got.shape == d.shape
        np.testing.assert_allclose(got.reshape(matrix.shape).numpy(), expected.numpy(),
                                   rtol=NETWORK_PASS, atol=NETWORK_PASS * 0.1)
    stack = torch.stack([d.reshape(6, -1) for d in directions[:2]])
    assert not torch.equal(batched[0], batched[1])
    low = torch_optim.newton_schulz_batched(stack, group["ns_coeffs"], 3, dtype=torch.bfloat16)
    high = torch_optim.newton_schulz_batched(stack, group["ns_coeffs"], 3)
    assert low.dtype == torch.float32
    assert float((low - high).abs().max()) < BFLOAT16_STEPS * float(high.abs().max())
    params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    assert sorted(torch_optim.Muon(params).stack_shapes()) == [(1, 5, 12), (2, 6, 40),
                                                               (3, 6, 36)]


@pytest.mark.slow
def test_master_weights_step_float32_weights_for_a_bfloat16_copy():
    """torch_fast's bfloat16 weights: BatchNorm shared in float32, the optimiser steps
    the float32 weights with the copy's gradients (as float32) and copies them back."""
    config = model_config("cifar_cnn", widths=(8, 16, 16), stem_width=8)
    torch.manual_seed(0)
    model = torch_models.create_model(config, 10, (32, 32, 3))
    reference = torch_models.create_model(config, 10, (32, 32, 3))
    reference.load_state_dict(model.state_dict())
    low = torch_models.low_precision_copy(model)
    norms = [m for m in low.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert norms and all(any(n is m for m in model.modules()) for n in norms)
    assert low[0].weight.dtype == torch.bfloat16 and norms[0].bias.dtype == torch.float32
    opt = default.get_config().optimizer
    opt.schedule, opt.learning_rate, opt.momentum = "constant", 0.1, 0.9
    pairs = [(m, c) for m, c in zip(model.parameters(), low.parameters())
             if m is not c and m.requires_grad]
    assert len(pairs) == 1 + 1 + 6 + 1  # stem kernel and bias, block convs, head
    optimizer = torch_optim.MasterWeights(
        torch_optim.create_torch_optimizer(opt, model, 3, fast=True), pairs)
    plain = torch_optim.create_torch_optimizer(opt, reference, 3)
    x = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    start = {name: p.detach().clone() for name, p in model.named_parameters()}
    theirs = dict(reference.named_parameters())
    for step in range(2):
        loss = runner.torch_step(low, optimizer, torch.nn.CrossEntropyLoss(),
                                 x.to(torch.bfloat16), torch.arange(4), step)
        assert loss.dtype == torch.float32  # Scale: the logits in float32
        assert all(master.grad.dtype == torch.float32 for master, _ in pairs)
        torch_optim.set_step(plain, step)
        for name, mine in model.named_parameters():
            theirs[name].grad = None if mine.grad is None else mine.grad.clone()
        plain.step()  # torch's plain SGD on the same float32 gradients
        for name, mine in model.named_parameters():  # the shared BatchNorm's too
            np.testing.assert_allclose(mine.detach().numpy(), theirs[name].detach().numpy(),
                                       rtol=ELEMENTWISE, atol=ELEMENTWISE * 0.1,
                                       err_msg=f"step {step}: {name}")
        assert all(torch.equal(copy, master.to(torch.bfloat16)) for master, copy in pairs)
    moved = [name for name, p in model.named_parameters() if not torch.equal(p, start[name])]
    assert len(moved) == len(pairs) + 6  # and the six BatchNorm biases


@pytest.mark.slow
def test_torch_compile_falls_back_past_its_cap_and_on_errors():
    """torch_fast tries its compile mode within the cap, then 'default' (uncapped), then no
    compilation, recording each fallback and its reason; a CPU skips the CUDA modes."""
    import time

    modes, fallbacks = runner.compile_modes("max-autotune", "cuda")
    assert modes == ["max-autotune", "default", None] and fallbacks == []
    modes, fallbacks = runner.compile_modes("max-autotune", "cpu")
    assert modes == ["default", None] and fallbacks[0]["mode"] == "max-autotune"
    assert fallbacks[0]["reason"].startswith("not tried on cpu")
    assert runner.compile_modes("default", "cpu") == (["default", None], [])
    undone = []

    def attempt(mode):
        if mode == "max-autotune":
            time.sleep(30)  # interrupted by the cap
        if mode == "default":
            raise RuntimeError("inductor failed\nsecond line")
        return f"ran {mode}"

    start = time.perf_counter()
    mode, result, fallbacks, enforced, _ = runner.first_that_compiles(
        ["max-autotune", "default", None], attempt, 0.2, lambda: undone.append(1))
    assert time.perf_counter() - start < 10
    assert (mode, result, enforced, len(undone)) == (None, "ran None", True, 2)
    assert [f["mode"] for f in fallbacks] == ["max-autotune", "default"]
    assert fallbacks[0]["reason"] == "did not compile and warm up within its 0.2 s cap"
    assert fallbacks[1]["reason"] == "RuntimeError: inductor failed"
    mode, result, fallbacks, enforced, _ = runner.first_that_compiles(
        ["default", None], lambda mode: time.sleep(0.5) or mode, 0.2, lambda: None)
    assert (mode, result, fallbacks, enforced) == ("default", "default", [], False)  # uncapped


@pytest.mark.slow
def test_unknown_framework_is_refused(cifar_batches_dir, tmp_path):
    with pytest.raises(runner.CompareError, match="unknown framework"):
        runner.run(seed_config(cifar_batches_dir), ["jax", "mxnet"], str(tmp_path))


@pytest.mark.slow
def test_the_torch_twin_gets_the_same_fixed_whitened_stem(cifar_batches_dir):
    config = cifar.get_config()
    config.data.dir, config.data.source = str(cifar_batches_dir), "files"
    config.model.stem_init, config.model.widths = "whiten", (16, 32, 64)
    run = prepare.setup(config)
    dataset = run.dataset
    model, optimizer, _ = runner.torch_recipe(config, dataset, torch.device("cpu"),
                                              run.total_steps, run.stem_kernel)
    stem = model[0]
    np.testing.assert_allclose(stem.weight.detach().numpy(),
                               run.stem_kernel.transpose(3, 2, 0, 1), rtol=ELEMENTWISE)
    assert not stem.weight.requires_grad
    trained = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert id(stem.weight) not in trained and id(stem.bias) in trained


@pytest.mark.slow
def test_a_recipe_the_twins_lack_is_refused_before_training(cifar_batches_dir, tmp_path):
    config = seed_config(cifar_batches_dir, optimizer__lookahead_steps=5)
    with pytest.raises(runner.CompareError,
                       match=r"do not implement optimizer.lookahead_steps=5: run --frameworks=jax"):
        runner.run(config, ["jax", "torch_fast"], str(tmp_path))
    assert not list(tmp_path.iterdir())  # nothing trained, nothing written


# ---------------------------------------------------------------- ResNet twins

def flax_leaves(tree) -> dict:
    """'/'-joined path -> leaf."""
    return {"/".join(k.key for k in path): leaf
            for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def random_resnet_variables(model, shape, seed=0, dtype=jnp.float32):
    """Flax variables drawn with numpy (no init program to compile): kernels N(0, 1/fan_in),
    and BatchNorm away from its identity (and from the zero scale a branch starts at),
    so every layer shows in the outputs and the gradients. Drawn in float32 (what
    load_flax_variables copies exactly), numpy arrays of `dtype`."""
    rng = np.random.default_rng(seed)
    draws = {"kernel": lambda s: rng.normal(0, np.sqrt(1 / np.prod(s[:-1])), s),
             "scale": lambda s: rng.uniform(0.5, 1.5, s), "var": lambda s: rng.uniform(0.5, 1.5, s),
             "bias": lambda s: rng.normal(0, 0.1, s), "mean": lambda s: rng.normal(0, 0.1, s)}
    abstract = jax.eval_shape(functools.partial(model.init, train=False), jax.random.key(0),
                              jnp.zeros((1, *shape)))
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: draws[path[-1].key](leaf.shape).astype(np.float32).astype(dtype),
        abstract)


def uninitialised_twin(config, classes, shape):
    """A twin with its memory but not its initialisation (truncated normals for 11M
    weights take seconds), for load_flax_variables to fill: any value it misses
    stays garbage and shows."""
    with torch.device("meta"):
        twin = torch_models.create_model(config, classes, shape)
    twin = twin.to_empty(device="cpu")
    for layer in twin.modules():
        if isinstance(layer, torch.nn.BatchNorm2d):
            layer.num_batches_tracked.zero_()
    return twin


@pytest.mark.parametrize("name,classes,stem,shape,expected", [
    ("resnet18", 10, "cifar", (32, 32, 3), 11_173_962),
    ("resnet18", 10, "imagenet", (64, 64, 3), 11_181_642),
    ("resnet18", 10, "auto", (32, 32, 3), 11_173_962),
    ("resnet34", 1000, "imagenet", (224, 224, 3), 21_797_672),
    ("resnet50", 1000, "imagenet", (224, 224, 3), 25_557_032),
    ("resnet50", 10, "cifar", (32, 32, 3), 23_520_842),
])
def test_resnet_twin_parameters_are_flaxs(name, classes, stem, shape, expected):
    """The same count, and every torch parameter at a Flax path of the same shape (what
    optimizer.groups and load_flax_variables rely on)."""
    config = model_config(name, stem=stem)
    model = models.create_model(config, classes, jnp.float32, shape)
    abstract = jax.eval_shape(functools.partial(model.init, train=False), jax.random.key(0),
                              jnp.zeros((1, *shape)))
    assert models.count_params(abstract["params"]) == expected
    with torch.device("meta"):  # shapes only: no memory, no init time
        twin = torch_models.create_model(config, classes, shape)
    assert torch_models.count_params(twin) == expected
    assert sum(p.numel() for p in twin.parameters()) == expected
    flax_shapes = {path: leaf.shape for path, leaf in flax_leaves(abstract["params"]).items()}
    paths = torch_models.flax_param_paths(twin)
    assert sorted(paths.values()) == sorted(flax_shapes)
    for param, path in paths.items():
        layout = {4: (3, 2, 0, 1), 2: (1, 0), 1: (0,)}[len(flax_shapes[path])]  # HWIO -> OIHW
        assert tuple(param.shape) == tuple(flax_shapes[path][i] for i in layout), path


@pytest.mark.slow
def test_resnet_twin_initialisation_is_flaxs():
    """lecun_normal kernels, zero dense bias, BN weight 1 and bias 0 except the residual
    branch's last BN weight, 0 (the Flax model's zero_scale)."""
    twin = torch_models.create_model(model_config("resnet18", stem="cifar"), 10, (32, 32, 3))
    paths = {path: p.detach() for p, path in torch_models.flax_param_paths(twin).items()}
    for path, value in paths.items():
        if path.endswith("/kernel"):
            fan_in = value[0].numel()
            assert float(value.abs().max()) <= 2 * np.sqrt(1 / fan_in) / 0.8796 + 1e-6, path
            if value.numel() > 10_000:
                assert float(value.std()) == pytest.approx(np.sqrt(1 / fan_in), rel=0.05), path
        elif path.endswith("/bias"):
            assert not value.any(), path
    zero = [path for path, value in paths.items() if path.endswith("/scale") and not value.any()]
    assert zero == [f"ResNetBlock_{i}/BatchNorm_1/scale" for i in range(8)]
    ones = [path for path, value in paths.items() if path.endswith("/scale") and value.any()]
    assert all(bool((paths[path] == 1).all()) for path in ones) and len(ones) == 1 + 8 + 3


@pytest.mark.slow
@pytest.mark.parametrize("stem,size", [("cifar", 32), ("imagenet", 64)])
def test_resnet_twins_with_copied_weights_compute_the_same_function(stem, size):
    """Eval mode, BatchNorm statistics and scales away from their initial values: the
    stems (the imagenet one's padded 7x7 conv and max-pool), strided convs, projections
    and the pooled head."""
    shape = (size, size, 3)
    config = model_config("resnet18", stem=stem)
    model = models.create_model(config, 10, jnp.float32, shape)
    variables = random_resnet_variables(model, shape)
    twin = torch_models.load_flax_variables(uninitialised_twin(config, 10, shape), variables,
                                            shape)
    x = np.random.default_rng(1).normal(size=(2, *shape)).astype(np.float32)
    expected = np.asarray(jax.jit(functools.partial(model.apply, train=False))(variables, x))
    with torch.no_grad():
        got = twin.eval()(torch.from_numpy(x).permute(0, 3, 1, 2)).numpy()
    assert np.abs(expected).max() > 1  # not a near-constant function
    np.testing.assert_allclose(got, expected, rtol=TRAINING_STEPS, atol=TRAINING_STEPS)


@pytest.mark.slow
def test_one_sgd_step_is_the_same_for_the_resnet18_twins(cifar_batches_dir):
    """As test_one_sgd_step_is_the_same_in_both_frameworks, for resnet18 (the cifar stem:
    no max-pool, whose gradient ties XLA and torch break differently), with a
    parameter group (no weight decay for BatchNorm and biases, half the learning
    rate) that the twin must find by its Flax paths.

    In float64, from the same float64 inputs: a ReLU input within rounding of 0
    sends the gradient one way in XLA and the other in torch. ResNet-18 on 8 images
    has ~5M ReLU inputs; in float32 the frameworks' activations differ by ~1e-5
    after a few BatchNorms, and even in float64 the 1-ulp float32 differences of the
    two normalisations (XLA divides by a constant as a multiply by its reciprocal,
    and fuses) are enough: such flips hit 8 of 8 random draws in float32 and 3 of 6
    in float64, moving whole gradients by 1-10%. So the step is train_step's after
    the normalisation (the other step tests cover that part), on inputs normalised once."""
    import optax

    config = cifar.get_config()
    config.model = model_config("resnet18", stem="cifar")
    config.optimizer.schedule = "constant"
    config.optimizer.learning_rate = 0.05
    config.optimizer.momentum = 0.9
    config.optimizer.nesterov = True
    config.optimizer.weight_decay = 5e-3
    config.optimizer.groups.no_decay = default.param_group(
        r"(.*/)?BatchNorm_\d+/(scale|bias)|Dense_0/bias", weight_decay=0.0, lr_scale=0.5)
    config.train.label_smoothing = 0.2
    dataset = data.load("cifar10", "files", str(cifar_batches_dir))
    mean, std = inputs_lib.channel_stats(dataset, config.data)
    images, labels = dataset.x_train[:8], dataset.y_train[:8]
    inputs = (images / 255.0 - np.asarray(mean)) / np.asarray(std)  # float64, NHWC
    shape = dataset.image_shape

    with jax.enable_x64(True):
        # jaxtrain's step (step.train_step from its normalised inputs on), from random
        # weights (random_resnet_variables: a zero BN scale leaves its branch no gradient)
        flax_model = models.create_model(config.model, 10, jnp.float64, shape)
        variables = random_resnet_variables(flax_model, shape, dtype=np.float64)
        tx = optim.create_optimizer(config.optimizer, optim.create_schedule(config.optimizer, 10))
        state = jax.jit(lambda v: train_state.TrainState.create(  # one program, not one per leaf
            apply_fn=flax_model.apply, params=v["params"], tx=tx,
            batch_stats=v["batch_stats"]))(variables)
        targets = optax.smooth_labels(jax.nn.one_hot(labels, 10), config.train.label_smoothing)

        @jax.jit
        def step(state, inputs, targets):
            def loss_fn(params):
                logits, updates = state.apply_fn(
                    {"params": params, "batch_stats": state.batch_stats}, inputs, train=True,
                    mutable=["batch_stats"])
                return optax.softmax_cross_entropy(logits, targets).mean(), updates
            (loss, updates), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
            return state.apply_gradients(grads=grads, batch_stats=updates["batch_stats"]), loss

        new_state, flax_loss = jax.device_get(step(state, inputs, targets))
    old, new = flax_leaves(variables["params"]), flax_leaves(new_state.params)
    assert new["Conv_0/kernel"].dtype == np.float64

    # the comparison's torch step, from the same weights
    twin = uninitialised_twin(config.model, 10, shape).double()
    torch_models.load_flax_variables(twin, variables, shape)  # float32 draws: copied exactly
    optimizer = torch_optim.create_torch_optimizer(config.optimizer, twin, 10)
    assert sorted(len(group["params"]) for group in optimizer.param_groups) == [21, 41]
    criterion = torch.nn.CrossEntropyLoss(label_smoothing=config.train.label_smoothing)
    loss = runner.torch_step(twin, optimizer, criterion,
                             torch.from_numpy(inputs).permute(0, 3, 1, 2),
                             torch.from_numpy(labels).long(), 0)
    assert loss.item() == pytest.approx(float(flax_loss), rel=ELEMENTWISE)

    for path in ("Conv_0/kernel", "ResNetBlock_7/Conv_1/kernel", "ResNetBlock_0/BatchNorm_1/scale",
                 "ResNetBlock_2/Conv_2/kernel", "Dense_0/bias"):
        assert np.abs(new[path] - old[path]).max() > 1e-4, path  # the step moved the weights
    names = {param: name for name, param in twin.named_parameters()}
    for param, path in torch_models.flax_param_paths(twin).items():
        value = new[path]
        value = value.transpose(3, 2, 0, 1) if value.ndim == 4 else value.T
        # float64, yet they part by float32's rounding: up to 5.6e-9 (the head's kernel)
        np.testing.assert_allclose(param.detach().numpy(), value, rtol=ELEMENTWISE,
                                   atol=ELEMENTWISE * 0.01, err_msg=f"{names[param]} ({path})")
    stats = flax_leaves(new_state.batch_stats)
    for layer, path in torch_models.flax_named_layers(twin):
        if isinstance(layer, torch.nn.BatchNorm2d):  # running_var: torch's is unbiased
            np.testing.assert_allclose(layer.running_mean.numpy(), stats[path + "/mean"],
                                       rtol=ELEMENTWISE, atol=ELEMENTWISE * 0.01, err_msg=path)
