"""The seed article's PyTorch recipe, as written: LeNet-style CNN, batch 4,
SGD lr 0.001 momentum 0.9, 2 epochs, Normalize(0.5, 0.5), no augmentation."""
from jaxtrain.config import defaults


def get_config():
    config = defaults.get_config()
    config.model.name = "seed_cnn"
    config.data.mean = (0.5, 0.5, 0.5)
    config.data.std = (0.5, 0.5, 0.5)
    config.optimizer.name = "sgd"
    config.optimizer.learning_rate = 0.001
    config.optimizer.momentum = 0.9
    config.train.batch_size = 4
    config.train.num_epochs = 2
    config.train.precision = "float32"  # the article trains in float32
    config.eval.batch_size = 1000
    return config
