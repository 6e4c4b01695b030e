"""The training state (parameters, optimiser state, BatchNorm statistics, an EMA of the
weights), how it is created on the devices, and what is read back from it."""
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax.training import train_state

from jaxtrain import models
from jaxtrain.models import whitening
from jaxtrain.training import optim


class TrainState(train_state.TrainState):
    batch_stats: Any = None
    ema: Any = None  # train.ema_decay: {"params", "batch_stats"} averaged over the steps


def ema_weights(state) -> "TrainState":
    """`state` with its exponential moving averages as its weights (to evaluate them)."""
    return state.replace(params=state.ema["params"], batch_stats=state.ema["batch_stats"])


def create_train_state(key, model, tx, image_shape, sharding=None, stem_kernel=None,
                       hyperparams=None, replicas: bool = False, ema: bool = False,
                       initial=None) -> TrainState:
    """Initial parameters and optimiser state, placed by `sharding` (e.g. replicated);
    `stem_kernel` replaces the initial stem weights (a whitened stem). With `replicas`,
    `key` has a leading axis and one state per key is made (jax.vmap); `hyperparams`
    ({name: (R,) values}) then set each one's swept optimiser values (replicas.py).
    `ema`: the state also holds a moving average of the weights, starting at them.
    `initial`: {'params/…' or 'batch_stats/…' path: array} replacing those leaves of the
    fresh init (model.init_from's weights, jaxtrain/weights/readers.py) before the optimiser
    state is made from them; every replica starts from the same ones."""
    def init(key, hyperparams, initial):
        variables = models.init_variables(model, key, image_shape)
        if initial:
            variables = {collection: jax.tree_util.tree_map_with_path(
                lambda path, leaf, c=collection: initial.get(f"{c}/{optim.param_path(path)}",
                                                             leaf), tree)
                for collection, tree in variables.items()}
        params = variables["params"]
        if stem_kernel is not None:
            params = whitening.with_stem_kernel(params, jnp.asarray(stem_kernel))
        state = TrainState.create(apply_fn=model.apply, params=params, tx=tx,
                                  batch_stats=variables.get("batch_stats", {}))
        if hyperparams:
            injected = dict(state.opt_state.hyperparams, **hyperparams)
            state = state.replace(opt_state=state.opt_state._replace(hyperparams=injected))
        if ema:
            state = state.replace(ema=jax.tree.map(jnp.copy, {
                "params": state.params, "batch_stats": state.batch_stats}))
        return state
    initial = {path: jnp.asarray(value) for path, value in (initial or {}).items()}
    init_fn = jax.vmap(init, in_axes=(0, 0, None)) if replicas else init
    return jax.jit(init_fn, out_shardings=sharding)(key, hyperparams, initial)


def current_step(state) -> int:
    """The state's step (every replica of a replicated state is at the same one)."""
    step = state.step
    if isinstance(step, jax.Array):
        step = step.addressable_data(0)
    return int(np.asarray(step).flat[0])


def hyperparam(state, name: str, default):
    """A swept value of this (replica's) state (replicas.py injects them into the
    optimiser state), else `default`, the config's."""
    values = getattr(state.opt_state, "hyperparams", None)
    return values[name] if isinstance(values, dict) and name in values else default
