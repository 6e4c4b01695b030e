"""CIFAR-10 with cifar_cnn: the fast recipe (see README for its measurements)."""
from configs import default


def get_config():
    config = default.get_config()
    config.model.name = "cifar_cnn"
    config.optimizer.name = "sgd"
    config.optimizer.nesterov = True
    config.optimizer.momentum = 0.85
    config.optimizer.learning_rate = 0.2
    config.optimizer.weight_decay = 5e-4
    config.optimizer.schedule = "onecycle"
    config.optimizer.warmup_fraction = 0.2
    config.optimizer.start_lr_fraction = 0.2
    config.optimizer.end_lr_fraction = 0.05
    config.augment.flip = True
    config.augment.translate = 2
    config.train.batch_size = 1024
    config.train.num_epochs = 10
    config.train.label_smoothing = 0.2
    config.train.precision = "bfloat16"
    config.eval.tta = "flip_translate"
    return config
