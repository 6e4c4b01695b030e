"""Many runs in one program: `train.replicas` seeds crossed with a `sweep` of scalar
hyperparameters, trained side by side by jax.vmap (chunks.compile_chunks(replicas=True)).

Run r of R = (sweep points) x train.replicas has seed `seed + r % replicas` and sweep
point r // replicas (the sweep's keys crossed, in the order `sweep` lists them). What
differs between runs lives in the state, so one compiled program trains them all: the
initial parameters and the data key (both from the seed) carry a leading replica axis,
and the swept values are optax.inject_hyperparams hyperparameters of the optimiser, one
per replica in opt_state.hyperparams, which checkpoints save with the rest.

Data parallelism: when R is a multiple of the device count, each device trains R/D
whole replicas (the state's replica axis is split over the mesh; no gradient crosses
devices); otherwise every replica's batch is split over the devices as in a single run.
"""
import itertools
import math
from typing import NamedTuple

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from jaxtrain.errors import ConfigError
from jaxtrain.runtime import mesh as mesh_lib
from jaxtrain.training import optim

# Scalars that change neither a shape nor the compiled program: what `sweep` may hold.
SWEEPABLE = ("optimizer.learning_rate", "optimizer.weight_decay", "optimizer.momentum",
             "optimizer.b1", "optimizer.b2", "train.label_smoothing")


class Run(NamedTuple):
    """One replica: its index, seed and swept settings ({dotted key: value})."""
    replica: int
    seed: int
    settings: dict


def sweep_values(config) -> dict:
    """{dotted key: values} of the sweep's non-empty entries, in SWEEPABLE's order."""
    values = {}
    for key in SWEEPABLE:
        block, name = key.split(".")
        swept = tuple(config.sweep[block][name]) if name in config.sweep.get(block, {}) else ()
        if swept:
            values[key] = swept
    return values


def is_replicated(config) -> bool:
    """Whether the run has a replica axis: several replicas, or a sweep (even of one point)."""
    return config.train.replicas > 1 or bool(sweep_values(config))


