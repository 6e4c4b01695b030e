"""optimizer.ns_stack and optimizer.flatten: the same steps as the per-tensor optimisers,
in fewer kernels (counted in XLA:CPU's compiled programs; a GPU's fusion passes differ,
so the counts there differ too, but what stacking and flattening remove is the same)."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from tolerances import NETWORK_PASS
from test_speedrun import narrow_speedrun

from configs import cifar_speedrun
from jaxtrain.errors import ConfigError
from jaxtrain.perf import hlo
from jaxtrain.training import checkpoint, chunks, optim, placement, prepare, replicas

pytestmark = pytest.mark.usefixtures("compile_quickly")  # conftest.py

FROZEN = ("Conv_0/kernel",)  # the speedrun's whitened stem
_CALLS = re.compile(r"calls=%?([\w.\-]+)")


def matrix_kernels(hlo_text: str) -> int:
    """Kernels of a loop-free program's entry that multiply matrices: dots and
    convolutions, on their own or inside a fusion (XLA:CPU fuses small dots with their
    neighbours, so hlo.kernel_counts files most of them under 'fusion')."""
    bodies, entry = hlo.computations(hlo_text)

    def multiplies(name):
        return any(i.opcode in ("dot", "convolution")
                   or any(multiplies(c) for c in _CALLS.findall(i.text))
                   for i in bodies.get(name, []))
    return sum(1 for i in bodies[entry] if i.opcode in ("dot", "convolution")
               or (i.opcode == "fusion" and any(multiplies(c) for c in _CALLS.findall(i.text))))


def optimiser_steps(opt, params, grads):
    """(params after one step per entry of `grads`, the optimiser state, the compiled CPU
    program of one step: update and apply)."""
    tx = optim.create_optimizer(opt, optim.create_schedule(opt, 10), FROZEN)

    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state
    state = tx.init(params)
    compiled = jax.jit(step).lower(params, state, grads[0]).compile()
    for g in grads:
        params, state = compiled(params, state, g)
    return params, state, compiled.as_text()


def speedrun_like(widths=(8, 16, 16), stem=24):
    """(the speedrun's config, a parameter tree of cifar_cnn's paths and shapes at these
    widths with random values): no model to build for an optimiser's test."""
    rng = np.random.default_rng(0)
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape) / np.sqrt(np.prod(shape[:-1])),
                                        jnp.float32)
    params = {"Conv_0": {"kernel": normal(2, 2, 3, stem), "bias": jnp.zeros(stem)},
              "Dense_0": {"kernel": normal(widths[-1], 10)}}
    inputs = stem
    for i, width in enumerate(widths):
        params[f"ConvBlock_{i}"] = {
            "Conv_0": {"kernel": normal(3, 3, inputs, width)},
            "Conv_1": {"kernel": normal(3, 3, width, width)},
            "BatchNorm_0": {"bias": jnp.zeros(width)}, "BatchNorm_1": {"bias": jnp.zeros(width)}}
        inputs = width
    return cifar_speedrun.get_config(), params


def with_keys(config, **keys):
    config = config.copy_and_resolve_references()
    for key, value in keys.items():
        config.optimizer[key] = value
    return config


@pytest.mark.slow
def test_stacked_newton_schulz_takes_muon_s_steps_in_fewer_matrix_products():
    """The narrow speedrun's six filters are four shapes: four batched iterations instead
    of six, each kernel still orthogonalised and renormalised on its own."""
    config, params = speedrun_like()
    rng = np.random.default_rng(1)
    grads = [jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), params)
             for _ in range(4)]
    per_leaf, _, per_leaf_program = optimiser_steps(config.optimizer, params, grads)
    both, state, stacked_program = optimiser_steps(
        with_keys(config, ns_stack=True).optimizer, params, grads)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(per_leaf), jax.tree.leaves(both)):
        np.testing.assert_allclose(b, a, rtol=NETWORK_PASS, atol=NETWORK_PASS * 0.2,
                                   err_msg=optim.param_path(path))
    for i, width in enumerate((8, 16, 16)):
        for j in range(2):
            kernel = both[f"ConvBlock_{i}"][f"Conv_{j}"]["kernel"]
            assert float(jnp.linalg.norm(kernel)) == pytest.approx(np.sqrt(width),
                                                                   rel=NETWORK_PASS)
    assert not np.allclose(both["ConvBlock_2"]["Conv_1"]["kernel"],
                           params["ConvBlock_2"]["Conv_1"]["kernel"], atol=1e-3)
    # Muon's momentum is kept stacked: ConvBlock_1/Conv_1, ConvBlock_2/Conv_0 and _1 share one
    shapes = {leaf.shape for leaf in jax.tree.leaves(state)}
    assert (3, 3, 3, 16, 16) in shapes and (3, 3, 16, 16) not in shapes
    # 3 Newton-Schulz steps of 3 products each: per tensor 6 x 9 = 54, per shape 4 x 9 = 36
    before, after = matrix_kernels(per_leaf_program), matrix_kernels(stacked_program)
    assert after < before and before - after >= 2 * 3 * 3


