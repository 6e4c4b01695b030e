"""ResNet-50 on ImageNet (ILSVRC-2012) from an image folder at 224 px: the usual recipe.

    python main.py --config=configs/imagenet_resnet50.py --workdir=runs/imagenet \
        --config.data.dir=/data/imagenet

data.dir holds train/<wnid>/*.JPEG (1,281,167 images) and val/<wnid>/*.JPEG
(the 50,000 validation images sorted into their class folders). The training
images stream from the files (data.placement='stream'): Grain worker
processes (data.workers, default one per core) decode each one, take an
ImageNet random-resized crop (8-100% of the area, aspect 3/4-4/3) and a flip,
at 224 px; the validation images are decoded once (short side to 224, centre
crop), cached, and kept on the devices (about 7.5 GB).

The recipe (Goyal et al. 2017, as in the Flax ImageNet example): SGD with
Nesterov momentum 0.9, lr 0.1 per 256 images (0.4 at batch 1024), 5 epochs of
linear warm-up then cosine decay over 90 epochs, label smoothing 0.1, weight
decay 5e-5 on the conv and dense kernels only (not on BatchNorm or biases),
bfloat16 compute with float32 parameters.
"""
from jaxtrain.config import defaults


def get_config():
    config = defaults.get_config()
    config.data.name = "folder"
    config.data.image_size = 224
    config.data.resize = "crop"
    config.data.placement = "stream"
    config.data.mean = (0.485, 0.456, 0.406)  # ImageNet's channel statistics
    config.data.std = (0.229, 0.224, 0.225)
    config.model.name = "resnet50"
    config.model.stem = "imagenet"
    config.optimizer.name = "sgd"
    config.optimizer.momentum = 0.9
    config.optimizer.nesterov = True
    config.train.batch_size = 1024
    config.optimizer.learning_rate = 0.1 * config.train.batch_size / 256
    config.optimizer.weight_decay = 5e-5
    config.optimizer.groups.no_decay = defaults.param_group(
        r".*(BatchNorm_\d+/(scale|bias)|bias)", weight_decay=0.0)
    config.optimizer.schedule = "warmup_cosine"
    config.optimizer.warmup_fraction = 5 / 90
    config.augment.crop = "random_resized"
    config.augment.flip = True
    config.train.num_epochs = 90
    config.train.label_smoothing = 0.1
    config.train.log_every_steps = 250
    config.train.chunk_steps = 250  # several processes stop for a signal within 250 steps
    config.checkpoint.every_steps = 2500
    config.eval.batch_size = 500
    config.eval.every_epochs = 1
    return config
