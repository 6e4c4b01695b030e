"""CIFAR-100 with ResNet-18 (CIFAR stem: 3x3 conv, no pooling), fine labels.

    python main.py --config=configs/cifar100_resnet18.py --workdir=runs/c100
    # the 20 superclasses: --config.data.label=coarse

The common CIFAR ResNet-18 recipe: Nesterov SGD, lr 0.1 per 128 images (0.4 at
batch 512) with a warm-up and cosine decay, weight decay 5e-4, label smoothing
0.1, flips and 4-pixel shifts, 60 epochs, bfloat16 on a GPU (train.precision='auto').
"""
from jaxtrain.config import defaults


def get_config():
    config = defaults.get_config()
    config.data.name = "cifar100"
    config.data.label = "fine"
    config.model.name = "resnet18"
    config.model.stem = "cifar"
    config.optimizer.name = "sgd"
    config.optimizer.momentum = 0.9
    config.optimizer.nesterov = True
    config.optimizer.learning_rate = 0.4
    config.optimizer.weight_decay = 5e-4
    config.optimizer.schedule = "warmup_cosine"
    config.optimizer.warmup_fraction = 0.05
    config.augment.flip = True
    config.augment.translate = 4
    config.train.batch_size = 512
    config.train.num_epochs = 60
    config.train.label_smoothing = 0.1
    config.eval.tta = "flip"
    return config
