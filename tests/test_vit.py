"""jaxtrain.vit against timm's VisionTransformer: the same parameters under one naming
rule, the same logits from the same weights, timm's position-embedding resampling,
and the PyTorch twin in jaxtrain.torch_models.

32x32 images (a 2x2 grid of 16-pixel patches) keep every forward pass small; the
dropout tests use vit_tiny's width with 2 blocks, since each mode compiles anew.
"""
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import require_module
from tolerances import ELEMENTWISE, NETWORK_PASS, TRAINING_STEPS

from jaxtrain import models
from jaxtrain.baselines import torch_models
from jaxtrain.config import defaults
from jaxtrain.models import vit

timm = require_module("timm", "pip install -e '.[weights]'")

TIMM_NAMES = {"vit_tiny": "vit_tiny_patch16_224", "vit_small": "vit_small_patch16_224",
              "vit_base": "vit_base_patch16_224"}
NUM_CLASSES = 10
SIZE = 32


def flax_vit(name: str, **kwargs) -> vit.ViT:
    dim, depth, heads = vit.VITS[name]
    return vit.ViT(NUM_CLASSES, dim, depth, heads, **kwargs)


def abstract_params(model, size: int = SIZE):
    """The params' shapes, without running an initialiser."""
    return jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, size, size, 3)))["params"]


def timm_vit(name: str, device: str = "cpu", size: int = SIZE):
    """timm's model, random init (on 'meta': shapes only, no memory or time)."""
    with torch.device(device):
        return timm.create_model(TIMM_NAMES[name], pretrained=False, img_size=size,
                                 num_classes=NUM_CLASSES).eval()


def flax_path(key: str) -> tuple:
    """The naming rule weights.py relies on, written from the torch side: split on '.',
    glue a number to the piece before it with '_', the leaf `weight` is `kernel`
    (Dense, Conv) or `scale` (LayerNorm)."""
    pieces = []
    for piece in key.split("."):
        if piece.isdigit():
            pieces[-1] += f"_{piece}"
        else:
            pieces.append(piece)
    if pieces[-1] == "weight":
        pieces[-1] = "scale" if re.fullmatch(r"norm\d*", pieces[-2]) else "kernel"
    return tuple(pieces)


def flax_layout(array: np.ndarray, path: tuple) -> np.ndarray:
    """A torch tensor in Flax's layout: Dense (out, in) -> (in, out), Conv OIHW -> HWIO."""
    if path[-1] == "kernel":
        return array.T if array.ndim == 2 else array.transpose(2, 3, 1, 0)
    return array


def to_flax(state_dict) -> dict:
    params = {}
    for key, tensor in state_dict.items():
        path = flax_path(key)
        node = params
        for scope in path[:-1]:
            node = node.setdefault(scope, {})
        node[path[-1]] = flax_layout(tensor.detach().numpy(), path)
    return params


def random_timm_vit(name: str, seed: int = 0):
    """timm's model with random parameters: LayerNorm weights near 1, everything else
    (biases too) N(0, 0.05^2), so a swapped or untransposed tensor changes the logits.
    (Built on 'meta' and filled here: timm's own init takes seconds.)"""
    model = timm_vit(name, "meta").to_empty(device="cpu")
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for key, param in model.named_parameters():
            mean = 1.0 if re.search(r"norm\d*\.weight$", key) else 0.0
            param.copy_(mean + 0.05 * torch.randn(param.shape, generator=generator))
    assert len(model.state_dict()) == len(list(model.parameters()))  # no buffers
    return model


@pytest.fixture(scope="module")
def tiny():
    """A random timm vit_tiny and its params converted by the rule."""
    model = random_timm_vit("vit_tiny")
    return model, to_flax(model.state_dict())


@pytest.fixture(scope="module")
def images(cifar_subset):
    """4 real CIFAR-10 test images, normalised as timm's ViTs expect (mean 0.5, std 0.5)."""
    return ((cifar_subset["x_test"][:4].astype(np.float32) / 255 - 0.5) / 0.5)


def flax_logits(model, params, images) -> np.ndarray:
    """model's logits in one compiled program (op by op, a 12-block ViT's forward pass
    compiles each of its operations on its own)."""
    return np.asarray(jax.jit(model.apply)({"params": params}, images))


@pytest.fixture(scope="module")
def tiny_logits(tiny, images):
    """The float32 Flax vit_tiny's logits of `images` with `tiny`'s converted params."""
    return flax_logits(flax_vit("vit_tiny"), tiny[1], images)


def timm_logits(model, images) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(images).permute(0, 3, 1, 2)).numpy()


