"""The run's schedule, planned before the first step and the same on a resume: chunks cut at
epochs, checkpoints, evaluations and profile windows; which steps get an evaluation; the
save interval."""


def profile_window(start_step: int, total_steps: int, steps: int):
    """(first, end) global steps of a --profile trace: `steps` steps after one warm-up step
    of this process (the first call of a compiled program pays one-off costs); None when
    not profiling or nothing is left to trace."""
    first = start_step + 1
    if steps <= 0 or first >= total_steps:
        return None
    return first, min(first + steps, total_steps)


def plan_chunks(total_steps: int, steps_per_epoch: int, every_steps=(), start_step: int = 0,
                breaks=()):
    """[(epoch, first_step_in_epoch, num_steps)] from start_step to total_steps.

    Chunks end at every epoch end, at every multiple of each interval in every_steps
    (checkpoints, evaluations; 0 = none) and at the steps in breaks. The grid does not
    depend on start_step, so a resumed run computes the same chunks as an uninterrupted
    one. Metrics rows need no chunk end: they come from each chunk's per-step metrics.
    """
    plan, step = [], start_step
    while step < total_steps:
        epoch, in_epoch = divmod(step, steps_per_epoch)
        end = min(step - in_epoch + steps_per_epoch, total_steps)
        for every in every_steps:
            if every > 0:
                end = min(end, step - step % every + every)
        end = min([end] + [b for b in breaks if b > step])
        plan.append((epoch, in_epoch, end - step))
        step = end
    return plan


def save_interval(checkpoint_config, steps_per_epoch: int) -> int:
    """checkpoint.every_steps, else checkpoint.every_epochs in steps; 0 = only at the end."""
    if checkpoint_config.every_steps > 0:
        return checkpoint_config.every_steps
    return max(checkpoint_config.every_epochs, 0) * steps_per_epoch


def evaluates_after(step: int, steps_per_epoch: int, total_steps: int, every_epochs: int,
                    every_steps: int = 0):
    """Evaluation schedule: after the last step, every `every_epochs` epochs and every
    `every_steps` steps (0: neither)."""
    epoch_done = step % steps_per_epoch == 0
    return (step == total_steps
            or (epoch_done and every_epochs > 0 and (step // steps_per_epoch) % every_epochs == 0)
            or (every_steps > 0 and step % every_steps == 0))
