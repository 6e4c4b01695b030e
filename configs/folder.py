"""Your own images: any ImageFolder tree, ResNet-18, the usual recipe.

    python main.py --config=configs/folder.py --config.data.dir=DIR --workdir=runs/mine

DIR holds train/<class>/* and test/<class>/* (or val/<class>/*): JPEG, PNG, BMP or
WebP of any size and mode. Each image is decoded once, in parallel, resized (short
side to data.image_size, then a centre crop) and cached under ~/.cache/jaxtrain, so
later runs start in seconds. At 64 px and below ResNet-18 takes the CIFAR stem (3x3
conv, no pooling); above, the ImageNet stem (7x7/2 conv + max-pool).

configs/cifar100_resnet18.py's recipe (Nesterov SGD with a warm-up and cosine decay,
weight decay 5e-4, label smoothing 0.1, flips and 4-pixel shifts, bfloat16 on a GPU) at batch
256 and lr 0.2 for 30 epochs; change data.image_size, train.num_epochs and
train.batch_size to suit yours.
"""
from jaxtrain.config import defaults


def get_config():
    # the same ResNet-18 recipe, scaled for any folder
    config = defaults.recipe("cifar100_resnet18", __file__)
    config.data.name = "folder"
    config.data.label = "fine"
    config.data.image_size = 64
    config.data.resize = "crop"
    config.model.stem = "auto"
    config.optimizer.learning_rate = 0.2
    config.train.batch_size = 256
    config.train.num_epochs = 30
    return config