def train_twenty_steps(config, run, state):
    """(kernels per step of the compiled scanned chunk, the state after 10 and 20 steps,
    the chunk): two epochs of 10 steps from `state`."""
    x_train, y_train = placement.put_train_data(run)
    run_chunk = chunks.compile_chunks("scan", state, x_train, y_train, run.data_key, {10},
                                      prepare.step_spec(config, run))
    kernels = sum(hlo.kernel_counts(run_chunk.programs[0].as_text()).values())
    middle, _ = run_chunk(state, run.data_key, 0, 0, 10)
    kept = jax.tree.map(jnp.copy, middle)  # the chunk donates its input
    last, _ = run_chunk(middle, run.data_key, 1, 0, 10)
    return kernels, kept, last, run_chunk


@pytest.mark.slow
def test_flattened_groups_train_the_speedrun_bit_for_bit_in_fewer_kernels(
        cifar_batches_dir, tmp_path):
    config = narrow_speedrun(cifar_batches_dir, train__num_steps=20)
    flat_config = with_keys(config, flatten=True)
    run = prepare.setup(config, placement.create_mesh(config.parallel.fsdp))
    # the flat run's initial state: the same weights, its optimiser's state (as setup makes it)
    tx = replicas.create_optimizer(flat_config, run.total_steps, FROZEN)
    initial = run.state.replace(tx=tx, opt_state=tx.init(run.state.params))
    flat_kernels, middle, flat, run_chunk = train_twenty_steps(
        flat_config, run, jax.tree.map(jnp.copy, initial))
    plain_kernels, _, plain, _ = train_twenty_steps(config, run, run.state)
    assert flat_kernels < plain_kernels
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(plain.params),
                            jax.tree.leaves(flat.params)):
        np.testing.assert_array_equal(b, a, err_msg=optim.param_path(path))
    # the SGD groups share one flat momentum trace (every SGD parameter's values)
    labels = jax.tree.leaves(optim.param_labels(config.optimizer, plain.params, FROZEN))
    sgd_values = sum(leaf.size for leaf, label in zip(jax.tree.leaves(plain.params), labels)
                     if label in ("norm_biases", "stem_bias", "head"))
    assert (sgd_values,) in {leaf.shape for leaf in jax.tree.leaves(flat.opt_state)}

    # a checkpoint of the flat state resumes: step 10 restored, trained on to step 20
    manager = checkpoint.create_manager(str(tmp_path / "checkpoints"))
    checkpoint.save(manager, middle, run.data_key, {"step": 10})
    checkpoint.wait(manager)
    restored, _, _ = checkpoint.restore(manager, initial, run.data_key)
    resumed, _ = run_chunk(restored, run.data_key, 1, 0, 10)
    assert checkpoint.params_sha256(resumed) == checkpoint.params_sha256(flat)
    # and it is no checkpoint for the per-tensor layout: the optimiser state differs
    with pytest.raises(checkpoint.CheckpointError, match="opt_state"):
        checkpoint.restore(manager, plain, run.data_key)


@pytest.mark.slow
def test_a_sweep_steps_each_replica_as_its_single_run_with_both_keys():
    """replicas.py: optax.inject_hyperparams rebuilds the optimiser from each replica's
    swept values inside jax.vmap; the stacked and flattened one too."""
    config, params = speedrun_like()
    config = with_keys(config, ns_stack=True, flatten=True)
    config.sweep.optimizer.momentum = (0.8, 0.9)  # the SGD groups' (the filters set their own)
    config.sweep.optimizer.learning_rate = (0.5,)  # every group's, through its lr_scale
    runs = replicas.runs(config)
    tx = replicas.create_optimizer(config, 10, FROZEN)

    def init(params, values):
        state = tx.init(params)
        return state._replace(hyperparams=dict(state.hyperparams, **values))

    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state
    both = jax.tree.map(lambda p: jnp.stack([p] * len(runs)), params)
    state = jax.jit(jax.vmap(init))(both, replicas.hyperparams(runs))
    rng = np.random.default_rng(2)
    grads = [jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), params)
             for _ in range(3)]
    vmapped = jax.jit(jax.vmap(step, in_axes=(0, 0, None)))
    for g in grads:
        both, state = vmapped(both, state, g)
    for r, run in enumerate(runs):
        single = with_keys(replicas.run_config(config, run), ns_stack=False, flatten=False)
        alone, _, _ = optimiser_steps(single.optimizer, params, grads)
        for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(alone),
                                jax.tree.leaves(replicas.take(both, r))):
            np.testing.assert_allclose(b, a, rtol=NETWORK_PASS, atol=NETWORK_PASS * 0.2,
                                       err_msg=f"replica {r} {optim.param_path(path)}")


@pytest.mark.parametrize("where,key,value,message", [
    ("", "ns_stack", None, r"config.optimizer.ns_stack=None: must be True \(one batched"),
    ("", "flatten", None, r"config.optimizer.flatten=None: must be True \(elementwise"),
    ("filters", "ns_stack", 1, r"config.optimizer.groups.filters.ns_stack=1: must be True"),
    ("head", "flatten", True, r"config.optimizer.groups.head: unknown key\(s\) flatten"),
])
def test_bad_values_of_the_keys_are_config_errors_naming_them(where, key, value, message):
    from jaxtrain.config import checks
    config, params = speedrun_like()
    with config.unlocked():
        (config.optimizer.groups[where] if where else config.optimizer)[key] = value
    with pytest.raises(ConfigError, match=message):
        checks.check_config(config)
        optim.check_groups(config.optimizer, params, FROZEN)
