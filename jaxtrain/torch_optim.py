"""The PyTorch side of jaxtrain.compare: the `optimizer` config block as torch optimisers.

Each follows what jaxtrain/optim.py builds from optax, step for step, so the
twins train with the same rule: SGD and Adam with coupled weight decay are
torch's own; optax.adamw is torch's AdamW; optax.contrib.muon has no torch
counterpart and is written out here (`Muon`). Parameter groups
(optimizer.groups) are matched on the Flax paths of the twin's parameters
(torch_models.flax_param_paths) with optim.param_labels itself, so a group
holds the same weights in both frameworks. Every torch param group carries
its own per-step learning rates (`rates`: the group's lr_scale and
train_steps applied to jaxtrain's schedule); `set_step` puts them in place.
"""
import math

import jax
import jax.numpy as jnp
import numpy as np
import torch

from jaxtrain import optim, torch_models


def newton_schulz(matrix, coeffs, steps: int, eps: float = 1e-8):
    """optax's orthogonalize_via_newton_schulz for one (reduction, output) matrix: scale
    to Frobenius norm 1, then `steps` quintic iterations X <- aX + (bA + cA^2)X with
    A = XX^T, on the wide orientation."""
    x = matrix.float()
    transposed = x.shape[0] > x.shape[1]
    if transposed:
        x = x.T
    x = x / (torch.linalg.norm(x) + eps)
    a, b, c = coeffs
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if transposed else x


