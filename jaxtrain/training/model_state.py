"""The model a run trains and its initial state: the module built (or given), its
variables' shapes, a whitened stem's filters, the random keys, and the state made on the
devices from a random init or model.init_from's weights."""
import functools

import jax
import numpy as np

from jaxtrain import models
from jaxtrain.config import checks
from jaxtrain.errors import ConfigError
from jaxtrain.models import user, whitening
from jaxtrain.runtime import mesh as mesh_lib
from jaxtrain.training import replicas, train_state
from jaxtrain.weights import readers


def build_model(model_config, num_classes: int, precision: str, conv_impl: str, model=None):
    """The Flax module: `model` (a Linen or NNX instance) as given, else model.name's."""
    if model is not None:
        return user.from_instance(model)
    try:
        return models.create_model(model_config, num_classes, checks.compute_dtype(precision),
                                   conv_impl=conv_impl)
    except ValueError as error:  # an unknown or unimportable model.name
        raise ConfigError(str(error)) from None


def stem_kernel(model_config, dataset, mean, std, compute: bool = True):
    """model.stem_init='whiten': the stem's fixed filters from the training images (None
    unless `compute`: callers of an abstract state compute them in their own program);
    else None."""
    if not whitening.has_whitened_stem(model_config):
        return None
    try:
        whitening.check_stem(model_config, dataset.image_shape[-1])
    except ValueError as error:
        raise ConfigError(str(error)) from None
    if not compute:
        return None
    return whitening_fn(model_config, mean, std)(dataset.x_train[:whitening.WHITENING_IMAGES])


def initial_state(model_config, seed: int, ema: bool, model, tx, dataset, mesh, runs, stem,
                  abstract_params, abstract: bool = False):
    """(state, data key, the state's sharding, model.init_from's readers.Report or None).
    Seeds `seed`, or seed, seed + 1, ... for replicas (each replica's keys are its
    single run's). model.init_from's weights are read at step 0 only (not for an
    `abstract` state: shapes and dtypes, jax.eval_shape, no init compiled)."""
    if runs:
        sharding = replicas.state_sharding(mesh, len(runs))
        seeds = np.asarray([run.seed for run in runs], np.int32)
        init_key, data_key = jax.jit(lambda seeds: tuple(jax.vmap(
            lambda seed: jax.random.split(jax.random.key(seed)))(seeds).T),
            out_shardings=sharding)(seeds)
    else:
        sharding = mesh_lib.replicated(mesh)
        init_key, data_key = jax.jit(lambda: jax.random.split(jax.random.key(seed)),
                                     out_shardings=sharding)()
    init = functools.partial(train_state.create_train_state, model=model, tx=tx,
                             image_shape=dataset.image_shape, sharding=sharding,
                             stem_kernel=stem, hyperparams=replicas.hyperparams(runs),
                             replicas=runs is not None,
                             ema=ema)
    report = None
    init_from = model_config.get("init_from", "")
    if init_from and not abstract:
        initial, report = readers.initialise(init_from, model, abstract_params,
                                             model_config.name, dataset.image_shape,
                                             model_config.get("init_from_exclude", ""))
        init = functools.partial(init, initial=initial)
    if mesh_lib.fsdp_size(mesh) > 1:  # each leaf split over the fsdp axis by its shape
        sharding = mesh_lib.state_shardings(
            jax.eval_shape(functools.partial(init, sharding=None), init_key), mesh)
        init = functools.partial(init, sharding=sharding)
    state = jax.eval_shape(init, init_key) if abstract else init(init_key)
    return state, data_key, sharding, report


def param_count(params, runs=None) -> int:
    """The model's parameter count (one replica's, for a replicated state)."""
    return models.count_params(params) // (len(runs) if runs else 1)


def whitening_fn(model_config, mean, std):
    """whitening.whitening_kernel for this run's stem, jitted: training and the benchmark
    (inside its timed program) compute the same filters from the training images."""
    return jax.jit(functools.partial(whitening.whitening_kernel, mean=tuple(mean), std=tuple(std),
                                     filters=model_config.stem_width))


def abstract_init(model, model_config, image_shape):
    """The model's variables as shapes (jax.eval_shape of its init). A model that cannot
    take the images (a TypeError or ValueError that JAX or Flax raise: shapes that do not
    fit) is a ConfigError naming the key that sizes it; any other error of the model's is
    its own, raised with its traceback."""
    try:
        return jax.eval_shape(
            lambda key: models.init_variables(model, key, image_shape), jax.random.key(0))
    except (TypeError, ValueError) as error:
        if not raised_by(error, SHAPE_CHECKERS):
            raise
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        size = "x".join(map(str, image_shape))
        if model_config.name == "cifar_cnn":
            key, value = "model.widths", tuple(model_config.widths)
            what = (f"cifar_cnn halves the image once per block: {len(value)} blocks are too "
                    f"many for {size} images")
        else:
            key, value = "model.name", model_config.name
            what = f"the model cannot take {size} images"
        raise ConfigError(f"config.{key}={value!r}: {what} ({type(error).__name__}: "
                          f"{reason})") from None


SHAPE_CHECKERS = ("jax", "jaxlib", "flax", "numpy")  # whose TypeErrors and ValueErrors are
                                                     # shapes that do not fit


def raised_by(error: BaseException, packages) -> bool:
    """Whether the innermost frame of the error's traceback (the unfiltered one, where JAX
    has filtered its own frames out) is in one of `packages`."""
    cause = error.__cause__
    if type(cause).__name__ == "UnfilteredStackTrace":  # jax's traceback filtering
        error = cause
    frame, tb = None, error.__traceback__
    while tb is not None:
        frame, tb = tb.tb_frame, tb.tb_next
    return frame is not None and frame.f_globals.get("__name__", "").split(".")[0] in packages
