"""Fine-tune an ImageNet ViT-S/16 (timm's) on your own images.

    python main.py --config=configs/finetune_vit.py --config.data.dir=DIR --workdir=runs/vit

The starting weights are timm's vit_small_patch16_224.augreg_in21k_ft_in1k (ImageNet-21k,
then ImageNet-1k), downloaded once from the Hugging Face hub into
~/.cache/jaxtrain/weights; the head is re-initialised for your classes and the images
are normalised as those weights were trained (mean = std = 0.5). At an image size
other than 224 the position embeddings are resampled (bicubic), as timm does.

The recipe, after the usual ViT fine-tuning ones: AdamW at lr 1e-4 for the backbone and
10x for the new head, weight decay 0.05, 10% warm-up then cosine decay, label
smoothing 0.1, MixUp 0.8 and CutMix 1.0 (one or the other per batch), stochastic depth
0.1, flips, 10 epochs at 224 px in bfloat16 on a GPU (float32 on a CPU). Other sizes:
model.name='vit_tiny' or 'vit_base' with the matching --config.model.init_from.
"""
from jaxtrain.config import defaults


def get_config():
    config = defaults.get_config()
    config.data.name = "folder"
    config.data.image_size = 224
    config.data.resize = "crop"
    config.model.name = "vit_small"
    config.model.init_from = "timm:vit_small_patch16_224.augreg_in21k_ft_in1k"
    config.model.drop_path = 0.1
    config.optimizer.name = "adamw"
    config.optimizer.learning_rate = 1e-4
    config.optimizer.weight_decay = 0.05
    config.optimizer.schedule = "warmup_cosine"
    config.optimizer.warmup_fraction = 0.1
    config.optimizer.groups.backbone = defaults.param_group(r"(?!head/).*")
    config.optimizer.groups.head = defaults.param_group(r"head/.*", lr_scale=10.0)
    config.augment.flip = True
    config.augment.mixup = 0.8
    config.augment.cutmix = 1.0
    config.train.batch_size = 64
    config.train.num_epochs = 10
    config.train.label_smoothing = 0.1
    config.eval.batch_size = 250
    return config
