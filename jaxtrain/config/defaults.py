"""Defaults shared by every recipe; each config file starts from these and changes what it needs.

Every key any recipe may set is here, with a comment, so a typo in a config
file, on the command line or in Python fails (checks.check_config) instead of
being ignored. A config file anywhere starts from them with
`from jaxtrain.config.defaults import get_config, param_group`, or from another
recipe with `recipe(NAME, __file__)`.
"""
import importlib.util
import os

import ml_collections


def value_at(config, key: str):
    """The value at a dotted key ('train.batch_size'); KeyError where a part is missing."""
    node = config
    for part in key.split("."):
        node = node[part]
    return node


def has_key(config, key: str) -> bool:
    """Whether the dotted key names a block or value of `config`."""
    try:
        value_at(config, key)
    except (KeyError, AttributeError, TypeError):  # a part missing, or a value, not a block
        return False
    return True


def get_config() -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()
    config.seed = 0

    config.data = ml_collections.ConfigDict()
    config.data.name = "cifar10"     # 'cifar10' | 'cifar100' | 'fashion_mnist' | 'mnist' | 'folder' | 'arrays'
    config.data.source = "auto"      # 'auto' (local files, then download, then tfds) | 'files' | 'download' | 'tfds'
    config.data.dir = ""             # searched first, then $JAXTRAIN_DATA_DIR, ~/.cache/jaxtrain;
                                     # folder: the root of train/<class>/*, test/<class>/*; arrays: the .npz
    config.data.label = "fine"       # cifar100: 'fine' (100 classes) | 'coarse' (20 superclasses)
    config.data.image_size = 0       # folder: resize to this many pixels square (0: keep; all one size)
    config.data.resize = "crop"      # folder: 'crop' (short side, then centre crop) | 'exact'
    config.data.channels = 3         # folder: 3 (RGB) | 1 (grey); every mode is converted
    config.data.workers = 0          # folder: decoding processes, or streamed: Grain workers (0: one per core)
    config.data.placement = "auto"   # 'device' (whole uint8 train split on every device) | 'stream' (Grain reads
                                     # batches on the host) | 'auto' (device when it fits in device_fraction)
    config.data.device_fraction = 0.5  # auto: the share of one device's memory the train split may take
    config.data.mean = ()            # per-channel, in [0, 1]; () = computed from the training split
    config.data.std = ()

    config.model = ml_collections.ConfigDict()
    config.model.name = "cifar_cnn"  # 'seed_cnn' | 'cifar_cnn' | 'mlp' | 'resnet18' | 'resnet34' | 'resnet50' | 'vit_tiny' | 'vit_small' | 'vit_base'
    config.model.init_from = ""      # starting weights, read at step 0 only: a jaxtrain workdir or checkpoint step folder,
                                     # a PyTorch state_dict (.pth/.pt) or .safetensors file, or a name ('torchvision:resnet50',
                                     # 'timm:vit_small_patch16_224.augreg_in21k_ft_in1k'); tensors of another shape (the head) are
                                     # re-initialised; '' = random init
    config.model.init_from_exclude = ""  # a regular expression: the '/'-joined paths ('Dense_0/.*') that keep their
                                     # fresh init whatever the weights hold (a new head for as many new classes)
    config.model.freeze_batch_stats = False  # True: BatchNorm keeps its (e.g. pretrained) running statistics and normalises with them
    config.model.stem = "auto"       # resnet18/34/50: 'imagenet' (7x7/2 conv + max-pool) | 'cifar' (3x3/1 conv) | 'auto' (cifar up to 64 px a side)
    config.model.batch_norm = False  # seed_cnn, mlp: BatchNorm after each conv and hidden dense
    config.model.hidden_sizes = (256, 128, 100)  # mlp: hidden dense layers
    config.model.dropout = 0.0       # mlp: dropout after each hidden layer; vit: after the attention and MLP projections
    config.model.drop_path = 0.0     # vit: stochastic depth, the largest rate (the last block's; linear from 0 over the blocks)
    config.model.widths = (64, 256, 256)  # cifar_cnn: channels of its three conv blocks
    config.model.stem_width = 24     # cifar_cnn: channels of the 2x2 stem conv
    config.model.stem_init = "default"  # cifar_cnn: 'default' (learned) | 'whiten' (whitens 2x2 patches and stays frozen: never trained)
    config.model.bn_momentum = 0.6   # cifar_cnn: running-average decay (Flax convention)
    config.model.head_scale = 1.0 / 9.0  # cifar_cnn: logits multiplier
    config.model.head_init_std = 0.0  # cifar_cnn: head weights ~ N(0, this^2); 0 = Flax's default init
    config.model.activation = "gelu_tanh"  # cifar_cnn: 'gelu_tanh' | 'gelu' (exact) | 'silu' | 'relu'
    config.model.conv_init = "default"  # cifar_cnn blocks: 'default' | 'dirac' (first C_in filters pass their input through)
    config.model.bn_epsilon = 1e-5   # cifar_cnn: BatchNorm's variance epsilon
    config.model.remat = False       # cifar_cnn, resnet*, vit_*: recompute each block's activations in the backward
                                     # pass (Flax's nn.remat) instead of keeping them: less memory, ~1/3 more compute
    config.model.pool_impl = "auto"  # seed_cnn, cifar_cnn: how 2x2 max-pooling is computed: 'xla' (lax's; select-and-
                                     # scatter gradient) | 'corners' (four strided views; a faster gradient on
                                     # XLA:CPU, the same numbers: BENCHMARKS.md) | 'auto' (corners on a CPU, xla elsewhere)
    config.model.conv_impl = "auto"  # built-in models' 2-D convolutions: 'xla' (lax's) | 'onednn' (float32 ones through
                                     # oneDNN, PyTorch's CPU library, faster on a CPU: BENCHMARKS.md; needs the `cpu` extra and g++)
                                     # | 'auto' (onednn on a single CPU device where it builds, xla elsewhere)
    config.model.bn_impl = "flax"    # seed_cnn, cifar_cnn, mlp, resnet*: 'flax' (nn.BatchNorm) | 'lean' (the same forward numbers; its
                                     # backward pass keeps the input in the compute dtype, not two float32 copies of it;
                                     # gradients within bfloat16 rounding of Flax's)

    config.optimizer = ml_collections.ConfigDict()
    config.optimizer.name = "sgd"    # 'sgd' | 'adam' | 'adamw' | 'muon' (>= 2-D parameters only), with the keys below; or
                                     # any optax optimiser by name ('lion', 'adafactor', 'contrib.schedule_free_adamw', ...)
                                     # with optimizer.kwargs, taking the schedule below as its learning rate
    config.optimizer.kwargs = {}     # an optax optimiser's other arguments, e.g. {'b1': 0.95} (not the built-ins')
    config.optimizer.clip_norm = 0.0  # > 0: clip the gradient's global norm to this first (any optimiser); 0 = off
    config.optimizer.learning_rate = 0.1
    config.optimizer.momentum = 0.9  # sgd; 0 = plain SGD
    config.optimizer.nesterov = False
    config.optimizer.weight_decay = 0.0
    config.optimizer.b1 = 0.9        # adam, adamw
    config.optimizer.b2 = 0.999
    config.optimizer.eps = 1e-8
    config.optimizer.ns_steps = 5    # muon: Newton-Schulz iterations
    config.optimizer.ns_coeffs = (3.4445, -4.7750, 2.0315)  # muon: the quintic iteration's (a, b, c)
    config.optimizer.renormalize = False  # after each step, scale each kernel to norm sqrt(output channels)
    config.optimizer.ns_stack = False  # muon: stack same-shape kernels, one batched Newton-Schulz per shape (fewer,
                                     # larger matrix products; same updates within float rounding; opt_state stacked)
    config.optimizer.flatten = False  # top level only: sgd/adam/adamw groups (and lookahead) update one concatenated
                                      # vector (optax.flatten), groups of one optimiser the same one: fewer kernels, the
                                      # same steps bit for bit; opt_state flat
    config.optimizer.lookahead_steps = 0  # > 0: Lookahead, every this many steps pull the weights
    config.optimizer.lookahead_alpha = 0.5  # toward (and reset them to) a slow copy, by this fraction
    config.optimizer.schedule = "constant"  # 'constant' | 'linear' | 'onecycle' | 'warmup_cosine'
    config.optimizer.warmup_fraction = 0.0  # of all steps; onecycle and warmup_cosine
    config.optimizer.start_lr_fraction = 0.0  # onecycle: first lr = peak * this
    config.optimizer.end_lr_fraction = 0.0    # linear, onecycle, warmup_cosine: last lr = peak * this
    # Parameter groups: name -> param_group(...) below. A group's parameters get its own
    # optimizer settings (any key above, plus lr_scale and train_steps); the rest use the
    # settings above. Every group must match a parameter, and no parameter two groups.
    config.optimizer.groups = ml_collections.ConfigDict()

    config.augment = ml_collections.ConfigDict()
    config.augment.flip = False      # random horizontal flip
    config.augment.alternate_flip = False  # with flip: each image's flip alternates by epoch (random at first)
    config.augment.translate = 0     # random translation up to this many pixels (pad + crop)
    config.augment.pad_mode = "reflect"  # 'reflect' | 'constant' (zeros), for translate and TTA
    config.augment.rotate = 0.0      # random rotation up to this many degrees
    config.augment.cutout = 0        # side of one random black square; 0 = off
    config.augment.mixup = 0.0       # MixUp: Beta(this, this) mixing weight; 0 = off (timm's recipes: 0.8)
    config.augment.cutmix = 0.0      # CutMix: Beta(this, this) box area; 0 = off (timm's recipes: 1.0)
    config.augment.mix_prob = 1.0    # mixup/cutmix: the share of batches mixed
    config.augment.switch_prob = 0.5  # both on: the share of mixed batches that use CutMix rather than MixUp
    config.augment.fn = ""           # 'package.module:function': your augmentation, fn(images, key) -> images on float32
                                     # (N, H, W, C) images in [0, 1], after the built-ins, inside the compiled step; '' = none
    config.augment.crop = "none"     # 'random_resized' (streamed folders: ImageNet-style crop + flip on the host) | 'none'
    config.augment.crop_scale = (0.08, 1.0)  # random_resized: share of the image's area
    config.augment.crop_ratio = (3 / 4, 4 / 3)  # random_resized: aspect ratio range (log-uniform)

    config.train = ml_collections.ConfigDict()
    config.train.batch_size = 128
    config.train.accumulate_steps = 1  # > 1: each optimiser step averages the gradients of this many micro-batches of
                                     # batch_size / this (a scan inside the step): the memory of the smaller batch. BatchNorm
                                     # sees each micro-batch, so its batch statistics are those of batch_size / this and
                                     # its running averages update this many times a step (as in Keras)
    config.train.num_epochs = 10
    config.train.num_steps = 0       # > 0 overrides num_epochs
    config.train.precision = "auto"  # 'bfloat16' (float32 params/stats/opt state) | 'float32' | 'auto' (bfloat16 on
                                     # GPUs and TPUs, float32 on a CPU, whose bfloat16 is many times slower)
    config.train.label_smoothing = 0.0
    config.train.loss = "softmax_xent"  # per example, reported as train_loss and test_loss: 'softmax_xent' | 'sigmoid_xent'
                                     # (one-vs-all, summed over classes) | 'focal' | 'package.module:function',
                                     # fn(logits, targets) -> (N,) with targets probability vectors (smoothed, mixed)
    config.train.focal_gamma = 2.0   # train.loss='focal': (1 - p)^gamma weighting; 0 = softmax_xent
    config.train.log_every_steps = 0  # a metrics.jsonl row every this many steps; 0 = about 50 rows a run (no extra chunks either way)
    config.train.chunk_steps = 0     # > 0: a chunk (one program call) ends at every multiple of this many steps, where a multi-process run can stop for a signal; 0 = epochs
    config.train.chunk_seconds = 2.0  # a scanned chunk runs in calls of about this long, so that a signal is honoured and the
                                     # progress bar moves within it: on a CPU from the first step, elsewhere once a chunk took
                                     # longer (one more program compiled then); 0 = chunks run whole (single-process runs)
    config.train.loop = "auto"       # "scan" (a chunk = one program), "python" (a call per step), "auto": scan except on the
                                     # CPU for models with XLA's convolutions (model.conv_impl='xla', users' models)
    config.train.drop_finished_groups = False  # True: from each optimizer group's train_steps on, the chunks are
                                     # programs that compute no gradient for its parameters (its rate is 0 there
                                     # anyway): the same parameters, less work; False: every step computes them all

    config.train.replicas = 1        # > 1: this many runs trained together in one program (jax.vmap),
                                     # seeds seed, seed+1, ...; crossed with `sweep` below
    config.train.ema_decay = ml_collections.config_dict.placeholder(float)  # e.g. 0.999: also keep an
                                     # exponential moving average of the weights and BatchNorm statistics,
                                     # evaluated beside them (test_accuracy_ema); None = off
    config.train.nonfinite = "stop"  # a non-finite loss: 'stop' (keep the last checkpoint) | 'skip' the step
    config.train.compilation_cache = "~/.cache/jaxtrain/xla"  # JAX's persistent compilation cache; '' = off
    config.train.xla_flags = ""      # XLA's own flags for this run's compilations, e.g. '--xla_gpu_autotune_level=2':
                                     # added to XLA_FLAGS before JAX starts (main.py, bench, compare; jaxtrain/runtime/xla_flags.py);
                                     # '' = XLA_FLAGS as the environment has it

    config.parallel = ml_collections.ConfigDict()
    config.parallel.fsdp = 1         # > 1: parameters, optimiser state and EMA split over this many devices (an 'fsdp'
                                     # mesh axis; it must divide the device count); the batch is split over all devices

    config.checkpoint = ml_collections.ConfigDict()
    config.checkpoint.every_steps = 0   # > 0: save every this many steps (overrides every_epochs)
    config.checkpoint.every_epochs = 1  # save at the end of every this many epochs; 0 = only at the end
    config.checkpoint.keep = 3          # newest checkpoints kept
    config.checkpoint.best_metric = ""  # 'test_accuracy' | 'test_loss': also keep the best checkpoints by it
                                        # (a checkpoint at every evaluation; resume still takes the newest)
    config.checkpoint.best_mode = "auto"  # 'max' | 'min' | 'auto' (max for accuracy, min for loss)
    config.checkpoint.keep_best = 1     # best checkpoints kept, besides the newest `keep`
    config.checkpoint.resume_step = 0   # > 0: resume from this step's checkpoint instead of the newest (the newer ones are
                                        # moved aside to checkpoints-set-aside/, not deleted); a newest one that cannot be
                                        # read stops the run, naming the older ones
    config.checkpoint.allow_recipe_change = False  # True: resume even though the recipe changed
                                        # (model, optimizer, data, ...); the run is then no longer exact

    config.eval = ml_collections.ConfigDict()
    config.eval.batch_size = 1000
    config.eval.tta = "none"         # 'none' | 'flip' | 'flip_translate'
    config.eval.tta_fraction = 1.0   # TTA only on this fraction of test images, the least confident
    config.eval.every_epochs = 1     # 0 = only at the end
    config.eval.every_steps = 0      # > 0: also evaluate every this many steps (test points on the curves)

    # Experiment trackers (jaxtrain/callbacks/trackers/; optional packages, imported only when set)
    config.logging = ml_collections.ConfigDict()
    config.logging.mlflow = ""       # an MLflow tracking URI, e.g. 'sqlite:///runs/mlflow.db'; '' = off
    config.logging.mlflow_experiment = "jaxtrain"  # the MLflow experiment the run goes into
    config.logging.mlflow_registered_model = ""  # a name: the run's MLflow Model registered as
                                                 # a new version of it; '' = not registered
    config.logging.wandb = ""        # a Weights & Biases project; '' = off
    config.logging.wandb_mode = "offline"  # 'offline' (no network; `wandb sync` later) | 'online'

    # Callbacks (jaxtrain/callbacks/): name -> callback('package.module:Class', **kwargs),
    # or a built-in by its name (callback('EarlyStopping', monitor='test_loss', patience=3));
    # made anew for every run (a resume too), called in the order of their names.
    config.callbacks = ml_collections.ConfigDict()

    # Sweep: a tuple of values for any of these keys trains one replica per value (per
    # seed of train.replicas, per combination of swept keys) in the same program, e.g.
    # --config.sweep.optimizer.learning_rate="(0.05, 0.1, 0.2)". () = not swept. Keys that
    # change shapes or the program (widths, batch size, model) cannot be swept.
    config.sweep = ml_collections.ConfigDict()
    config.sweep.optimizer = ml_collections.ConfigDict()
    for name in ("learning_rate", "weight_decay", "momentum", "b1", "b2"):
        config.sweep.optimizer[name] = ()
    config.sweep.train = ml_collections.ConfigDict()
    config.sweep.train.label_smoothing = ()
    return config