def runs(config) -> list[Run] | None:
    """Every replica of the run, or None for a single run without a replica axis."""
    if not is_replicated(config):
        return None
    swept = sweep_values(config)
    points = [dict(zip(swept, values)) for values in itertools.product(*swept.values())]
    copies = config.train.replicas
    return [Run(index, config.seed + index % copies, points[index // copies])
            for index in range(len(points) * copies)]


def run_config(config, run: Run):
    """The single-run config that replica `run` trains like: its seed and settings, no
    replicas, no sweep (a copy; `config` stays as it is)."""
    single = config.copy_and_resolve_references()
    single.seed = run.seed
    single.train.replicas = 1
    for key, value in run.settings.items():
        block, name = key.split(".")
        single[block][name] = value
        single.sweep[block][name] = ()
    return single


def hyperparams(runs_: list[Run] | None) -> dict | None:
    """The injected hyperparameters' values, {name: float32 (R,)}, or None (no sweep)."""
    if not runs_ or not runs_[0].settings:
        return None
    return {key.split(".")[1]: np.asarray([run.settings[key] for run in runs_], np.float32)
            for key in runs_[0].settings}


def create_optimizer(config, total_steps: int, frozen: tuple = (), given=None):
    """The run's optax transformation (`given`: the optimiser passed from Python, parts.py).
    With a sweep, optim.create_optimizer is wrapped in
    optax.inject_hyperparams, rebuilt at each step from the replica's values: the
    learning rate is the peak of the same schedule (and scales every parameter group's,
    as optimizer.learning_rate does); label smoothing rides along unused by the
    optimiser and is read by step.train_step."""
    opt = config.optimizer
    swept = sweep_values(config)
    if not swept:
        return optim.create_optimizer(opt, optim.create_schedule(opt, total_steps), frozen,
                                      given)

    def build(learning_rate=None, weight_decay=None, momentum=None, b1=None, b2=None,
              label_smoothing=None):
        del label_smoothing  # step.train_step's
        settings = opt.copy_and_resolve_references()
        with settings.ignore_type():  # the swept values are traced arrays here
            for name, value in (("learning_rate", learning_rate), ("weight_decay", weight_decay),
                                ("momentum", momentum), ("b1", b1), ("b2", b2)):
                if value is not None:
                    settings[name] = value
        return optim.create_optimizer(settings, optim.create_schedule(settings, total_steps),
                                      frozen, given)
    defaults = {key.split(".")[1]: float(config[key.split(".")[0]][key.split(".")[1]])
                for key in swept}
    return optax.inject_hyperparams(build)(**defaults)


def state_sharding(mesh, replicas: int) -> NamedSharding:
    """Where a replicated run's state lives: the replica axis split over the mesh when
    it divides evenly (each device trains whole replicas), else replicated."""
    if splits_replicas(mesh, replicas):
        return NamedSharding(mesh, PartitionSpec(mesh_lib.DATA_AXIS))
    return mesh_lib.replicated(mesh)


def splits_replicas(mesh, replicas: int) -> bool:
    """Whether each device trains whole replicas: R a multiple of the device count, in
    one process (several processes keep every replica on every device, so each can
    read all results)."""
    return mesh.size > 1 and replicas % mesh.size == 0 and jax.process_count() == 1


def check_sweep(config) -> None:
    """What checks.RANGES cannot say of a sweep (checks.check_config calls this)."""
    momenta = sweep_values(config).get("optimizer.momentum", ())
    if config.optimizer.name == "muon" and 0 in momenta:
        raise ConfigError(f"config.sweep.optimizer.momentum={momenta!r}: muon needs a "
                          "momentum > 0")


def not_sweepable_error(key: str, known) -> ConfigError | None:
    """The error for `sweep.KEY` where KEY is a config key outside SWEEPABLE, else None."""
    inner = key[len("sweep."):]
    if not key.startswith("sweep.") or inner not in known:
        return None
    return ConfigError(f"config.{key}: {inner} changes the model's shapes or the compiled "
                       "program, so its values cannot share one program; sweepable: "
                       + ", ".join(SWEEPABLE) + " (run one config per value instead)")


def mean_std(values) -> tuple[float, float]:
    """Mean and (population) standard deviation of finite values; (nan, nan) if none."""
    values = np.asarray([v for v in values if v is not None and math.isfinite(v)], np.float64)
    if not len(values):
        return float("nan"), float("nan")
    return float(values.mean()), float(values.std())


def summarize(runs_: list[Run], results: list[dict]) -> dict:
    """summary.json's replica part: every replica's results with its seed and settings,
    their mean and std, the best replica (test accuracy), and with a sweep each sweep
    point's mean and std over its seeds."""
    per_replica = [dict(replica=run.replica, seed=run.seed, settings=run.settings, **result)
                   for run, result in zip(runs_, results)]
    accuracy = mean_std(r["test_accuracy"] for r in per_replica)
    loss = mean_std(r["test_loss"] for r in per_replica)
    best = max(per_replica, key=lambda r: (r["test_accuracy"], -r["replica"]))
    out = {"replica_count": len(runs_), "replicas": per_replica,
           "test_accuracy_std": accuracy[1], "test_loss_std": loss[1],
           "best": {key: best[key] for key in ("replica", "seed", "settings", "test_accuracy",
                                               "test_loss")}}
    if runs_[0].settings:
        points = {}
        for r in per_replica:
            points.setdefault(tuple(sorted(r["settings"].items())), []).append(r)
        out["sweep_points"] = [
            {"settings": dict(point), "replicas": [r["replica"] for r in rows],
             "test_accuracy_mean": mean_std(r["test_accuracy"] for r in rows)[0],
             "test_accuracy_std": mean_std(r["test_accuracy"] for r in rows)[1]}
            for point, rows in points.items()]
    return out


def describe(run: Run) -> str:
    """'replica 3 (seed 1, optimizer.learning_rate=0.2)'."""
    settings = "".join(f", {key}={value:g}" for key, value in run.settings.items())
    return f"replica {run.replica} (seed {run.seed}{settings})"


def best_replica(meta: dict) -> int:
    """The replica with the best test accuracy a checkpoint's meta records."""
    accuracies = meta.get("replica_test_accuracy")
    if not accuracies:
        raise ValueError("this checkpoint holds no evaluation of its replicas yet: pass "
                         f"replica=k (0 .. {len(meta.get('replicas', [])) - 1})")
    return int(np.nanargmax(np.asarray(accuracies, np.float64)))


def take(state, replica: int):
    """One replica of a replicated state (its leaves without the leading axis)."""
    return jax.tree.map(lambda leaf: leaf[replica], state)