def assert_logits_close(actual, expected):
    np.testing.assert_allclose(actual, expected, rtol=TRAINING_STEPS, atol=TRAINING_STEPS * 0.1)


# ---------------------------------------------------------------- the parameters

@pytest.mark.parametrize("name", list(vit.VITS))
def test_param_count_is_timms(name):
    expected = sum(p.numel() for p in timm_vit(name, "meta").parameters())
    assert models.count_params(abstract_params(flax_vit(name))) == expected


@pytest.mark.parametrize("name", ["vit_tiny", "vit_small"])
def test_torch_paths_cover_timms_keys_with_matching_shapes(name):
    state = timm_vit(name, "meta").state_dict()
    params = abstract_params(flax_vit(name))
    paths = vit.torch_paths(params)
    assert set(paths) == set(state)
    flat = dict(jax.tree_util.tree_flatten_with_path(params)[0])
    assert len(flat) == len(paths)  # every Flax param has a key
    for key, path in paths.items():
        assert path == flax_path(key), key  # the one rule, from either side
        leaf = params
        for scope in path:
            leaf = leaf[scope]
        expected = flax_layout(np.empty(state[key].shape, np.float32), path).shape
        assert leaf.shape == expected, key
    assert paths["blocks.3.attn.qkv.weight"] == ("blocks_3", "attn", "qkv", "kernel")
    assert params["pos_embed"].shape == (1, 1 + 4, vit.VITS[name][0])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["vit_tiny", "vit_small"])
def test_timm_weights_give_timms_logits(name, images, tiny, request):
    if name == "vit_tiny":
        model, logits = tiny[0], request.getfixturevalue("tiny_logits")
    else:
        model = random_timm_vit(name)
        logits = flax_logits(flax_vit(name), to_flax(model.state_dict()), images)
    assert logits.dtype == np.float32 and logits.shape == (4, NUM_CLASSES)
    assert_logits_close(logits, timm_logits(model, images))


def test_an_image_size_off_the_patch_grid_is_refused():
    with pytest.raises(ValueError, match="not a multiple of the patch size 16"):
        abstract_params(flax_vit("vit_tiny"), size=40)


# ---------------------------------------------------------------- position embeddings

@pytest.mark.parametrize("old, new", [(2, 4), (14, 7), (14, 24), (3, 5)])
@pytest.mark.parametrize("antialias", [True, False])
def test_resample_pos_embed_is_timms(old, new, antialias):
    from timm.layers import resample_abs_pos_embed

    table = torch.randn(1, 1 + old * old, 16, generator=torch.Generator().manual_seed(old))
    expected = resample_abs_pos_embed(table, [new, new], antialias=antialias).numpy()
    resampled = vit.resample_pos_embed(table.numpy(), (new, new), antialias=antialias)
    assert resampled.shape == (1, 1 + new * new, 16) and resampled.dtype == np.float32
    np.testing.assert_allclose(resampled, expected, rtol=0, atol=NETWORK_PASS)
    np.testing.assert_array_equal(resampled[:, 0], table.numpy()[:, 0])  # the class token


def test_resample_pos_embed_is_what_timm_loads_for_another_image_size(tiny):
    """timm's checkpoint filter (its path for pretrained weights at another size) resizes a
    32-pixel model's table to a 64-pixel model's as resample_pos_embed does."""
    from timm.models.vision_transformer import checkpoint_filter_fn

    small, large = tiny[0], timm_vit("vit_tiny", "meta", size=64)
    expected = checkpoint_filter_fn(small.state_dict(), large)["pos_embed"].numpy()
    resampled = vit.resample_pos_embed(small.pos_embed.detach().numpy(), (4, 4))
    np.testing.assert_allclose(resampled, expected, rtol=0, atol=NETWORK_PASS)


# ---------------------------------------------------------------- dropout, drop_path

def small_vit(**kwargs) -> vit.ViT:
    return vit.ViT(NUM_CLASSES, 192, 2, 3, **kwargs)


def random_params(model, seed: int = 0):
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda s: rng.normal(0, 0.05, s.shape).astype(np.float32),
                        abstract_params(model))


@pytest.mark.slow
def test_dropout_and_drop_path_act_only_in_training(images):
    model = small_vit(dropout=0.1, drop_path=0.5)
    params = random_params(model)
    train = jax.jit(lambda key: model.apply({"params": params}, images, train=True,
                                            rngs={"dropout": key}))
    evaluate = jax.jit(lambda: model.apply({"params": params}, images))
    key = jax.random.key(1)
    np.testing.assert_array_equal(train(key), train(key))
    assert not np.allclose(train(key), train(jax.random.key(2)))
    assert not np.allclose(train(key), evaluate())
    np.testing.assert_array_equal(evaluate(), evaluate())
    plain = small_vit()  # no dropout, no drop path: training computes what evaluation does
    np.testing.assert_allclose(*jax.jit(lambda key: (  # one program
        plain.apply({"params": params}, images, train=True, rngs={"dropout": key}),
        plain.apply({"params": params}, images)))(key), rtol=ELEMENTWISE, atol=ELEMENTWISE)


