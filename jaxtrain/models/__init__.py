"""Flax (Linen) image classifiers.

Every model takes float images (N, H, W, C) that are already normalised, and
returns float32 logits. `dtype` is the compute dtype (bfloat16 for mixed
precision); parameters and BatchNorm statistics stay float32."""
import flax.linen as nn
import jax
import numpy as np

from jaxtrain.models import cnn, resnet, user, vit, whitening
from jaxtrain.models.ops import batchnorm, onednn, pooling


def create_model(model_config, num_classes: int, dtype: cnn.Dtype,
                 image_shape=None, conv_impl: str | None = None) -> nn.Module:
    """Builds the model that `model_config.name` names.

    image_shape ((H, W, C), optional) settles a ResNet's model.stem='auto' here;
    without it the ResNet applies the same rule to its input's size. conv_impl: the
    choice conv_choice made (prepare.setup makes it once); None: made here.
    """
    name = model_config.name
    if user.is_user_model(name):
        return user.create(model_config, num_classes, dtype)
    # model.freeze_batch_stats: BatchNorm in inference mode while training too (as torch's
    # module.eval() on it), so it neither updates nor normalises by batch statistics
    frozen_statistics = bool(model_config.get("freeze_batch_stats", False))
    remat = bool(model_config.get("remat", False))  # REMAT_MODELS only (checks.py)
    # 'auto' settles here, on this backend; configs saved before the option: 'xla'
    pool_impl = pooling.resolve(model_config.get("pool_impl", "xla"))
    if conv_impl is None:
        conv_impl = conv_choice(model_config)
    bn_impl = model_config.get("bn_impl", "flax")  # BN_MODELS only (checks.py)
    batchnorm.module(bn_impl)  # an unknown name fails here, not at the first init
    if name == "seed_cnn":
        return cnn.SeedCNN(num_classes=num_classes, batch_norm=model_config.batch_norm, dtype=dtype,
                           freeze_batch_stats=frozen_statistics, pool_impl=pool_impl,
                           conv_impl=conv_impl, bn_impl=bn_impl)
    if name == "cifar_cnn":
        # .get: configs saved before an option existed restore with the old behaviour
        activation = model_config.get("activation", "gelu_tanh")
        conv_init = model_config.get("conv_init", "default")
        head_init_std = model_config.get("head_init_std", 0.0)
        cnn.activation_fn(activation)  # unknown names fail here, not at the first init
        cnn.conv_kernel_init(conv_init)
        if head_init_std < 0:
            raise ValueError(f"model.head_init_std={head_init_std} must be >= 0 "
                             "(0: Flax's default init)")
        return cnn.CifarCNN(num_classes=num_classes, widths=tuple(model_config.widths),
                            stem_width=model_config.stem_width,
                            bn_momentum=model_config.bn_momentum,
                            head_scale=model_config.head_scale, dtype=dtype,
                            activation=activation, conv_init=conv_init,
                            bn_epsilon=model_config.get("bn_epsilon", 1e-5),
                            head_init_std=head_init_std, freeze_batch_stats=frozen_statistics,
                            remat=remat, pool_impl=pool_impl, conv_impl=conv_impl,
                            bn_impl=bn_impl)
    if name == "mlp":
        return cnn.MLP(num_classes=num_classes, hidden_sizes=tuple(model_config.hidden_sizes),
                       batch_norm=model_config.batch_norm, dropout=model_config.dropout,
                       dtype=dtype, freeze_batch_stats=frozen_statistics, bn_impl=bn_impl)
    if name in resnet.RESNETS:
        stage_sizes, block_cls = resnet.RESNETS[name]
        stem = model_config.get("stem", "auto")  # configs saved before model.stem: 'auto'
        stem = resnet.resnet_stem(stem, image_shape) if image_shape is not None or stem != "auto" \
            else stem
        return resnet.ResNet(stage_sizes=stage_sizes, block_cls=block_cls, num_classes=num_classes,
                             stem=stem, dtype=dtype, freeze_batch_stats=frozen_statistics,
                             remat=remat, conv_impl=conv_impl, bn_impl=bn_impl)
    if name in vit.VITS:
        dim, depth, heads = vit.VITS[name]
        return vit.ViT(num_classes=num_classes, dim=dim, depth=depth, heads=heads,
                       dropout=model_config.get("dropout", 0.0),
                       drop_path=model_config.get("drop_path", 0.0), dtype=dtype, remat=remat,
                       conv_impl=conv_impl)
    raise ValueError(f"unknown model.name {name!r}; choose one of: seed_cnn, cifar_cnn, mlp, "
                     + ", ".join([*resnet.RESNETS, *vit.VITS]))


# model.name's built-in choices; the models with blocks model.remat recomputes; the models
# whose BatchNorm model.bn_impl picks
MODEL_NAMES = ("seed_cnn", "cifar_cnn", "mlp", *resnet.RESNETS, *vit.VITS)
REMAT_MODELS = ("cifar_cnn", *resnet.RESNETS, *vit.VITS)
BN_MODELS = ("seed_cnn", "cifar_cnn", "mlp", *resnet.RESNETS)


def init_variables(model, key, image_shape):
    """The model's variables for images of `image_shape`, as its init (inference mode)
    makes them from `key`. The init is given a 'dropout' stream beside 'params': a model
    that builds its dropout with its random streams (NNX's nnx.Dropout(rngs=...), through
    Flax's Linen bridge) needs one at init. The parameters are init(key)'s either way."""
    import jax.numpy as jnp
    return model.init({"params": key, "dropout": jax.random.fold_in(key, 1)},
                      jnp.zeros((1, *image_shape), jnp.float32), train=False)


def frozen_params(model_config) -> tuple:
    """'/'-joined paths of the parameters the optimiser must leave as initialised."""
    if whitening.has_whitened_stem(model_config):
        return ("/".join(whitening.STEM_KERNEL),)
    return ()


def is_convolutional(name: str) -> bool:
    """Whether the model is (likely) convolutional: your own models are taken to be."""
    return name in ("seed_cnn", "cifar_cnn") or name in resnet.RESNETS or user.is_user_model(name)


def conv_choice(model_config) -> str:
    """model.conv_impl settled on this machine: 'onednn' or 'xla' ('auto' may build the
    oneDNN library the first time: onednn.resolve). The mlp has no convolution: 'xla'."""
    if model_config.name == "mlp":
        return "xla"
    return onednn.resolve(model_config.get("conv_impl", "xla"))  # configs from before: 'xla'


def xla_convolutions(name: str, conv_impl: str) -> bool:
    """Whether model `name`'s convolutions are XLA's own under the settled conv_impl: a
    convolutional model on 'xla', or a user's model (taken to be convolutional, with
    lax's). What keeps train.loop='auto' out of a scan on the CPU."""
    if user.is_user_model(name):
        return True
    return is_convolutional(name) and conv_impl == "xla"


def count_params(params) -> int:
    return int(sum(np.prod(p.shape) for p in jax.tree_util.tree_leaves(params)))
