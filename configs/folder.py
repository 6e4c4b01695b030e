"""Your own images: any ImageFolder tree, ResNet-18, the usual recipe.

    python main.py --config=configs/folder.py --config.data.dir=DIR --workdir=runs/mine

DIR holds train/<class>/* and test/<class>/* (or val/<class>/*): JPEG, PNG, BMP or
WebP of any size and mode. Each image is decoded once, in parallel, resized (short
side to data.image_size, then a centre crop) and cached under ~/.cache/jaxtrain, so
later runs start in seconds. At 64 px and below ResNet-18 takes the CIFAR stem (3x3
conv, no pooling); above, the ImageNet stem (7x7/2 conv + max-pool).

Nesterov SGD with a warm-up and cosine decay, weight decay 5e-4, label smoothing
0.1, flips and 4-pixel shifts, bfloat16: a recipe that trains ResNets well on small
datasets; change data.image_size, train.num_epochs and train.batch_size to suit yours.
"""
from configs import default


def get_config():
    config = default.get_config()
    config.data.name = "folder"
    config.data.image_size = 64
    config.data.resize = "crop"
    config.model.name = "resnet18"
    config.model.stem = "auto"
    config.optimizer.name = "sgd"
    config.optimizer.momentum = 0.9
    config.optimizer.nesterov = True
    config.optimizer.learning_rate = 0.2
    config.optimizer.weight_decay = 5e-4
    config.optimizer.schedule = "warmup_cosine"
    config.optimizer.warmup_fraction = 0.05
    config.augment.flip = True
    config.augment.translate = 4
    config.train.batch_size = 256
    config.train.num_epochs = 30
    config.train.label_smoothing = 0.1
    config.train.precision = "bfloat16"
    config.eval.tta = "flip"
    return config
