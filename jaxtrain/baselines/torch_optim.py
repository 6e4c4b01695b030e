"""The PyTorch side of jaxtrain.compare: the `optimizer` config block as torch optimisers.

Each follows what jaxtrain/training/optim.py builds from optax, step for step, so the
twins train with the same rule: SGD and Adam with coupled weight decay are
torch's own; optax.adamw is torch's AdamW; optax.contrib.muon has no torch
counterpart and is written out here (`Muon`: foreach, its Newton-Schulz batched
over same-shape matrices, in bfloat16 and compiled where torch_fast asks).
Parameter groups (optimizer.groups) are matched on the Flax paths of the twin's
parameters (torch_models.flax_param_paths) with optim.param_labels itself, so a
group holds the same weights in both frameworks. Every torch param group carries
its own per-step learning rates (`rates`: the group's lr_scale and
train_steps applied to jaxtrain's schedule); `set_step` puts them in place.
"""
import math

import jax
import jax.numpy as jnp
import numpy as np
import torch

from jaxtrain.baselines import torch_models
from jaxtrain.training import optim


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


def newton_schulz_batched(matrices, coeffs, steps: int, eps: float = 1e-8,
                          dtype=torch.float32):
    """newton_schulz for a stack of wide matrices (B, m, n), m <= n, in one batched
    matmul per product: each scaled to Frobenius norm 1 in float32, then iterated in
    `dtype` (bfloat16: the published speedruns' Newton-Schulz), returned in float32."""
    x = matrices.float()
    x = (x / (torch.linalg.matrix_norm(x, keepdim=True) + eps)).to(dtype)
    a, b, c = coeffs
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.float()


class Muon(torch.optim.Optimizer):
    """optax.contrib.muon (optax 0.2.8) for torch weights whose dimension 0 is the output
    (Conv2d OIHW, Linear (out, in)); Flax's HWIO kernel is the same matrix, transposed.

    m <- beta m + (1 - beta) g; Nesterov uses beta m / (1 - beta^(t+1)) + (1 - beta) g /
    (1 - beta^t), else m / (1 - beta^t); the Newton-Schulz orthogonalisation of that,
    times sqrt(max(1, fan_out / fan_in)), plus weight_decay x w, times -lr.

    For speed: the momentum and the update are foreach operations over the group,
    and matrices of one shape (on their wide orientation) are orthogonalised together
    as one stack (newton_schulz_batched). `ns_dtype` is that iteration's dtype (float32
    keeps optax's numbers; bfloat16 is the published speedruns'); compile_ns compiles
    it (compile_newton_schulz).
    """

    def __init__(self, params, lr=0.02, beta=0.95, nesterov=True, ns_steps=5,
                 ns_coeffs=(3.4445, -4.7750, 2.0315), weight_decay=0.0, eps=1e-8,
                 ns_dtype=torch.float32, compile_ns=False):
        super().__init__(params, dict(lr=lr, beta=beta, nesterov=nesterov, ns_steps=ns_steps,
                                      ns_coeffs=tuple(ns_coeffs), weight_decay=weight_decay,
                                      eps=eps))
        self.ns_dtype = ns_dtype
        self.compile_newton_schulz(compile_ns)

    def compile_newton_schulz(self, on: bool = True) -> None:
        """Runs Newton-Schulz compiled (torch.compile's default mode, as the published
        speedruns; static shapes: one program per stack shape) or not."""
        self.orthogonalize = (torch.compile(newton_schulz_batched, dynamic=False) if on
                              else newton_schulz_batched)

    def stack_shapes(self) -> list[tuple]:
        """The (count, rows, columns) of each stack one step orthogonalises."""
        counts = {}
        for group in self.param_groups:
            for p in group["params"]:
                rows, cols = sorted((p.shape[0], p[0].numel()))
                counts[rows, cols] = counts.get((rows, cols), 0) + 1
        return [(n, *shape) for shape, n in counts.items()]

    def _orthogonalized(self, directions, group) -> list:
        """Each direction's Newton-Schulz orthogonalisation (as an (out, in) matrix),
        the same-shape ones stacked and orthogonalised together."""
        wide = []
        for d in directions:
            matrix = d.reshape(d.shape[0], -1)
            wide.append(matrix.T if matrix.shape[0] > matrix.shape[1] else matrix)
        stacks = {}
        for i, matrix in enumerate(wide):
            stacks.setdefault(tuple(matrix.shape), []).append(i)
        ortho = [None] * len(wide)
        for indices in stacks.values():
            out = self.orthogonalize(torch.stack([wide[i] for i in indices]),
                                     group["ns_coeffs"], group["ns_steps"], group["eps"],
                                     self.ns_dtype)
            for i, matrix in zip(indices, out.unbind(0)):
                d = directions[i]
                ortho[i] = (matrix.T if d.shape[0] > d[0].numel() else matrix).reshape(d.shape)
        return ortho

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta = group["beta"]
            by_step = {}  # parameters that have taken the same number of steps
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"], state["mu"] = 0, torch.zeros_like(p)
                state["step"] += 1
                by_step.setdefault(state["step"], []).append(p)
            for t, params in by_step.items():
                mus = [self.state[p]["mu"] for p in params]
                grads = [p.grad for p in params]
                torch._foreach_mul_(mus, beta)
                torch._foreach_add_(mus, grads, alpha=1 - beta)
                if group["nesterov"]:
                    directions = torch._foreach_mul(mus, beta / (1 - beta ** (t + 1)))
                    torch._foreach_add_(directions, grads, alpha=(1 - beta) / (1 - beta ** t))
                else:
                    directions = torch._foreach_div(mus, 1 - beta ** t)
                updates = self._orthogonalized(directions, group)
                torch._foreach_mul_(updates, [math.sqrt(max(1.0, p.shape[0] / p[0].numel()))
                                              for p in params])
                if group["weight_decay"]:
                    torch._foreach_add_(updates, params, alpha=group["weight_decay"])
                torch._foreach_add_(params, updates, alpha=-group["lr"])


