"""The loss a run trains with and reports (train_loss, test_loss), per example:
fn(logits, targets) -> (N,), where targets are probability vectors (one-hot labels,
smoothed by train.label_smoothing and mixed by MixUp/CutMix in training; one-hot in the
evaluation). The step and the evaluation take the mean themselves, so accumulation,
padded test batches and replicas stay exact for any loss."""
import dataclasses

import jax
import jax.numpy as jnp
import optax

from jaxtrain.errors import ConfigError

BUILT_IN = ("softmax_xent", "sigmoid_xent", "focal")


def softmax_xent(logits, targets):
    """Softmax cross-entropy, the default."""
    return optax.softmax_cross_entropy(logits, targets)


def sigmoid_xent(logits, targets):
    """One-vs-all: a sigmoid cross-entropy per class, summed over the classes (as
    big_vision's BiT recipes train)."""
    return jnp.sum(optax.sigmoid_binary_cross_entropy(logits, targets), axis=-1)


@dataclasses.dataclass(frozen=True)
class Focal:
    """Softmax focal loss (Lin et al. 2017): cross-entropy with each class's term weighted
    by (1 - p)^gamma, so confident examples count less; gamma 0 is softmax_xent. A
    frozen dataclass: equal gammas are equal static arguments of the compiled step."""
    gamma: float = 2.0

    def __call__(self, logits, targets):
        log_p = jax.nn.log_softmax(logits)
        return -jnp.sum(targets * (1.0 - jnp.exp(log_p)) ** self.gamma * log_p, axis=-1)


def built_in(name: str, focal_gamma: float):
    """The built-in loss `name` names."""
    if name == "softmax_xent":
        return softmax_xent
    if name == "sigmoid_xent":
        return sigmoid_xent
    if name == "focal":
        return Focal(float(focal_gamma))
    raise ValueError(f"not a built-in loss: {name!r}")


def integer_label_losses(loss, logits, labels):
    """`loss` of logits against integer labels (the evaluation's): the default's through
    optax's integer-label form, as jaxtrain has always computed test_loss; any other
    against one-hot targets."""
    if loss is softmax_xent:
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    return loss(logits, jax.nn.one_hot(labels, logits.shape[-1], dtype=logits.dtype))


def check(loss, num_classes: int, what: str) -> None:
    """A loss that cannot be traced on a batch of logits and targets, or that does not
    return one value per example, stops here, before anything compiles: one line naming
    `what` (the config key or argument) and the shape expected."""
    batch = jax.ShapeDtypeStruct((2, num_classes), jnp.float32)
    try:
        out = jax.eval_shape(loss, batch, batch)
    except TypeError as error:  # its arguments, or a value it cannot trace (JAX's TypeErrors)
        raise ConfigError(f"{what}: cannot be traced on logits and targets of shape "
                          f"(2, {num_classes}): {type(error).__name__}: "
                          f"{str(error).splitlines()[0] if str(error) else ''}") from None
    shape = getattr(out, "shape", None)
    if shape != (2,):
        raise ConfigError(f"{what}: returned {shape if shape is not None else type(out).__name__}"
                          f" for logits and targets of shape (2, {num_classes}); expected "
                          "(2,), one loss per example (jaxtrain takes the mean)")