class DropPath(nn.Module):
    @nn.compact
    def __call__(self, x):
        return vit.stochastic_depth(x, 0.25, train=True)


def test_drop_path_drops_whole_samples_and_rescales_the_rest():
    y = jax.jit(lambda key: DropPath().apply({}, jnp.ones((256, 5, 8)), rngs={"dropout": key}))(
        jax.random.key(0))  # one program, not one per operation
    per_sample = np.asarray(y).reshape(256, -1)
    assert set(np.unique(per_sample)) <= {0.0, np.float32(1 / 0.75)}
    assert (per_sample == per_sample[:, :1]).all()  # one decision per sample
    assert 0.1 < (per_sample[:, 0] == 0).mean() < 0.4


def test_drop_path_rates_rise_linearly_as_timms():
    with torch.device("meta"):
        model = timm.create_model(TIMM_NAMES["vit_tiny"], pretrained=False, img_size=SIZE,
                                  drop_path_rate=0.3, proj_drop_rate=0.1)
    timm_rates = [block.drop_path1.drop_prob if hasattr(block.drop_path1, "drop_prob") else 0.0
                  for block in model.blocks]
    twin = torch_models.vit("vit_tiny", NUM_CLASSES, (SIZE, SIZE, 3), 0.1, 0.3)
    # torch's float32 linspace against float64's, of rates up to 0.3
    np.testing.assert_allclose([block.drop_path for block in twin.blocks], timm_rates,
                               atol=ELEMENTWISE * 0.1)
    np.testing.assert_allclose(np.linspace(0, 0.3, 12), timm_rates, atol=ELEMENTWISE * 0.1)


# ---------------------------------------------------------------- config, twin, bfloat16

def model_config(name: str, **settings):
    config = defaults.get_config().model
    config.name = name
    config.update(settings)
    return config


def test_create_model_builds_the_vits():
    model = models.create_model(model_config("vit_small", dropout=0.1, drop_path=0.2), 7,
                                jnp.bfloat16)
    assert isinstance(model, vit.ViT)
    assert (model.num_classes, model.dim, model.depth, model.heads) == (7, 384, 12, 6)
    assert (model.dropout, model.drop_path, model.dtype) == (0.1, 0.2, jnp.bfloat16)
    assert set(vit.VITS) <= set(models.MODEL_NAMES)
    assert not any(models.is_convolutional(name) for name in vit.VITS)
    with pytest.raises(ValueError, match="vit_tiny, vit_small, vit_base"):
        models.create_model(model_config("vit_huge"), 7, jnp.float32)
    assert torch_models.VITS == vit.VITS


def test_torch_twin_computes_the_flax_logits(images, tiny, tiny_logits):
    timm_model, params = tiny
    expected = tiny_logits
    twin = torch_models.create_model(model_config("vit_tiny"), NUM_CLASSES, (SIZE, SIZE, 3))
    assert set(twin.state_dict()) == set(timm_model.state_dict())  # timm's names too
    torch_models.load_flax_variables(twin.eval(), {"params": params}, (SIZE, SIZE, 3))
    assert_logits_close(timm_logits(twin, images), expected)
    assert torch_models.count_params(twin) == models.count_params(params)
    paths = set(torch_models.flax_param_paths(twin).values())
    assert paths == {"/".join(path) for path in vit.torch_paths(params).values()}


def test_bfloat16_computes_in_bfloat16_and_returns_float32_logits(images, tiny, tiny_logits):
    _, params = tiny
    apply = flax_vit("vit_tiny", dtype=jnp.bfloat16).apply
    program = str(jax.make_jaxpr(apply)({"params": params}, images))
    products = [line for line in program.splitlines()
                if "dot_general[" in line or "conv_general_dilated[" in line]
    assert len(products) == 1 + 12 * 6 + 1  # patch conv; qkv, 2 attention, proj, fc1, fc2; head
    assert all(re.search(r":bf16\[[\d,]*\] = (dot_general|conv_general_dilated)\[", line)
               for line in products), products
    logits = jax.jit(apply)({"params": params}, images)
    assert logits.dtype == jnp.float32 and logits.shape == (4, NUM_CLASSES)
    exact = tiny_logits  # float32's
    assert np.isfinite(logits).all()
    assert np.abs(logits - exact).max() < 0.1 * np.abs(exact).max()
