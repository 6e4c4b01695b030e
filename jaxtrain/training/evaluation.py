"""Test-set evaluation as one compiled program: logits (with test-time augmentation on all
images or on the least confident fraction), accuracy and loss over padded batches."""
import functools

import jax
import jax.numpy as jnp

from jaxtrain.training import augment, losses, step


def predict_logits(state, images, *, mean, std, tta, pad_mode):
    """TTA-averaged logits for a uint8 batch, with BatchNorm in inference mode.

    All views go through the model as one batch: one forward of V x N images
    keeps the device busier than V forwards of N. The views are stacked per
    image (N, V, ...), so a batch split over devices stays split the same way.
    """
    views, weights = augment.tta_views(images, tta, pad_mode)
    variables = {"params": state.params, "batch_stats": state.batch_stats}
    if len(views) == 1:
        return state.apply_fn(variables, step.normalize(views[0], mean, std), train=False)
    n = images.shape[0]
    stacked = jnp.stack(views, axis=1).reshape(n * len(views), *images.shape[1:])
    logits = state.apply_fn(variables, step.normalize(stacked, mean, std), train=False)
    logits = logits.reshape(n, len(views), -1)
    return jnp.sum(logits * jnp.asarray(weights, logits.dtype)[:, None], axis=1)


def eval_logits(state, x_batches, valid_batches, *, mean, std, tta, pad_mode, tta_images=None):
    """Logits of padded test batches (B, batch, classes), BatchNorm in inference mode.

    tta_images=None: TTA on every image; k: plain logits, then TTA only on the k
    least confident valid images (max softmax probability; padding is never picked),
    gathered into whole batches, so most of the TTA cost goes where it can change
    an answer; 0: no TTA. k is static: the shapes of the TTA pass depend on it.
    (compile_evaluation runs the same parts one batch per call.)
    """
    predict = functools.partial(predict_logits, state, mean=mean, std=std, pad_mode=pad_mode)
    if tta_images is None and tta != "none":
        return jax.lax.map(functools.partial(predict, tta=tta), x_batches)
    plain = jax.lax.map(functools.partial(predict, tta="none"), x_batches)
    if tta == "none" or not tta_images:
        return plain
    picked = least_confident(plain, valid_batches, tta_images)
    tta_logits = jax.lax.map(functools.partial(predict, tta=tta), gather_batches(x_batches, picked))
    return with_tta_logits(plain, picked, tta_logits, tta_images)