class Muon(torch.optim.Optimizer):
    """optax.contrib.muon (optax 0.2.8) for torch weights whose dimension 0 is the output
    (Conv2d OIHW, Linear (out, in)); Flax's HWIO kernel is the same matrix, transposed.

    m <- beta m + (1 - beta) g; Nesterov uses beta m / (1 - beta^(t+1)) + (1 - beta) g /
    (1 - beta^t), else m / (1 - beta^t); the Newton-Schulz orthogonalisation of that,
    times sqrt(max(1, fan_out / fan_in)), plus weight_decay x w, times -lr.
    """

    def __init__(self, params, lr=0.02, beta=0.95, nesterov=True, ns_steps=5,
                 ns_coeffs=(3.4445, -4.7750, 2.0315), weight_decay=0.0, eps=1e-8):
        super().__init__(params, dict(lr=lr, beta=beta, nesterov=nesterov, ns_steps=ns_steps,
                                      ns_coeffs=tuple(ns_coeffs), weight_decay=weight_decay,
                                      eps=eps))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta = group["beta"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"], state["mu"] = 0, torch.zeros_like(p)
                state["step"] += 1
                t, mu, grad = state["step"], state["mu"], p.grad
                mu.mul_(beta).add_(grad, alpha=1 - beta)
                if group["nesterov"]:
                    direction = (beta * mu / (1 - beta ** (t + 1))
                                 + (1 - beta) * grad / (1 - beta ** t))
                else:
                    direction = mu / (1 - beta ** t)
                fan_out, fan_in = p.shape[0], p[0].numel()
                ortho = newton_schulz(direction.reshape(fan_out, fan_in).T, group["ns_coeffs"],
                                      group["ns_steps"], group["eps"])
                update = ortho.T.reshape(p.shape) * math.sqrt(max(1.0, fan_out / fan_in))
                update = update + group["weight_decay"] * p
                p.add_(update, alpha=-group["lr"])


@torch.no_grad()
def renormalize_(params) -> None:
    """optim.renormalize: each tensor scaled to Frobenius norm sqrt(its output
    dimension) (dimension 0 in torch, the last in Flax)."""
    for p in params:
        p.mul_(math.sqrt(p.shape[0]) / torch.linalg.norm(p).clamp_min(1e-12))


def _renormalize_hook(optimizer, args, kwargs):
    for group in optimizer.param_groups:
        if group.get("renormalize", False):
            renormalize_(group["params"])


def _torch_optimizer(settings, groups: list[dict]):
    """One torch optimiser of kind settings.name over `groups` (param groups that
    share it); renormalised groups are renormalised after every step."""
    if settings.name == "sgd":
        tx = torch.optim.SGD(groups, lr=1.0, momentum=settings.momentum,
                             nesterov=settings.nesterov and settings.momentum > 0,
                             weight_decay=settings.weight_decay)
    elif settings.name == "adam":
        tx = torch.optim.Adam(groups, lr=1.0, betas=(settings.b1, settings.b2),
                              eps=settings.eps, weight_decay=settings.weight_decay)
    elif settings.name == "adamw":
        tx = torch.optim.AdamW(groups, lr=1.0, betas=(settings.b1, settings.b2),
                               eps=settings.eps, weight_decay=settings.weight_decay)
    elif settings.name == "muon":
        tx = Muon(groups, lr=1.0, beta=settings.momentum, nesterov=settings.nesterov,
                  ns_steps=settings.ns_steps,
                  ns_coeffs=tuple(float(c) for c in settings.ns_coeffs),
                  weight_decay=settings.weight_decay)
    else:
        raise ValueError(f"unknown optimizer.name {settings.name!r}; choose one of: "
                         + ", ".join(optim.OPTIMIZERS))
    if any(group.get("renormalize", False) for group in groups):
        tx.register_step_post_hook(_renormalize_hook)
    return tx


class Optimizers:
    """The torch optimisers of one model (one per parameter group), stepped together:
    torch has no optax.partition, so this holds the parts."""

    def __init__(self, optimizers: list):
        self.optimizers = optimizers

    @property
    def param_groups(self) -> list[dict]:
        return [group for tx in self.optimizers for group in tx.param_groups]

    def zero_grad(self, set_to_none: bool = True):
        for tx in self.optimizers:
            tx.zero_grad(set_to_none=set_to_none)

    def step(self):
        for tx in self.optimizers:
            tx.step()


def set_step(optimizer, step: int) -> None:
    """Puts step `step`'s learning rate into every param group (from its `rates`)."""
    for group in optimizer.param_groups:
        group["lr"] = group["rates"][step]


def _rates(schedule, total_steps: int) -> list[float]:
    values = np.asarray(schedule(jnp.arange(total_steps)), np.float64)
    return [float(v) for v in np.broadcast_to(values, (total_steps,))]


def create_torch_optimizer(opt, model, total_steps: int) -> Optimizers:
    """The `optimizer` config block for a twin model: one torch optimiser per parameter
    group (optimizer.groups, then the parameters of no group), each param group
    with the `rates` of its total_steps steps. Frozen parameters (requires_grad
    False, or in a group with freeze=True, which this sets so) are left out, as
    jaxtrain leaves its frozen ones."""
    paths = {p: path for p, path in torch_models.flax_param_paths(model).items()
             if p.requires_grad}
    tree = {}  # the Flax params tree, with the torch parameters as its leaves
    for param, path in paths.items():
        *scopes, leaf = path.split("/")
        node = tree
        for scope in scopes:
            node = node.setdefault(scope, {})
        node[leaf] = param
    groups = list(opt.groups.keys()) if "groups" in opt else []
    labels = optim.param_labels(opt, tree) if groups else jax.tree.map(lambda _: "default", tree)
    label_of = dict(zip(jax.tree.leaves(tree), jax.tree.leaves(labels)))
    schedule = optim.create_schedule(opt, total_steps)
    optimizers = []
    for name in groups + ["default"]:
        params = [p for p in paths if label_of[p] == name]
        if not params:
            continue
        settings = optim.group_settings(opt, name) if name != "default" else opt
        if name != "default" and settings.freeze:  # optimizer.groups' freeze=True
            for param in params:
                param.requires_grad_(False)
            continue
        group_schedule = optim.group_schedule(settings, schedule) if name != "default" \
            else schedule
        optimizers.append(_torch_optimizer(settings, [{
            "params": params, "name": name, "rates": _rates(group_schedule, total_steps),
            "renormalize": bool(settings.get("renormalize", False))}]))
    return Optimizers(optimizers)
