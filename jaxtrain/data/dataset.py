"""The Dataset every loader returns, and the one error every loader raises."""
from __future__ import annotations

import dataclasses

import numpy as np

class DataError(Exception):
    """Raised for missing, malformed or unsafe data; message names the file and the problem."""


@dataclasses.dataclass(frozen=True, eq=False)
class Dataset:
    """A train/test split held in host memory.

    eq=False: comparing numpy arrays with == is ambiguous, so datasets
    compare (and hash) by identity.
    """
    x_train: np.ndarray = dataclasses.field(repr=False)  # uint8 (N, H, W, C), HWC RGB
    y_train: np.ndarray = dataclasses.field(repr=False)  # int32 (N,)
    x_test: np.ndarray = dataclasses.field(repr=False)   # uint8 (M, H, W, C)
    y_test: np.ndarray = dataclasses.field(repr=False)   # int32 (M,)
    class_names: tuple[str, ...]
    origin: str  # the path or 'tfds:<name>' it came from

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    @property
    def image_shape(self) -> tuple[int, int, int]:
        return tuple(self.x_train.shape[1:])