def least_confident(plain, valid_batches, tta_images: int):
    """The flat indices of the tta_images least confident valid images of `plain`
    (B, batch, classes), and after them the next least confident up to whole batches
    (computed, not used): padding is never picked."""
    num_batches, batch = valid_batches.shape
    flat = plain.reshape(num_batches * batch, plain.shape[-1])
    confidence = jnp.max(jax.nn.softmax(flat, axis=-1), axis=-1)
    confidence = jnp.where(valid_batches.reshape(-1) > 0, confidence, jnp.inf)
    whole = -(-tta_images // batch) * batch
    return jax.lax.top_k(-confidence, whole)[1]


def gather_batches(x_batches, picked):
    """The images at flat indices `picked` of (B, batch, ...) batches, as whole batches."""
    batch = x_batches.shape[1]
    images = x_batches.reshape(-1, *x_batches.shape[2:])[picked]
    return images.reshape(picked.shape[0] // batch, batch, *x_batches.shape[2:])


def with_tta_logits(plain, picked, tta_logits, tta_images: int):
    """`plain` with the TTA logits of its first tta_images picked images in their place."""
    flat = plain.reshape(-1, plain.shape[-1])
    tta_logits = tta_logits.reshape(-1, plain.shape[-1])[:tta_images]
    return flat.at[picked[:tta_images]].set(tta_logits).reshape(plain.shape)


def logits_metrics(logits, y_batches, valid_batches, loss=losses.softmax_xent):
    """Mean loss (the run's `loss`, losses.py) and accuracy of padded batches' logits
    (padding masked out)."""
    per_example = losses.integer_label_losses(loss, logits, y_batches)
    correct = jnp.argmax(logits, -1) == y_batches
    count = jnp.sum(valid_batches)
    return {"loss": jnp.sum(jnp.sum(per_example * valid_batches, axis=1)) / count,
            "accuracy": jnp.sum(jnp.sum(correct * valid_batches, axis=1)) / count}


def evaluate(state, x_batches, y_batches, valid_batches, loss=losses.softmax_xent,
             **logits_kwargs):
    """Mean loss and accuracy over padded test batches (padding masked out), as one
    program; logits_kwargs: those of eval_logits."""
    logits = eval_logits(state, x_batches, valid_batches, **logits_kwargs)
    return logits_metrics(logits, y_batches, valid_batches, loss)


class EvaluationStopped(Exception):
    """should_stop() said so between two batches of an evaluation."""


def compile_evaluation(state, x_batches, y_batches, valid_batches, *, mean, std, tta,
                       pad_mode, tta_images=None, loss=losses.softmax_xent,
                       replicas: bool = False, out_sharding=None):
    """evaluate() as a host loop over the test batches, one compiled call per batch, so
    that it can stop between any two (a signal) and show how far it is: returns
    evaluate_batches(state, x_batches, y_batches, valid_batches, should_stop=None,
    progress=None) -> metrics. It computes what evaluate() does, part by part: each
    batch's logits (with TTA, or plain and then TTA on the least confident images), then
    the metrics of them all. should_stop() is asked after every batch and raises
    EvaluationStopped; progress(n) is told each batch done. With `replicas`, the state
    has a leading replica axis and every program maps over it (one replica's activations
    at a time: vmapped convolutions become grouped ones, far slower on XLA:CPU)."""
    predict = functools.partial(predict_logits, mean=mean, std=std, pad_mode=pad_mode)
    partial_tta = tta != "none" and tta_images is not None and tta_images > 0
    first_tta = "none" if (tta == "none" or tta_images is not None) else tta

    def over_replicas(fn, replica_args):
        """fn(state, *args) for every replica: args flagged True carry a replica axis."""
        if not replicas:
            return fn
        def mapped(state, *args):
            shared = {i: a for i, (a, r) in enumerate(zip(args, replica_args)) if not r}
            own = tuple(a for a, r in zip(args, replica_args) if r)

            def one(item):
                s, rest = item[0], list(item[1:])
                full = [shared[i] if i in shared else rest.pop(0) for i in range(len(args))]
                return fn(s, *full)
            return jax.lax.map(one, (state, *own))
        return mapped

    def compiled(fn, *args):
        """(fn compiled for args, the shapes it returns)."""
        lowered = jax.jit(fn, out_shardings=out_sharding).lower(*args)
        return lowered.compile(), lowered.out_info

    batch_fn, plain_shape = compiled(
        over_replicas(functools.partial(predict, tta=first_tta), (False,)), state, x_batches[0])
    axis = 1 if replicas else 0  # where the batches stack
    stack = lambda parts: jnp.stack(parts, axis=axis)
    plain_spec = jax.ShapeDtypeStruct(  # every batch's, stacked
        plain_shape.shape[:axis] + (x_batches.shape[0],) + plain_shape.shape[axis:],
        plain_shape.dtype, sharding=out_sharding)
    metrics = functools.partial(logits_metrics, loss=loss)
    metrics_fn, _ = compiled(jax.vmap(metrics, in_axes=(0, None, None)) if replicas else metrics,
                             plain_spec, y_batches, valid_batches)
    if partial_tta:
        pick = functools.partial(least_confident, tta_images=tta_images)
        pick_fn, picked_spec = compiled(jax.vmap(pick, in_axes=(0, None)) if replicas
                                        else pick, plain_spec, valid_batches)
        gather_fn, images = compiled(jax.vmap(gather_batches, in_axes=(None, 0)) if replicas
                                     else gather_batches, x_batches, picked_spec)
        one_image_batch = jax.ShapeDtypeStruct(images.shape[:axis] + images.shape[axis + 1:],
                                               images.dtype, sharding=out_sharding)
        tta_fn, tta_shape = compiled(
            over_replicas(functools.partial(predict, tta=tta), (True,)), state, one_image_batch)
        tta_spec = jax.ShapeDtypeStruct(
            tta_shape.shape[:axis] + (images.shape[axis],) + tta_shape.shape[axis:],
            tta_shape.dtype, sharding=out_sharding)
        merge = functools.partial(with_tta_logits, tta_images=tta_images)
        merge_fn, _ = compiled(jax.vmap(merge) if replicas else merge, plain_spec,
                               picked_spec, tta_spec)

    def evaluate_batches(state, x_batches, y_batches, valid_batches, should_stop=None,
                         progress=None):
        def done_one(parts):
            # One batch in flight: the device stays busy, and the progress bar and a stop
            # wait for the batch before it (dispatch would otherwise run through them all).
            if len(parts) > 1 and (progress is not None or should_stop is not None):
                jax.block_until_ready(parts[-2])
            if progress is not None:
                progress(1)
            if should_stop is not None and should_stop():
                raise EvaluationStopped()
        parts = []
        for i in range(x_batches.shape[0]):
            parts.append(batch_fn(state, x_batches[i]))
            done_one(parts)
        logits = stack(parts)
        if partial_tta:
            picked = pick_fn(logits, valid_batches)
            images = gather_fn(x_batches, picked)
            parts = []
            for j in range(images.shape[axis]):
                parts.append(tta_fn(state, images[:, j] if replicas else images[j]))
                done_one(parts)
            logits = merge_fn(logits, picked, stack(parts))
        return metrics_fn(logits, y_batches, valid_batches)
    evaluate_batches.batches = x_batches.shape[0] + (  # the calls progress() counts
        images.shape[axis] if partial_tta else 0)
    return evaluate_batches
