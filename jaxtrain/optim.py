"""The `optimizer` config block -> an optax learning-rate schedule and transformation."""
import jax
import optax

SCHEDULES = ("constant", "linear", "onecycle", "warmup_cosine")
OPTIMIZERS = ("sgd", "adam", "adamw")


def create_schedule(opt, total_steps: int) -> optax.Schedule:
    """Learning rate as a function of the step, over a run of `total_steps` steps.

    'constant'; 'linear': decay from the peak to peak * end_lr_fraction;
    'onecycle': linear warm-up from peak * start_lr_fraction to the peak over
    warmup_fraction of the run, then linear decay to peak * end_lr_fraction;
    'warmup_cosine': linear warm-up from 0, then cosine decay.
    """
    peak = opt.learning_rate
    end = peak * opt.end_lr_fraction
    warmup = int(round(opt.warmup_fraction * total_steps))
    if opt.schedule == "constant":
        return optax.constant_schedule(peak)
    if opt.schedule == "linear":
        return optax.linear_schedule(peak, end, max(total_steps, 1))
    if opt.schedule == "onecycle":
        return optax.join_schedules(
            [optax.linear_schedule(peak * opt.start_lr_fraction, peak, max(warmup, 1)),
             optax.linear_schedule(peak, end, max(total_steps - warmup, 1))],
            boundaries=[warmup])
    if opt.schedule == "warmup_cosine":
        return optax.warmup_cosine_decay_schedule(0.0, peak, warmup, max(total_steps, warmup + 1), end)
    raise ValueError(f"unknown optimizer.schedule {opt.schedule!r}; choose one of: "
                     + ", ".join(SCHEDULES))


def create_optimizer(opt, schedule: optax.Schedule,
                     frozen: tuple = ()) -> optax.GradientTransformation:
    """optax SGD (momentum, Nesterov), Adam or AdamW with weight decay.

    SGD and Adam add weight_decay * params to the gradient (coupled L2, as
    torch.optim does); AdamW decays the weights directly, scaled by the
    learning rate (as torch.optim.AdamW does). Parameters whose '/'-joined path
    is in `frozen` are never updated (no step, no decay).
    """
    tx = _optimizer(opt, schedule)
    if not frozen:
        return tx

    def labels(params):
        return jax.tree_util.tree_map_with_path(
            lambda path, _: "frozen" if "/".join(k.key for k in path) in frozen else "trained",
            params)
    return optax.multi_transform({"trained": tx, "frozen": optax.set_to_zero()}, labels)


def _optimizer(opt, schedule):
    if opt.name == "sgd":
        momentum = opt.momentum or None
        return optax.chain(optax.add_decayed_weights(opt.weight_decay),
                           optax.sgd(schedule, momentum=momentum, nesterov=opt.nesterov))
    if opt.name == "adam":
        return optax.chain(optax.add_decayed_weights(opt.weight_decay),
                           optax.adam(schedule, b1=opt.b1, b2=opt.b2, eps=opt.eps))
    if opt.name == "adamw":
        return optax.adamw(schedule, b1=opt.b1, b2=opt.b2, eps=opt.eps,
                           weight_decay=opt.weight_decay)
    raise ValueError(f"unknown optimizer.name {opt.name!r}; choose one of: " + ", ".join(OPTIMIZERS))