def param_group(params: str, **settings) -> ml_collections.ConfigDict:
    r"""One entry of optimizer.groups.

    params: a regular expression that must match the whole '/'-joined parameter
    path (e.g. r"ConvBlock_\d+/Conv_\d+/kernel"); lr_scale: the group's learning
    rate is lr_scale x the schedule of optimizer.learning_rate; train_steps: > 0
    trains the group for the first this many steps only. Any other optimizer key
    (name, momentum, weight_decay, ...) overrides the top-level value. freeze=True: the
    group is never updated and keeps no optimiser state (a frozen pretrained backbone).
    """
    return ml_collections.ConfigDict({"params": params, "lr_scale": 1.0, "train_steps": 0, "freeze": False,
                                      **settings})


def callback(name: str, **kwargs) -> ml_collections.ConfigDict:
    """One entry of config.callbacks: the class `name` names ('package.module:Class', or a
    built-in of jaxtrain.callbacks by its name), built with kwargs, each a key of the
    entry beside `name`, so that --config.callbacks.NAME.patience=5 sets one."""
    if "kwargs" in kwargs:
        raise ValueError("callback(): 'kwargs' names the entries of configs saved before "
                         "arguments became keys of their own; pass each argument by name")
    return ml_collections.ConfigDict({"name": name, **kwargs})


def recipe(name: str, beside: str) -> ml_collections.ConfigDict:
    """get_config() of the recipe NAME.py in the folder of the file `beside` (a config
    file's __file__): how one recipe builds on another without importing a `configs`
    package, so that a recipe loads from any directory."""
    path = os.path.join(os.path.dirname(os.path.abspath(beside)), f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"jaxtrain_recipe_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()
