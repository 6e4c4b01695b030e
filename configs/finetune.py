"""Fine-tune an ImageNet ResNet-50 on your own images: a new head, a low backbone rate.

    python main.py --config=configs/finetune.py --config.data.dir=DIR --workdir=runs/mine

DIR is an image folder as configs/folder.py reads (train/<class>/*, test/<class>/*).
The starting weights are torchvision's ImageNet ResNet-50 (IMAGENET1K_V2), downloaded
once into ~/.cache/jaxtrain/weights and checked against their published hash; the
1000-class head is re-initialised for your classes, everything else is loaded, and
the images are normalised with ImageNet's mean and std, as the weights were trained.
Any other start works the same way: --config.model.init_from=FILE.pth (a torchvision
or timm state_dict), a .safetensors file, or another jaxtrain run's workdir.

The recipe: SGD with Nesterov momentum at lr 0.01 for the backbone and 10x that for
the new head, 10% linear warm-up then cosine decay, label smoothing 0.1, flips and
16-pixel shifts, 10 epochs at 224 px in bfloat16 on a GPU (float32 on a CPU).
data.image_size=160 has about half the pixels to compute on, usually at some cost in
accuracy. A linear probe (only the head trains):
--config.optimizer.groups.backbone.freeze=True --config.model.freeze_batch_stats=True.
"""
from jaxtrain.config import defaults


def get_config():
    config = defaults.get_config()
    config.data.name = "folder"
    config.data.image_size = 224
    config.data.resize = "crop"
    config.model.name = "resnet50"
    config.model.stem = "imagenet"
    config.model.init_from = "torchvision:resnet50"
    config.optimizer.name = "sgd"
    config.optimizer.momentum = 0.9
    config.optimizer.nesterov = True
    config.optimizer.learning_rate = 0.01
    config.optimizer.weight_decay = 5e-5
    config.optimizer.schedule = "warmup_cosine"
    config.optimizer.warmup_fraction = 0.1
    # the pretrained layers at the base rate, the new head (Dense_0) at 10x
    config.optimizer.groups.backbone = defaults.param_group(r"(?!Dense_0/).*")
    config.optimizer.groups.head = defaults.param_group(r"Dense_0/.*", lr_scale=10.0)
    config.augment.flip = True
    config.augment.translate = 16
    config.train.batch_size = 64
    config.train.num_epochs = 10
    config.train.label_smoothing = 0.1
    config.eval.batch_size = 250
    return config
