"""tensorflow-datasets as a source (optional: imported only when used)."""
from __future__ import annotations

import numpy as np

from jaxtrain.data.dataset import DataError, Dataset


def load_tfds(name: str, data_dir: str | None = None, download: bool = True) -> Dataset:
    """Load `name` through tensorflow-datasets (imported only here: it is slow and optional)."""
    try:
        import tensorflow_datasets as tfds
    except ImportError as e:
        raise DataError(f'tfds:{name}: tensorflow-datasets is not installed '
                        f'(pip install tensorflow-datasets tensorflow) [{e}]') from e
    try:
        import tensorflow  # noqa: F401  tfds needs it to read prepared data
    except ImportError as e:
        raise DataError(f'tfds:{name}: tensorflow is not installed, tensorflow-datasets '
                        f'needs it (pip install tensorflow) [{e}]') from e

    try:
        builder = tfds.builder(name, data_dir=data_dir)
        if download:
            builder.download_and_prepare()
        elif not builder.is_prepared():
            raise DataError(f'tfds:{name}: not prepared in {builder.data_dir} and download=False')
        train, test = (tfds.as_numpy(builder.as_dataset(split=s, batch_size=-1, as_supervised=True))
                       for s in ('train', 'test'))
        class_names = tuple(str(n) for n in builder.info.features['label'].names)
    except DataError:
        raise
    except Exception as e:
        raise DataError(f'tfds:{name}: {type(e).__name__}: {e}') from e

    (x_train, y_train), (x_test, y_test) = train, test
    for x, y, split in ((x_train, y_train, 'train'), (x_test, y_test, 'test')):
        if np.asarray(x).dtype != np.uint8 or np.ndim(x) != 4:
            raise DataError(f'tfds:{name}: {split} images are {np.asarray(x).dtype} '
                            f'{np.shape(x)}, expected uint8 (N, H, W, C)')
        y = np.asarray(y)
        if y.shape != (len(x),) or (y.size and (y.min() < 0 or y.max() >= len(class_names))):
            raise DataError(f'tfds:{name}: {split} labels do not match its {len(x)} images '
                            f'and {len(class_names)} classes')
    return Dataset(
        x_train=np.ascontiguousarray(x_train),
        y_train=np.asarray(y_train, dtype=np.int32),
        x_test=np.ascontiguousarray(x_test),
        y_test=np.asarray(y_test, dtype=np.int32),
        class_names=class_names,
        origin=f'tfds:{name}',
    )