@torch.no_grad()
def renormalize_(params) -> None:
    """optim.renormalize: each tensor scaled to Frobenius norm sqrt(its output
    dimension) (dimension 0 in torch, the last in Flax), as foreach operations."""
    params = list(params)
    scales = torch._foreach_norm(params)
    torch._foreach_clamp_min_(scales, 1e-12)
    torch._foreach_reciprocal_(scales)
    torch._foreach_mul_(scales, [math.sqrt(p.shape[0]) for p in params])
    torch._foreach_mul_(params, scales)


def _renormalize_hook(optimizer, args, kwargs):
    for group in optimizer.param_groups:
        if group.get("renormalize", False):
            renormalize_(group["params"])


def _with_implementation(make, fast: bool):
    """make(**kwargs) with torch's fused implementation when `fast` and torch has one for
    these parameters, else its foreach one (else the default); returns (optimiser,
    'fused' | 'foreach' | 'default')."""
    if fast:
        for kind in ("fused", "foreach"):
            try:
                return make(**{kind: True}), kind
            except (RuntimeError, ValueError, TypeError):  # not for this device or dtype
                continue
    return make(), "default"


def _torch_optimizer(settings, groups: list[dict], fast: bool = False,
                     ns_dtype=torch.float32):
    """One torch optimiser of kind settings.name over `groups` (param groups that
    share it); renormalised groups are renormalised after every step. `fast`: torch's
    fused (else foreach) SGD, Adam and AdamW; Muon's Newton-Schulz in ns_dtype. Its
    `implementation` says which ran."""
    if settings.name == "sgd":
        tx, kind = _with_implementation(lambda **kw: torch.optim.SGD(
            groups, lr=1.0, momentum=settings.momentum,
            nesterov=settings.nesterov and settings.momentum > 0,
            weight_decay=settings.weight_decay, **kw), fast)
    elif settings.name == "adam":
        tx, kind = _with_implementation(lambda **kw: torch.optim.Adam(
            groups, lr=1.0, betas=(settings.b1, settings.b2), eps=settings.eps,
            weight_decay=settings.weight_decay, **kw), fast)
    elif settings.name == "adamw":
        tx, kind = _with_implementation(lambda **kw: torch.optim.AdamW(
            groups, lr=1.0, betas=(settings.b1, settings.b2), eps=settings.eps,
            weight_decay=settings.weight_decay, **kw), fast)
    elif settings.name == "muon":
        tx = Muon(groups, lr=1.0, beta=settings.momentum, nesterov=settings.nesterov,
                  ns_steps=settings.ns_steps,
                  ns_coeffs=tuple(float(c) for c in settings.ns_coeffs),
                  weight_decay=settings.weight_decay, ns_dtype=ns_dtype)
        kind = "foreach, Newton-Schulz batched by shape"
    else:
        raise ValueError(f"unknown optimizer.name {settings.name!r}; choose one of: "
                         + ", ".join(optim.OPTIMIZERS))
    tx.implementation = kind
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

    def reset_state(self):
        """Back to a fresh optimiser's state (no momentum, no step count): what a
        warm-up step leaves is dropped."""
        for tx in self.optimizers:
            tx.state.clear()

    def describe(self) -> list[dict]:
        """What each part runs: its group, torch class and implementation (and Muon's
        Newton-Schulz dtype, compilation and stack shapes)."""
        rows = []
        for tx in self.optimizers:
            row = {"group": tx.param_groups[0].get("name", "default"),
                   "optimizer": type(tx).__name__,
                   "implementation": getattr(tx, "implementation", "default")}
            if isinstance(tx, Muon):
                row["newton_schulz"] = {
                    "dtype": str(tx.ns_dtype).removeprefix("torch."),
                    "compiled": tx.orthogonalize is not newton_schulz_batched,
                    "stacks": [list(shape) for shape in tx.stack_shapes()]}
            rows.append(row)
        return rows


