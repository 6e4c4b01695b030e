"""Fashion-MNIST with the "BP network" of the second seed article: an MLP
784-256-128-100-10 with BatchNorm1d after each hidden layer, Adam lr 0.001,
batch 128, 10 epochs, float32; plus a linear learning-rate decay to 0, which ends
more accurate than the constant rate (both measured in
BENCHMARKS.md#the-recipes-trained-and-side-by-side-with-pytorch-2026-11-30)."""
from jaxtrain.config import defaults


def get_config():
    config = defaults.get_config()
    config.data.name = "fashion_mnist"  # also found in /usr/share/datasets/fashion-mnist
    config.model.name = "mlp"
    config.model.hidden_sizes = (256, 128, 100)
    config.model.batch_norm = True
    config.optimizer.name = "adam"
    config.optimizer.learning_rate = 0.001
    config.optimizer.schedule = "linear"
    config.train.batch_size = 128
    config.train.num_epochs = 10
    config.train.precision = "float32"  # as the article trains
    config.eval.batch_size = 2000
    return config
