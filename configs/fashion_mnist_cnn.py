"""Fashion-MNIST with a narrow cifar_cnn (BatchNorm CNN) on 1-channel 28x28 images.

Sized for the 10-minute CPU budget (at least 93% in under 10 minutes of training on this
project's 2-core CPU): widths (16, 32, 64) rather than (24, 48, 96) or (32, 64, 128). The
epoch times that chose them, and the recipe's result:
BENCHMARKS.md#the-recipes-trained-and-side-by-side-with-pytorch-2026-11-30; with oneDNN's
convolutions (model.conv_impl='auto'): BENCHMARKS.md#convolutional-nets-on-the-cpu-issue-32.
"""
from jaxtrain.config import defaults


def get_config():
    config = defaults.get_config()
    config.data.name = "fashion_mnist"
    config.model.name = "cifar_cnn"
    config.model.widths = (16, 32, 64)
    config.model.stem_width = 8
    config.optimizer.name = "sgd"
    config.optimizer.nesterov = True
    config.optimizer.momentum = 0.9
    config.optimizer.learning_rate = 0.4
    config.optimizer.weight_decay = 5e-4
    config.optimizer.schedule = "onecycle"
    config.optimizer.warmup_fraction = 0.2
    config.optimizer.start_lr_fraction = 0.1
    config.augment.flip = True
    config.augment.translate = 2
    config.augment.pad_mode = "constant"  # black borders, like the images' own background
    config.train.batch_size = 256
    config.train.num_epochs = 12
    config.train.label_smoothing = 0.1
    config.eval.batch_size = 2000
    config.eval.tta = "flip"
    return config