class MasterWeights:
    """Optimizers over float32 weights for a model run in low precision
    (torch_models.low_precision_copy): each step casts the low-precision gradients
    to the float32 weights' gradients, steps the optimisers there, and copies the
    weights back, so the update is the recipe's float32 one (as jaxtrain's bfloat16
    runs keep float32 parameters) while the passes see bfloat16 weights. `pairs`:
    (float32 weight, its low-precision copy) for every trained weight that differs."""

    def __init__(self, optimizer: Optimizers, pairs: list):
        self.optimizer = optimizer
        self.masters = [master for master, _ in pairs]
        self.copies = [low for _, low in pairs]
        self.grads = [torch.zeros_like(master) for master in self.masters]  # reused

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def zero_grad(self, set_to_none: bool = True):
        self.optimizer.zero_grad(set_to_none)
        for low in self.copies:
            low.grad = None

    @torch.no_grad()
    def step(self):
        grads = [low.grad for low in self.copies]
        if grads and all(g is not None for g in grads):  # one foreach cast, reused buffers
            torch._foreach_copy_(self.grads, grads)
            for master, grad in zip(self.masters, self.grads):
                master.grad = grad
        else:
            for master, grad in zip(self.masters, grads):
                master.grad = None if grad is None else grad.float()
        self.optimizer.step()
        if self.copies:
            torch._foreach_copy_(self.copies, self.masters)

    def reset_state(self):
        self.optimizer.reset_state()

    def describe(self) -> list[dict]:
        return self.optimizer.describe()


def set_step(optimizer, step: int) -> None:
    """Puts step `step`'s learning rate into every param group (from its `rates`)."""
    for group in optimizer.param_groups:
        group["lr"] = group["rates"][step]


def _rates(schedule, total_steps: int) -> list[float]:
    values = np.asarray(schedule(jnp.arange(total_steps)), np.float64)
    return [float(v) for v in np.broadcast_to(values, (total_steps,))]


def create_torch_optimizer(opt, model, total_steps: int, *, fast: bool = False,
                           ns_dtype=torch.float32) -> Optimizers:
    """The `optimizer` config block for a twin model: one torch optimiser per parameter
    group (optimizer.groups, then the parameters of no group), each param group
    with the `rates` of its total_steps steps. Frozen parameters (requires_grad
    False, or in a group with freeze=True, which this sets so) are left out, as
    jaxtrain leaves its frozen ones. `fast`, `ns_dtype`: torch_fast's implementations
    (_torch_optimizer); the defaults are torch's plain ones and float32."""
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
            "renormalize": bool(settings.get("renormalize", False))}], fast, ns_dtype))
    return Optimizers(optimizers)
