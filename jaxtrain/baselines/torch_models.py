"""The PyTorch side of jaxtrain.compare: twins of jaxtrain/models/ and of its input path.

The twins have the same layers, parameter counts and initialisation schemes
as the Flax models, so a comparison measures the frameworks and not two
different networks; `load_flax_variables` copies Flax weights into a twin
(the tests use it to show one training step gives the same result in both).
The augmentations draw the same distributions as jaxtrain/training/augment.py and move
the same pixels; they work on (N, C, H, W) batches of any dtype, so the same
code serves per-sample transforms (a batch of one), on-device batches and whole
epochs (torch_fast: draw_augmentation for the epoch, one apply_augmentation).

Two differences stay: in training, torch BatchNorm updates its running
variance with the unbiased batch variance (n / (n - 1) times Flax's), which only
the evaluation of BatchNorm models sees; and where a max-pool window holds
equal values (flat image regions), torch and XLA send its gradient to
different, equally valid elements.
"""
import copy
import math

import numpy as np
import torch
from torch import nn


class Scale(nn.Module):
    """Multiplies the logits, in float32, by a constant (cifar_cnn's head_scale)."""

    def __init__(self, scale: float):
        super().__init__()
        self.scale = scale

    def forward(self, x):
        return x.float() * self.scale

    def extra_repr(self):
        return f"scale={self.scale:g}"


def batch_norm(features: int, flax_momentum: float, use_scale: bool = True, dims: int = 2,
               eps: float = 1e-5):
    """Flax BatchNorm(momentum=m, epsilon=eps) is torch momentum 1 - m, the same eps.

    Flax's use_scale=False becomes a torch weight frozen at 1, so it neither
    trains nor counts as a parameter.
    """
    bn = (nn.BatchNorm2d if dims == 2 else nn.BatchNorm1d)(features, eps=eps,
                                                            momentum=1.0 - flax_momentum)
    if not use_scale:
        bn.weight.requires_grad_(False)
    return bn


def activation(name: str) -> nn.Module:
    """The twin of jaxtrain.models.cnn.activation_fn."""
    layers = {"gelu_tanh": lambda: nn.GELU(approximate="tanh"), "gelu": nn.GELU,
              "silu": nn.SiLU, "relu": nn.ReLU}
    if name not in layers:
        raise ValueError(f"unknown model.activation {name!r}; choose one of: "
                         + ", ".join(layers))
    return layers[name]()


@torch.no_grad()
def dirac_(conv: nn.Conv2d) -> nn.Conv2d:
    """jaxtrain.models.cnn.dirac_kernel_init's identity: the first min(C_in, C_out) filters
    pass their input channel through (centre tap 1, the rest 0); the others keep
    their initialisation."""
    out_channels, in_channels, height, width = conv.weight.shape
    n = min(in_channels, out_channels)
    conv.weight[:n] = 0
    conv.weight[torch.arange(n), torch.arange(n), height // 2, width // 2] = 1
    return conv


def lecun_normal_(model: nn.Module) -> nn.Module:
    """Flax's default init: kernels truncated normal (at 2 std) with variance 1/fan_in,
    zero biases (torch's own default is a uniform distribution)."""
    for layer in model.modules():
        if isinstance(layer, (nn.Conv2d, nn.Linear)):
            fan_in = layer.weight[0].numel()
            std = math.sqrt(1.0 / fan_in) / 0.87962566103423978  # std of N(0, 1) cut at +-2
            nn.init.trunc_normal_(layer.weight, std=std, a=-2 * std, b=2 * std)
            if layer.bias is not None:
                nn.init.zeros_(layer.bias)
    return model


def seed_cnn(num_classes: int, image_shape, use_batch_norm: bool = False) -> nn.Sequential:
    """The seed article's Net (conv 6@5x5, pool, conv 16@5x5, pool, dense 120, 84), in
    PyTorch's default initialisation, which the Flax model copies."""
    height, width, channels = image_shape
    layers = []
    for in_channels, out_channels in ((channels, 6), (6, 16)):
        layers.append(nn.Conv2d(in_channels, out_channels, 5))
        if use_batch_norm:
            layers.append(batch_norm(out_channels, 0.9))
        layers += [nn.ReLU(), nn.MaxPool2d(2)]
        height, width = (height - 4) // 2, (width - 4) // 2
    layers.append(nn.Flatten())
    features = 16 * height * width
    for size in (120, 84):
        layers.append(nn.Linear(features, size))
        if use_batch_norm:
            layers.append(batch_norm(size, 0.9, dims=1))
        layers.append(nn.ReLU())
        features = size
    layers.append(nn.Linear(features, num_classes))
    return nn.Sequential(*layers)


def cifar_cnn(num_classes: int, image_shape, widths=(64, 256, 256), stem_width: int = 24,
              bn_momentum: float = 0.6, head_scale: float = 1.0 / 9.0,
              activation_name: str = "gelu_tanh", conv_init: str = "default",
              bn_epsilon: float = 1e-5, head_init_std: float = 0.0) -> nn.Sequential:
    """2x2 stem conv, three blocks (each an inner Sequential, Flax's ConvBlock), global
    max-pool, bias-free head times head_scale; the options are CifarCNN's."""
    if conv_init not in ("default", "dirac"):
        raise ValueError(f"unknown model.conv_init {conv_init!r}; choose one of: default, dirac")
    layers = [nn.Conv2d(image_shape[-1], stem_width, 2), activation(activation_name)]
    in_channels, block_convs = stem_width, []
    for width in widths:
        convs = [nn.Conv2d(in_channels, width, 3, padding=1, bias=False),
                 nn.Conv2d(width, width, 3, padding=1, bias=False)]
        layers.append(nn.Sequential(
            convs[0], nn.MaxPool2d(2),
            batch_norm(width, bn_momentum, use_scale=False, eps=bn_epsilon),
            activation(activation_name), convs[1],
            batch_norm(width, bn_momentum, use_scale=False, eps=bn_epsilon),
            activation(activation_name)))
        block_convs += convs
        in_channels = width
    head = nn.Linear(in_channels, num_classes, bias=False)
    layers += [nn.AdaptiveMaxPool2d(1), nn.Flatten(), head, Scale(head_scale)]
    model = lecun_normal_(nn.Sequential(*layers))
    if conv_init == "dirac":
        for conv in block_convs:
            dirac_(conv)
    if head_init_std > 0:
        nn.init.normal_(head.weight, std=head_init_std)
    return model


def mlp(num_classes: int, image_shape, hidden_sizes=(256, 128, 100), use_batch_norm=True,
        dropout: float = 0.0) -> nn.Sequential:
    """Dense - BatchNorm1d - ReLU (- dropout) per hidden layer on flattened images."""
    layers, features = [nn.Flatten()], int(np.prod(image_shape))
    for size in hidden_sizes:
        layers.append(nn.Linear(features, size))
        if use_batch_norm:
            layers.append(batch_norm(size, 0.9, dims=1))
        layers.append(nn.ReLU())
        if dropout > 0:
            layers.append(nn.Dropout(dropout))
        features = size
    layers.append(nn.Linear(features, num_classes))
    return lecun_normal_(nn.Sequential(*layers))


def flax_named(module: nn.Module, path: str) -> nn.Module:
    """Records the Flax scope of a Conv2d, Linear, BatchNorm or LayerNorm
    ('ResNetBlock_3/Conv_1'), so flax_param_paths and load_flax_variables map it by
    name and not by position. A module's own parameters outside any layer (a ViT's
    cls_token) are recorded in its `flax_raw` dict: {attribute: Flax path}."""
    module.flax_path = path
    return module


class ResNetBlock(nn.Module):
    """The twin of jaxtrain.models.resnet.ResNetBlock (bottleneck=False) and
    BottleneckResNetBlock (True): conv - BN pairs along the residual branch with a
    ReLU between pairs, the last BN's weight zero, a strided 1x1 conv - BN shortcut
    where the shape changes, ReLU after the sum. `scope`: the block's Flax name."""

    def __init__(self, in_channels: int, filters: int, stride: int, bottleneck: bool,
                 scope: str):
        super().__init__()
        if bottleneck:  # the stride on the 3x3 conv (torchvision's v1.5)
            specs = [(filters, 1, 1), (filters, 3, stride), (4 * filters, 1, 1)]
        else:
            specs = [(filters, 3, stride), (filters, 3, 1)]
        convs, norms, channels = [], [], in_channels
        for i, (out_channels, size, conv_stride) in enumerate(specs):
            convs.append(flax_named(nn.Conv2d(channels, out_channels, size, conv_stride,
                                              padding=size // 2, bias=False),
                                    f"{scope}/Conv_{i}"))
            norms.append(flax_named(batch_norm(out_channels, 0.9), f"{scope}/BatchNorm_{i}"))
            channels = out_channels
        nn.init.zeros_(norms[-1].weight)
        self.convs, self.norms = nn.ModuleList(convs), nn.ModuleList(norms)
        self.shortcut = None
        if stride != 1 or in_channels != channels:  # Flax: where the shape changes
            n = len(specs)  # Flax creates the projection after the branch
            self.shortcut = nn.Sequential(
                flax_named(nn.Conv2d(in_channels, channels, 1, stride, bias=False),
                           f"{scope}/Conv_{n}"),
                flax_named(batch_norm(channels, 0.9), f"{scope}/BatchNorm_{n}"))
        self.out_channels = channels

    def forward(self, x):
        y = x
        for i, (conv, norm) in enumerate(zip(self.convs, self.norms)):
            y = norm(conv(y))
            if i < len(self.convs) - 1:
                y = torch.relu(y)
        return torch.relu(y + (x if self.shortcut is None else self.shortcut(x)))


class ResNet(nn.Module):
    """The twin of jaxtrain.models.resnet.ResNet: stem, blocks, global average pool, dense head;
    float32 logits. Every Conv2d, BatchNorm and Linear records its Flax path."""

    def __init__(self, stage_sizes, bottleneck: bool, num_classes: int, image_shape,
                 stem: str, width: int = 64):
        super().__init__()
        size, stride = (7, 2) if stem == "imagenet" else (3, 1)  # 'imagenet' or 'cifar'
        stem_layers = [flax_named(nn.Conv2d(image_shape[-1], width, size, stride,
                                            padding=size // 2, bias=False), "Conv_0"),
                       flax_named(batch_norm(width, 0.9), "BatchNorm_0"), nn.ReLU()]
        if stem == "imagenet":
            stem_layers.append(nn.MaxPool2d(3, 2, padding=1))
        self.stem = nn.Sequential(*stem_layers)
        kind = "BottleneckResNetBlock" if bottleneck else "ResNetBlock"
        blocks, channels = [], width
        for i, size in enumerate(stage_sizes):
            for j in range(size):
                block = ResNetBlock(channels, width * 2 ** i, 2 if i > 0 and j == 0 else 1,
                                    bottleneck, f"{kind}_{len(blocks)}")
                blocks.append(block)
                channels = block.out_channels
        self.blocks = nn.Sequential(*blocks)
        self.head = flax_named(nn.Linear(channels, num_classes), "Dense_0")

    def forward(self, x):
        x = self.blocks(self.stem(x))
        return self.head(x.mean(dim=(2, 3))).float()


RESNETS = {18: ((2, 2, 2, 2), False), 34: ((3, 4, 6, 3), False), 50: ((3, 4, 6, 3), True)}


def resnet(depth: int, num_classes: int, image_shape, stem: str = "auto") -> ResNet:
    """ResNet-18, 34 or 50 as jaxtrain.models builds it (its stem rule for 'auto'), with
    Flax's lecun_normal kernels, zero dense bias and zero last-BN weight per block."""
    from jaxtrain.models import (
        resnet as resnet_lib,  # the stem rule; here so importing this module needs no Flax
    )

    if depth not in RESNETS:
        raise ValueError(f"resnet depth must be one of {sorted(RESNETS)}, got {depth}")
    stage_sizes, bottleneck = RESNETS[depth]
    model = ResNet(stage_sizes, bottleneck, num_classes, image_shape,
                   resnet_lib.resnet_stem(stem, image_shape))
    return lecun_normal_(model)  # convs and the head only: the zero BN weights stay


def stochastic_depth(x, rate: float, training: bool):
    """Drops the residual branch of whole samples, the kept ones scaled by 1 / (1 - rate)."""
    if not training or rate == 0:
        return x
    keep = torch.rand(x.shape[0], *(1,) * (x.ndim - 1), device=x.device) >= rate
    return x * keep.to(x.dtype) / (1 - rate)


class ViTAttention(nn.Module):
    """jaxtrain.models.vit.Attention: fused qkv, softmax(q k^T / sqrt(head_dim)) v, proj,
    dropout."""

    def __init__(self, dim: int, heads: int, dropout: float, scope: str):
        super().__init__()
        self.heads = heads
        self.qkv = flax_named(nn.Linear(dim, 3 * dim), f"{scope}/qkv")
        self.proj = flax_named(nn.Linear(dim, dim), f"{scope}/proj")
        self.proj_drop = nn.Dropout(dropout)

    def forward(self, x):
        n, tokens, dim = x.shape
        q, k, v = self.qkv(x).reshape(n, tokens, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        weights = torch.softmax(q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5, dim=-1)
        x = (weights @ v).transpose(1, 2).reshape(n, tokens, dim)
        return self.proj_drop(self.proj(x))


class ViTMlp(nn.Module):
    """jaxtrain.models.vit.Mlp: fc1, exact GELU, dropout, fc2, dropout."""

    def __init__(self, dim: int, hidden: int, dropout: float, scope: str):
        super().__init__()
        self.fc1 = flax_named(nn.Linear(dim, hidden), f"{scope}/fc1")
        self.fc2 = flax_named(nn.Linear(hidden, dim), f"{scope}/fc2")
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        return self.drop(self.fc2(self.drop(nn.functional.gelu(self.fc1(x)))))


class ViTBlock(nn.Module):
    """jaxtrain.models.vit.Block: x + attn(norm1(x)), x + mlp(norm2(x)), LayerNorm eps 1e-6,
    each branch under its own stochastic-depth draw."""

    def __init__(self, dim: int, heads: int, mlp_ratio: float, dropout: float,
                 drop_path: float, scope: str):
        super().__init__()
        self.norm1 = flax_named(nn.LayerNorm(dim, eps=1e-6), f"{scope}/norm1")
        self.attn = ViTAttention(dim, heads, dropout, f"{scope}/attn")
        self.norm2 = flax_named(nn.LayerNorm(dim, eps=1e-6), f"{scope}/norm2")
        self.mlp = ViTMlp(dim, int(dim * mlp_ratio), dropout, f"{scope}/mlp")
        self.drop_path = drop_path

    def forward(self, x):
        x = x + stochastic_depth(self.attn(self.norm1(x)), self.drop_path, self.training)
        return x + stochastic_depth(self.mlp(self.norm2(x)), self.drop_path, self.training)


class ViTPatchEmbed(nn.Module):
    """One strided conv over non-overlapping patches: NCHW -> (N, tokens, dim), row-major."""

    def __init__(self, channels: int, dim: int, patch_size: int):
        super().__init__()
        self.proj = flax_named(nn.Conv2d(channels, dim, patch_size, patch_size),
                               "patch_embed/proj")

    def forward(self, x):
        return self.proj(x).flatten(2).transpose(1, 2)


class ViT(nn.Module):
    """The twin of jaxtrain.models.vit.ViT, with timm's module names (its state_dict keys are
    timm's): patch conv, class token and position embeddings (raw parameters,
    flax_raw), blocks, final LayerNorm, head on the class token; float32 logits."""

    def __init__(self, num_classes: int, image_shape, dim: int, depth: int, heads: int,
                 patch_size: int = 16, mlp_ratio: float = 4, dropout: float = 0.0,
                 drop_path: float = 0.0):
        super().__init__()
        height, width, channels = image_shape
        if height % patch_size or width % patch_size:
            raise ValueError(f"ViT: image size {height}x{width} is not a multiple of the "
                             f"patch size {patch_size}")
        self.patch_embed = ViTPatchEmbed(channels, dim, patch_size)
        tokens = (height // patch_size) * (width // patch_size)
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim) * 1e-6)
        self.pos_embed = nn.Parameter(torch.randn(1, 1 + tokens, dim) * 0.02)
        self.flax_raw = {"cls_token": "cls_token", "pos_embed": "pos_embed"}
        rates = torch.linspace(0, drop_path, depth).tolist()
        self.blocks = nn.Sequential(*[ViTBlock(dim, heads, mlp_ratio, dropout, rates[i],
                                               f"blocks_{i}") for i in range(depth)])
        self.norm = flax_named(nn.LayerNorm(dim, eps=1e-6), "norm")
        self.head = flax_named(nn.Linear(dim, num_classes), "head")
        for layer in self.modules():  # timm's (and jaxtrain.vit's) init; the conv keeps torch's
            if isinstance(layer, nn.Linear):
                nn.init.normal_(layer.weight, std=0.02)
                nn.init.zeros_(layer.bias)

    def forward(self, x):
        x = self.patch_embed(x)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        x = self.norm(self.blocks(x))
        return self.head(x[:, 0]).float()


# jaxtrain.models.vit.VITS (dim, depth, heads), repeated so importing this module needs no Flax
VITS = {"vit_tiny": (192, 12, 3), "vit_small": (384, 12, 6), "vit_base": (768, 12, 12)}


def vit(name: str, num_classes: int, image_shape, dropout: float = 0.0,
        drop_path: float = 0.0) -> ViT:
    """vit_tiny, vit_small or vit_base (jaxtrain.models.vit.VITS) for images of image_shape."""
    dim, depth, heads = VITS[name]
    return ViT(num_classes, image_shape, dim, depth, heads, dropout=dropout,
               drop_path=drop_path)


def create_model(model_config, num_classes: int, image_shape) -> nn.Module:
    """The twin of jaxtrain.models.create_model; image_shape is (H, W, C), inputs are NCHW."""
    name = model_config.name
    if name == "seed_cnn":
        return seed_cnn(num_classes, image_shape, model_config.batch_norm)
    if name == "cifar_cnn":
        return cifar_cnn(num_classes, image_shape, tuple(model_config.widths),
                         model_config.stem_width, model_config.bn_momentum,
                         model_config.head_scale,
                         activation_name=model_config.get("activation", "gelu_tanh"),
                         conv_init=model_config.get("conv_init", "default"),
                         bn_epsilon=model_config.get("bn_epsilon", 1e-5),
                         head_init_std=model_config.get("head_init_std", 0.0))
    if name == "mlp":
        return mlp(num_classes, image_shape, tuple(model_config.hidden_sizes),
                   model_config.batch_norm, model_config.dropout)
    if name in ("resnet18", "resnet34", "resnet50"):
        return resnet(int(name[len("resnet"):]), num_classes, image_shape,
                      model_config.get("stem", "auto"))
    if name in VITS:
        return vit(name, num_classes, image_shape, model_config.get("dropout", 0.0),
                   model_config.get("drop_path", 0.0))
    raise ValueError(f"unknown model.name {name!r}; choose one of: seed_cnn, cifar_cnn, mlp, "
                     "resnet18, resnet34, resnet50, " + ", ".join(VITS))


def freeze_batch_norm(model: nn.Module) -> nn.Module:
    """model.freeze_batch_stats for a twin: its BatchNorm layers stay in eval mode (running
    statistics, never updated) whatever model.train() is called with."""
    train = model.train

    def train_with_frozen_statistics(mode: bool = True):
        train(mode)
        for module in model.modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                module.eval()
        return model

    model.train = train_with_frozen_statistics
    return model.train(model.training)


def count_params(model: nn.Module) -> int:
    """Parameters with a Flax counterpart, as jaxtrain.models.count_params counts Flax
    params (a fixed whitened stem included, a BatchNorm weight frozen at 1 not)."""
    return sum(p.numel() for p in flax_param_paths(model))


@torch.no_grad()
def whitening_kernel(images, mean, std, filters: int, eps: float = 5e-4,
                     max_images: int = 5000):
    """jaxtrain.models.whitening.whitening_kernel in torch, for uint8 (N, H, W, C) images on any
    device, as an OIHW float32 (filters, C, 2, 2) stem kernel: torch_fast computes its
    fixed stem inside its clock, as the published speedruns count it.

    The same filters: the top filters/2 eigenvectors of the normalised 2x2 patches'
    uncentred second moment (first max_images images), each with its first entry
    positive (a sign no rounding decides), scaled by 1/sqrt(eigenvalue + eps), then
    their negations. In float64 where jaxtrain works in float32, so the two agree to
    jaxtrain's rounding (its smallest eigenvectors move by ~1e-3 with one rounding of
    the moment)."""
    channels = images.shape[-1]
    if filters % 2 or not 0 < filters <= 8 * channels:
        raise ValueError(f"whitening_kernel: filters={filters} must be even and at most "
                         f"{8 * channels} for {channels}-channel images")
    if images.dtype != torch.uint8:
        raise ValueError(f"whitening_kernel: images must be uint8, not {images.dtype}")
    device = images.device
    mean = torch.tensor(mean, dtype=torch.float64, device=device)
    std = torch.tensor(std, dtype=torch.float64, device=device)
    x = (images[:max_images].double() / 255 - mean) / std
    height, width = x.shape[1:3]
    # the 2x2 patches in (kh, kw, c) order: an HWIO kernel's input dimensions
    patches = torch.cat([x[:, i:height - 1 + i, j:width - 1 + j]
                         for i in (0, 1) for j in (0, 1)], dim=-1).reshape(-1, 4 * channels)
    eigenvalues, eigenvectors = torch.linalg.eigh(patches.T @ patches)  # ascending
    eigenvalues = eigenvalues.flip(0) / patches.shape[0]
    eigenvectors = eigenvectors.flip(1)
    eigenvectors = eigenvectors * torch.where(eigenvectors[0] < 0, -1.0, 1.0)
    half = eigenvectors[:, :filters // 2] / torch.sqrt(eigenvalues[:filters // 2] + eps)
    kernel = torch.cat([half, -half], dim=1).reshape(2, 2, channels, filters)
    return kernel.permute(3, 2, 0, 1).float().contiguous()  # HWIO -> OIHW


class TrainingLoss(nn.Module):
    """The training loss of a batch as one module (criterion(model(inputs), labels), the
    logits in float32), so torch.compile takes the loss into the same graph (and CUDA
    graph) as the model."""

    def __init__(self, model: nn.Module, criterion: nn.Module):
        super().__init__()
        self.model, self.criterion = model, criterion

    def forward(self, inputs, labels):
        return self.criterion(self.model(inputs).float(), labels)


class MarkedForward(nn.Module):
    """A compiled model's forward with `mark` (torch.compiler.cudagraph_mark_step_begin)
    called first: each evaluation batch is a new CUDA graph step, so the graphs never
    wait on outputs of an earlier batch (each batch's are read before the next)."""

    def __init__(self, model: nn.Module, mark):
        super().__init__()
        self.model, self.mark = model, mark

    def forward(self, x):
        self.mark()
        return self.model(x)


def low_precision_copy(model: nn.Module, dtype=torch.bfloat16) -> nn.Module:
    """A copy of `model` whose weights are `dtype`, to run the forward and backward passes
    in, except its BatchNorm layers: those are the model's own (float32, shared, so
    their parameters train and their statistics update in place), as the published
    speedruns keep BatchNorm in float32. The model keeps the float32 weights the
    optimiser updates (torch_optim.MasterWeights copies them over after each step).
    A model with other normalisation layers (the ViT's LayerNorm) is refused."""
    norms = [type(m).__name__ for m in model.modules() if isinstance(m, (nn.LayerNorm,
                                                                         nn.GroupNorm))]
    if norms:
        raise ValueError(f"low_precision_copy keeps only BatchNorm in float32, this model has "
                         f"{norms[0]}")
    shared = {id(m): m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)}
    low = copy.deepcopy(model, memo=shared)
    with torch.no_grad():
        for module in low.modules():
            if not isinstance(module, nn.modules.batchnorm._BatchNorm):
                for param in module.parameters(recurse=False):
                    param.data = param.data.to(dtype)
    if "train" in low.__dict__:  # freeze_batch_norm's train() acts on the original: redo it
        del low.train
        freeze_batch_norm(low)
    return low


# ---------------------------------------------------------------- Flax -> torch weights

def _tensor(array):
    return torch.from_numpy(np.array(array, np.float32))  # a writable copy


@torch.no_grad()
def _copy(sequential, params, stats, x):
    """Copies one Flax scope into a Sequential; x (a dummy batch) tracks the activation shape."""
    counts, flat_shape = {}, None

    def next_name(kind):
        counts[kind] = counts.get(kind, 0) + 1
        return f"{kind}_{counts[kind] - 1}"

    for layer in sequential:
        if isinstance(layer, nn.Sequential):  # a cifar_cnn ConvBlock
            name = next_name("ConvBlock")
            _copy(layer, params[name], stats.get(name, {}), x)
        elif isinstance(layer, nn.Conv2d):
            p = params[next_name("Conv")]
            layer.weight.copy_(_tensor(p["kernel"]).permute(3, 2, 0, 1))  # HWIO -> OIHW
            if layer.bias is not None:
                layer.bias.copy_(_tensor(p["bias"]))
        elif isinstance(layer, nn.Linear):
            p = params[next_name("Dense")]
            kernel = _tensor(p["kernel"])  # (in, out)
            if flat_shape is not None:  # Flax flattened (h, w, c), torch flattens (c, h, w)
                c, h, w = flat_shape
                kernel = kernel.reshape(h, w, c, -1).permute(2, 0, 1, 3).reshape(c * h * w, -1)
                flat_shape = None
            layer.weight.copy_(kernel.T)
            if layer.bias is not None:
                layer.bias.copy_(_tensor(p["bias"]))
        elif isinstance(layer, nn.modules.batchnorm._BatchNorm):
            name = next_name("BatchNorm")
            p, s = params[name], stats[name]
            scale = _tensor(p["scale"]) if "scale" in p else torch.ones_like(layer.weight)
            layer.weight.copy_(scale)
            layer.bias.copy_(_tensor(p["bias"]))
            layer.running_mean.copy_(_tensor(s["mean"]))
            layer.running_var.copy_(_tensor(s["var"]))
        elif isinstance(layer, nn.Flatten):
            flat_shape = tuple(x.shape[1:])
        x = layer(x)
    return x


def flax_named_layers(model: nn.Module) -> list:
    """(layer, Flax path) for every layer of `model` that records its path (flax_named)."""
    return [(layer, layer.flax_path) for layer in model.modules() if hasattr(layer, "flax_path")]


def flax_raw_params(model: nn.Module) -> list:
    """(parameter, Flax path) for the parameters modules list in their `flax_raw`."""
    return [(getattr(module, name), path) for module in model.modules()
            for name, path in getattr(module, "flax_raw", {}).items()]


def _scope(tree, path: str):
    for name in path.split("/"):
        tree = tree[name]
    return tree


@torch.no_grad()
def _copy_named(named, params, stats):
    """Copies Flax variables into layers that record their Flax paths; no layer needs
    the activation shape (a Linear after a global pool, never after a Flatten)."""
    for layer, path in named:
        p = _scope(params, path)
        if isinstance(layer, nn.Conv2d):
            layer.weight.copy_(_tensor(p["kernel"]).permute(3, 2, 0, 1))  # HWIO -> OIHW
        elif isinstance(layer, nn.Linear):
            layer.weight.copy_(_tensor(p["kernel"]).T)  # (in, out) -> (out, in)
        elif isinstance(layer, nn.modules.batchnorm._BatchNorm):
            s = _scope(stats, path)
            layer.weight.copy_(_tensor(p["scale"]) if "scale" in p
                               else torch.ones_like(layer.weight))
            layer.running_mean.copy_(_tensor(s["mean"]))
            layer.running_var.copy_(_tensor(s["var"]))
        elif isinstance(layer, nn.LayerNorm):
            layer.weight.copy_(_tensor(p["scale"]))
        else:
            raise TypeError(f"{path}: no Flax counterpart for {type(layer).__name__}")
        if layer.bias is not None:
            layer.bias.copy_(_tensor(p["bias"]))


def flax_param_paths(sequential: nn.Sequential, prefix: str = "") -> dict:
    """Each torch parameter's Flax path ('ConvBlock_0/Conv_1/kernel'), keyed by the
    parameter: the names optimizer.groups' regular expressions match, in the Flax
    order _copy follows. Frozen weights with a Flax counterpart (a whitened stem)
    are in; a BatchNorm weight frozen at 1 (Flax's use_scale=False) has none.
    A twin whose layers record their Flax paths (flax_named: the ResNet, the ViT) is
    mapped by those, in module order, after its raw parameters (flax_raw)."""
    named = flax_named_layers(sequential)
    if named:
        paths = {param: f"{prefix}{name}" for param, name in flax_raw_params(sequential)}
        for layer, name in named:
            weight = "kernel" if isinstance(layer, (nn.Conv2d, nn.Linear)) else \
                "scale" if layer.weight.requires_grad else None
            for param, leaf in ((layer.weight, weight), (layer.bias, "bias")):
                if param is not None and leaf is not None:
                    paths[param] = f"{prefix}{name}/{leaf}"
        return paths
    counts, paths = {}, {}

    def next_name(kind):
        counts[kind] = counts.get(kind, 0) + 1
        return f"{prefix}{kind}_{counts[kind] - 1}"

    for layer in sequential:
        if isinstance(layer, nn.Sequential):
            paths.update(flax_param_paths(layer, next_name("ConvBlock") + "/"))
            continue
        if isinstance(layer, nn.Conv2d):
            name, weight = next_name("Conv"), "kernel"
        elif isinstance(layer, nn.Linear):
            name, weight = next_name("Dense"), "kernel"
        elif isinstance(layer, nn.modules.batchnorm._BatchNorm):
            name, weight = next_name("BatchNorm"), "scale" if layer.weight.requires_grad else None
        else:
            continue
        for param, leaf in ((layer.weight, weight), (layer.bias, "bias")):
            if param is not None and leaf is not None:
                paths[param] = f"{name}/{leaf}"
    return paths


def load_flax_variables(model: nn.Sequential, variables, image_shape) -> nn.Sequential:
    """Copies Flax variables ({'params': ..., 'batch_stats': ...}) into a twin, in place.

    Flax names layers by kind and order (Conv_0, Dense_1, BatchNorm_2, ConvBlock_0),
    which is the order of the twin's Sequential; a twin whose layers record their
    Flax paths (the ResNet) is copied by those paths.
    """
    named = flax_named_layers(model)
    if named:
        _copy_named(named, variables["params"], variables.get("batch_stats", {}))
        with torch.no_grad():
            for param, path in flax_raw_params(model):
                param.copy_(_tensor(_scope(variables["params"], path)))
        return model
    training = model.training
    model.eval()  # the dummy batch must not touch the BatchNorm statistics
    height, width, channels = image_shape
    device = next(model.parameters()).device
    _copy(model, variables["params"], variables.get("batch_stats", {}),
          torch.zeros(1, channels, height, width, device=device))
    model.train(training)
    return model


# ---------------------------------------------------------------- input path

def to_tensor(image: np.ndarray):
    """torchvision's ToTensor: HWC uint8 -> CHW float32 in [0, 1]."""
    return torch.from_numpy(image).permute(2, 0, 1).float().div(255)


def normalize(images, mean, std):
    """(x - mean) / std per channel, x in [0, 1]; uint8 images are scaled first."""
    x = images.float() / 255 if images.dtype == torch.uint8 else images.float()
    mean = torch.tensor(mean, dtype=torch.float32, device=x.device).view(-1, 1, 1)
    std = torch.tensor(std, dtype=torch.float32, device=x.device).view(-1, 1, 1)
    return (x - mean) / std


def gather_pixels(images, rows, cols, inside=None):
    """Image i's pixel (rows[i], cols[i]) for (N, C, H, W) images and coordinates that
    broadcast to (N, H, W) (a translation's are (N, H, 1) and (N, 1, W): index tensors
    of N x (H + W), never N x H x W); zero (black) where `inside` is False."""
    n, _, h, w = images.shape
    batch = torch.arange(n, device=images.device)[:, None, None]
    out = images[batch, :, rows.clamp(0, h - 1), cols.clamp(0, w - 1)]  # (N, H, W, C)
    out = out.permute(0, 3, 1, 2)  # NCHW view of NHWC memory: channels_last
    if inside is not None:
        out = torch.where(inside[:, None], out, torch.zeros((), dtype=out.dtype,
                                                            device=out.device))
    return out


def mirrored(images):
    """Horizontal mirror of every image."""
    return images.flip(3)


def shift_coordinates(n: int, h: int, w: int, dy, dx, pad_mode: str, device):
    """The source rows (N, H, 1) and columns (N, 1, W) of images translated by (dy[i],
    dx[i]), reflected at the border ('reflect') or with an `inside` mask (N, H, W)
    for black padding (else None): a translation is separable, so it is one gather."""
    rows = torch.arange(h, device=device)[None, :] - dy[:, None]
    cols = torch.arange(w, device=device)[None, :] - dx[:, None]
    if pad_mode == "reflect":
        rows = (h - 1) - ((h - 1) - rows.abs()).abs()
        cols = (w - 1) - ((w - 1) - cols.abs()).abs()
        return rows[:, :, None], cols[:, None, :], None
    inside = ((rows >= 0) & (rows < h))[:, :, None] & ((cols >= 0) & (cols < w))[:, None, :]
    return rows[:, :, None], cols[:, None, :], inside


def shifted(images, dy, dx, pad_mode: str = "reflect"):
    """Translates image i by (dy[i], dx[i]) pixels, padding the uncovered border like
    jaxtrain.training.augment.shift (numpy/torch 'reflect', or zeros)."""
    n, _, h, w = images.shape
    rows, cols, inside = shift_coordinates(n, h, w, dy, dx, pad_mode, images.device)
    return gather_pixels(images, rows, cols, inside)


def rotated(images, degrees):
    """Rotates image i counter-clockwise by degrees[i] about its centre: nearest
    neighbour, black fill (torchvision's RandomRotation defaults; jaxtrain's formula)."""
    n, _, h, w = images.shape
    theta = torch.deg2rad(degrees.float())[:, None, None]
    cos, sin = torch.cos(theta), torch.sin(theta)
    cy, cx = (h - 1) / 2.0, (w - 1) / 2.0
    rows, cols = torch.meshgrid(torch.arange(h, dtype=torch.float32, device=images.device),
                                torch.arange(w, dtype=torch.float32, device=images.device),
                                indexing="ij")
    u, v = cols - cx, cy - rows  # y axis pointing up
    src_cols = torch.round(cos * u + sin * v + cx).long()
    src_rows = torch.round(cy - (-sin * u + cos * v)).long()
    inside = (src_rows >= 0) & (src_rows < h) & (src_cols >= 0) & (src_cols < w)
    return gather_pixels(images, src_rows, src_cols, inside)


def draw_augmentation(n: int, height: int, width: int, device=None, *, flip: bool = False,
                      alternate_flip: bool = False, translate: int = 0, rotate: float = 0.0,
                      cutout: int = 0, pad_mode: str = "reflect", mirror=None) -> dict:
    """The random part of the `augment` block for n images, one draw per image from
    torch's generator: 'degrees', 'mirror' (bool), 'shift' (dy, dx), 'cutout' (top, left
    corners), each (n,) or absent. Draws in the order augment_batch always drew them,
    so a batch sees the same images as before drawing and applying were split; a
    draw sliced like the images (slice_draws) augments a slice the same way."""
    if flip and alternate_flip and mirror is None:
        raise ValueError("augment.alternate_flip needs the batch's mirror bits")
    draws = {}
    if rotate:
        draws["degrees"] = (torch.rand(n, device=device) * 2 - 1) * rotate
    if flip and alternate_flip:
        draws["mirror"] = mirror.to(device)
    elif flip:
        draws["mirror"] = torch.rand(n, device=device) < 0.5
    if translate:  # RandomCrop(size, padding=translate): a shift in [-translate, translate]
        draws["shift"] = torch.randint(-translate, translate + 1, (2, n), device=device)
    if cutout:
        draws["cutout"] = torch.stack([torch.randint(0, height, (n,), device=device),
                                       torch.randint(0, width, (n,), device=device)])
    return draws


def slice_draws(draws: dict, start: int, stop: int) -> dict:
    """The draws of images start..stop-1."""
    return {k: v[..., start:stop] for k, v in draws.items()}


def apply_augmentation(images, draws: dict, *, pad_mode: str = "reflect", cutout: int = 0):
    """draw_augmentation's draws applied to (N, C, H, W) images in jaxtrain's order:
    rotate, flip, translate, cutout. The flip and the translation are one gather (the
    mirrored column of the shifted one), so a whole epoch is augmented in one go."""
    n, _, h, w = images.shape
    device = images.device
    if "degrees" in draws:
        images = rotated(images, draws["degrees"])
    mirror = draws.get("mirror")
    if "shift" in draws:
        dy, dx = draws["shift"]
        rows, cols, inside = shift_coordinates(n, h, w, dy, dx, pad_mode, device)
        if mirror is not None:  # flip then shift: the shifted pixel's mirrored column
            cols = torch.where(mirror[:, None, None], (w - 1) - cols.clamp(0, w - 1), cols)
        images = gather_pixels(images, rows, cols, inside)
    elif mirror is not None:
        images = torch.where(mirror[:, None, None, None], mirrored(images), images)
    if "cutout" in draws:
        top = draws["cutout"][0][:, None, None] - cutout // 2
        left = draws["cutout"][1][:, None, None] - cutout // 2
        rows = torch.arange(h, device=device)[None, :, None]
        cols = torch.arange(w, device=device)[None, None, :]
        hole = (rows >= top) & (rows < top + cutout) & (cols >= left) & (cols < left + cutout)
        images = torch.where(hole[:, None], torch.zeros((), dtype=images.dtype, device=device),
                             images)
    return images


def augment_batch(images, *, flip: bool = False, alternate_flip: bool = False,
                  translate: int = 0, rotate: float = 0.0, cutout: int = 0,
                  pad_mode: str = "reflect", mirror=None):
    """The `augment` config block on (N, C, H, W) images, each image drawn independently
    from torch's generator, in jaxtrain's order: rotate, flip, translate, cutout.
    With alternate_flip, `mirror` (bool, one per image) says which images to mirror."""
    n, _, h, w = images.shape
    draws = draw_augmentation(n, h, w, images.device, flip=flip, alternate_flip=alternate_flip,
                              translate=translate, rotate=rotate, cutout=cutout, mirror=mirror)
    return apply_augmentation(images, draws, pad_mode=pad_mode, cutout=cutout)


def tta_views(images, mode: str, pad_mode: str = "reflect"):
    """The views and weights of jaxtrain.training.augment.tta_views, for (N, C, H, W) images."""
    if mode == "none":
        return [images], [1.0]
    if mode == "flip":
        return [images, mirrored(images)], [0.5, 0.5]
    if mode == "flip_translate":
        n = images.shape[0]
        shifts = [torch.full((n,), d, dtype=torch.long, device=images.device) for d in (-1, 1)]
        views = [images, mirrored(images)]
        views += [shifted(v, d, d, pad_mode) for v in views[:2] for d in shifts]
        return views, [0.25, 0.25] + [0.125] * 4
    raise ValueError(f"eval.tta must be 'none', 'flip' or 'flip_translate', got {mode!r}")


def article_transform(image: np.ndarray, *, augment: dict, mean, std, mirror=None):
    """The article's per-sample transform: ToTensor, the augmentations, Normalize;
    `mirror`: this image's alternate_flip bit."""
    mirror = None if mirror is None else torch.tensor([mirror])
    x = augment_batch(to_tensor(image)[None], mirror=mirror, **augment)[0]
    return normalize(x, mean, std)
