"""Train one config with jaxtrain and with PyTorch; compare time and accuracy.

    python -m jaxtrain.compare --config=configs/cifar_seed_cnn.py [--config.KEY=VALUE ...] \\
        [--frameworks=jax,torch_article,torch_fast] [--workdir=runs/compare]

- jax: jaxtrain itself (loop.train_and_evaluate).
- torch_article: the seed article's PyTorch: a Dataset with per-sample transforms,
  a DataLoader with 2 workers, the plain loop with loss.item() every step.
- torch_fast: the best PyTorch we can write for the same recipe: the data on the
  device as uint8, batches gathered and augmented there, channels_last,
  bfloat16 autocast when the config says bfloat16, torch.compile on CUDA
  (static shapes: dynamic=False; --torch_compile_mode picks the mode).

Timing is the same for jax and torch_fast: compilation and one untimed execution
of what will be timed (jax: every compiled chunk and the evaluation, on a copy of
the state; torch_fast: a forward and backward of a training batch and a forward
of an evaluation batch) are excluded, so neither side's first-run costs (lazy
kernel loading, autotuning) are counted. compare.json's "timing" says so.

All three train the same architecture (parameter counts checked), with the same
initialisation scheme, optimiser (jaxtrain/torch_optim.py: parameter groups and
Muon included), schedule, batch size, number of examples, augmentation, label
smoothing and evaluation, so the table compares frameworks.
torch_article always trains in float32, as the article does. Writes
compare.json and compare.png (test accuracy against seconds) into the workdir.
torch is imported only when a torch framework runs.
"""
import contextlib
import functools
import os
import shutil
import sys
import time
import warnings

import jax
import numpy as np

from jaxtrain import augment as augment_lib
from jaxtrain import data, loop, models, prepare, report, user_model
from jaxtrain.errors import ConfigError, TrainingError

FRAMEWORKS = ("jax", "torch_article", "torch_fast")
TORCH_COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
TIMING = {
    "jax": "train_seconds excludes compilation and one untimed execution of every compiled "
           "program (each chunk length, the evaluation) on a copy of the state",
    "torch_fast": "train_seconds excludes building the model, torch.compile and one untimed "
                  "forward/backward of a training batch and forward of an evaluation batch",
    "torch_article": "train_seconds excludes building the model and the DataLoaders only",
}
JSON_FILE = "compare.json"
PLOT_FILE = "compare.png"


class CompareError(RuntimeError):
    """The comparison cannot run (no torch, an unknown framework, models that differ)."""


def import_torch():
    try:
        import torch
        import torch._dynamo  # noqa: F401  the first optimiser imports it (1.3 s): not a run's time
    except ImportError as error:
        raise CompareError("torch_article and torch_fast need PyTorch (pip install torch; "
                           f"torchvision is not needed) [{error}]") from error
    return torch


# ---------------------------------------------------------------- PyTorch recipe

def torch_unsupported(config) -> list[str]:
    """Config settings the PyTorch twins do not reproduce (config keys, with values)."""
    found = []
    if user_model.is_user_model(config.model.name):
        found.append(f"model.name={config.model.name!r} (your own model has no PyTorch twin)")
    if config.optimizer.lookahead_steps:
        found.append(f"optimizer.lookahead_steps={config.optimizer.lookahead_steps!r}")
    if config.augment.crop != "none":
        found.append(f"augment.crop={config.augment.crop!r}")
    for key in ("mixup", "cutmix"):
        if config.augment[key]:
            found.append(f"augment.{key}={config.augment[key]!r}")
    if config.data.placement == "stream":
        found.append("data.placement='stream' (the twins train from arrays in memory)")
    if config.train.get("accumulate_steps", 1) > 1:
        found.append(f"train.accumulate_steps={config.train.accumulate_steps!r}")
    return found


def torch_recipe(config, dataset, device, total_steps: int, stem_kernel=None, initial=None):
    """The twin model (seeded by config.seed), its optimisers (torch_optim, with the
    learning rates of total_steps steps) and the loss; `stem_kernel` (prepare.setup's,
    for a whitened stem) fixes the stem's weights. `initial` ({'params', 'batch_stats'}:
    jaxtrain's starting variables, model.init_from's weights with its fresh head) are
    the twin's starting weights too, so both sides fine-tune the same network."""
    import torch

    from jaxtrain import torch_models, torch_optim

    torch.manual_seed(config.seed)
    model = torch_models.create_model(config.model, dataset.num_classes, dataset.image_shape)
    if initial is not None:
        torch_models.load_flax_variables(model, jax.device_get(initial), dataset.image_shape)
    if config.model.get("freeze_batch_stats", False):
        torch_models.freeze_batch_norm(model)
    if stem_kernel is not None:
        # jaxtrain's fixed whitening stem (prepare.setup's; HWIO -> OIHW), never trained
        stem = model[0]
        with torch.no_grad():
            stem.weight.copy_(torch.from_numpy(np.array(stem_kernel).transpose(3, 2, 0, 1)))
        stem.weight.requires_grad_(False)
    model = model.to(device)
    optimizer = torch_optim.create_torch_optimizer(config.optimizer, model, total_steps)
    criterion = torch.nn.CrossEntropyLoss(label_smoothing=config.train.label_smoothing)
    return model, optimizer, criterion


def torch_step(model, optimizer, criterion, inputs, labels, step: int,
               autocast=contextlib.nullcontext()):
    """Training step `step` (from 0): its learning rates, forward, loss, backward, update."""
    from jaxtrain import torch_optim

    torch_optim.set_step(optimizer, step)
    optimizer.zero_grad()
    with autocast:
        loss = criterion(model(inputs), labels)
    loss.backward()
    optimizer.step()
    return loss


def torch_evaluate(model, batches, *, mean, std, tta, pad_mode, device,
                   autocast=contextlib.nullcontext(), tta_images=None):
    """Test loss and accuracy with BatchNorm in eval mode and the config's TTA; batches
    yield (images in [0, 1] or uint8, NCHW, labels). tta_images (prepare.tta_image_count):
    None = TTA on every image, k = only on the k least confident (train.eval_logits)."""
    import torch

    from jaxtrain import torch_models

    def logits_of(images, mode):
        views, weights = torch_models.tta_views(images.to(device), mode, pad_mode)
        return sum(w * model(torch_models.normalize(v, mean, std)).float()
                   for v, w in zip(views, weights))

    model.eval()
    with torch.no_grad(), autocast:
        if tta_images is None or tta == "none":
            pairs = [(logits_of(images, tta), labels.to(device)) for images, labels in batches]
            logits = torch.cat([p[0] for p in pairs])
            labels = torch.cat([p[1] for p in pairs])
        else:
            batches = list(batches)
            size = len(batches[0][0])  # the evaluation batch size
            images, labels = (torch.cat(parts) for parts in zip(*batches))
            logits = torch.cat([logits_of(images[i:i + size], "none")
                                for i in range(0, len(images), size)])
            labels = labels.to(device)
            if tta_images:
                confidence = torch.softmax(logits, -1).max(-1).values
                picked = torch.argsort(confidence)[:tta_images].cpu()
                logits[picked] = torch.cat([logits_of(images[picked[i:i + size]], tta)
                                            for i in range(0, tta_images, size)])
    model.train()
    loss = torch.nn.functional.cross_entropy(logits.float(), labels, reduction="sum")
    correct = (logits.argmax(-1) == labels).sum()
    return {"loss": float(loss) / len(labels), "accuracy": float(correct) / len(labels)}


def tta_images(config, dataset):
    """eval.tta_fraction as torch_evaluate's tta_images (prepare.tta_image_count)."""
    return prepare.tta_image_count(config.eval.tta_fraction, len(dataset.x_test))


def device_name(device) -> str:
    import torch

    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def synchronize(device):
    """Waits for queued device work, so the clock measures it."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


class ArticleDataset:
    """A map-style dataset over uint8 HWC arrays with a per-sample transform.

    With `flips` (augment.alternate_flip: each image's first-epoch bit) the
    transform also gets `mirror`, that bit flipped in odd epochs; set `epoch`
    before each epoch's iterator is made (the workers copy the dataset then).
    """

    def __init__(self, images, labels, transform, flips=None):
        self.images, self.labels, self.transform = images, labels, transform
        self.flips, self.epoch = flips, 0

    def __len__(self):
        return len(self.images)

    def __getitem__(self, index):
        if self.flips is None:
            return self.transform(self.images[index]), int(self.labels[index])
        mirror = bool(self.flips[index]) ^ (self.epoch % 2 == 1)
        return self.transform(self.images[index], mirror=mirror), int(self.labels[index])


def first_epoch_flips(config, num_examples: int):
    """augment.alternate_flip's per-image bits for epoch 0 (torch's generator, seeded
    by torch_recipe), or None without it; odd epochs flip them all (augment.py)."""
    import torch

    if not (config.augment.flip and config.augment.alternate_flip):
        return None
    return torch.rand(num_examples) < 0.5


class Progress:
    """Times a torch run (training and evaluation, like jaxtrain's train_seconds), evaluates
    on jaxtrain's schedule and prints one line per evaluation."""

    def __init__(self, name, config, steps_per_epoch, total_steps, device, evaluate):
        self.name, self.config, self.device, self.evaluate = name, config, device, evaluate
        self.steps_per_epoch, self.total_steps = steps_per_epoch, total_steps
        self.curve, self.eval_seconds, self.metrics = [], 0.0, None
        self.start = time.perf_counter()

    def seconds(self):
        synchronize(self.device)
        return time.perf_counter() - self.start

    def after_step(self, step: int, train_loss) -> bool:
        """Evaluates when jaxtrain would; says whether it did (train_loss() is the mean
        since the last evaluation)."""
        if not loop.evaluates_after(step, self.steps_per_epoch, self.total_steps,
                                    self.config.eval.every_epochs, self.config.eval.every_steps):
            return False
        start = self.seconds()
        self.metrics = self.evaluate()
        seconds = self.seconds()
        self.eval_seconds += seconds - start
        self.curve.append({"seconds": round(seconds, 4),
                           "test_accuracy": self.metrics["accuracy"]})
        print(f"{self.name}: epoch {step / self.steps_per_epoch:.2f}  step {step}  "
              f"train_loss {train_loss():.4f}  test_loss {self.metrics['loss']:.4f}  "
              f"test_acc {self.metrics['accuracy']:.2%}  seconds {seconds:.2f}", flush=True)
        return True

    def result(self, warmup_seconds, param_count, precision):
        import torch

        train_seconds = self.seconds()
        steps, batch_size = self.total_steps, self.config.train.batch_size
        return {"device": device_name(self.device), "warmup_seconds": warmup_seconds,
                "train_seconds": train_seconds, "eval_seconds": self.eval_seconds,
                "images_per_second": steps * batch_size / max(train_seconds - self.eval_seconds,
                                                              1e-9),
                "test_accuracy": self.metrics["accuracy"], "test_loss": self.metrics["loss"],
                "param_count": param_count, "steps": steps, "examples_seen": steps * batch_size,
                "precision": precision, "version": f"torch {torch.__version__}",
                "curve": self.curve}


def run_torch_article(config, dataset, mean, std, total_steps: int, stem_kernel=None,
                      initial=None) -> dict:
    """The seed article's way: per-sample transforms in 2 DataLoader workers
    (shuffle, drop_last: as many examples as jaxtrain sees), float32, loss.item()
    every step."""
    import torch

    from jaxtrain import torch_models

    start = time.perf_counter()
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    model, optimizer, criterion = torch_recipe(config, dataset, device, total_steps,
                                               stem_kernel, initial)
    batch_size = config.train.batch_size
    transform = functools.partial(torch_models.article_transform,
                                  augment=augment_lib.device_kwargs(config.augment), mean=mean,
                                  std=std)
    train_set = ArticleDataset(dataset.x_train, dataset.y_train, transform,
                               first_epoch_flips(config, len(dataset.x_train)))
    trainloader = torch.utils.data.DataLoader(train_set, batch_size=batch_size, shuffle=True,
                                              num_workers=2, drop_last=True)
    # Normalize comes after the TTA views (in torch_evaluate): jaxtrain pads with black.
    testloader = torch.utils.data.DataLoader(
        ArticleDataset(dataset.x_test, dataset.y_test, torch_models.to_tensor),
        batch_size=config.eval.batch_size, shuffle=False, num_workers=2)
    evaluate = functools.partial(torch_evaluate, model, testloader, mean=mean, std=std,
                                 tta=config.eval.tta, pad_mode=config.augment.pad_mode,
                                 device=device, tta_images=tta_images(config, dataset))
    warmup_seconds = time.perf_counter() - start

    progress = Progress("torch_article", config, len(dataset.x_train) // batch_size,
                        total_steps, device, evaluate)
    step, running_loss, running_steps = 0, 0.0, 0
    with warnings.catch_warnings():
        # JAX warns on every fork; the workers run only numpy and torch code, never JAX.
        warnings.filterwarnings("ignore", r"os\.fork\(\) was called", RuntimeWarning)
        while step < total_steps:
            train_set.epoch = step // progress.steps_per_epoch
            for inputs, labels in trainloader:
                inputs, labels = inputs.to(device), labels.to(device)
                loss = torch_step(model, optimizer, criterion, inputs, labels, step)
                running_loss += loss.item()
                running_steps += 1
                step += 1
                if progress.after_step(step, lambda: running_loss / running_steps):
                    running_loss, running_steps = 0.0, 0
                if step == total_steps:
                    break
    return progress.result(warmup_seconds, torch_models.count_params(model), "float32")


def check_torch_device(jax_backend: str, torch_has_cuda: bool, torch_version: str = "") -> None:
    """A comparison on a GPU must train both sides there: torch without CUDA would quietly
    train on the CPU."""
    if jax_backend == "gpu" and not torch_has_cuda:
        raise CompareError(f"JAX trains on the GPU but torch {torch_version} sees no CUDA "
                           "device, so its runs would train on the CPU: install a CUDA build "
                           "of torch, or run --frameworks=jax")


def run_torch_fast(config, dataset, mean, std, total_steps: int,
                   torch_compile=None, stem_kernel=None, compile_mode: str = "default",
                   initial=None) -> dict:
    """The same recipe as fast as we can write it: uint8 data resident on the device,
    a torch.randperm order per epoch, each batch gathered and augmented there in one
    go, channels_last, bfloat16 autocast when config.train.precision says so, no host
    sync in the loop, and torch.compile (default: on CUDA only; compiling on a CPU
    costs more than it saves for these runs)."""
    import torch

    from jaxtrain import torch_models

    start = time.perf_counter()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch_compile = device.type == "cuda" if torch_compile is None else torch_compile
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    model, optimizer, criterion = torch_recipe(config, dataset, device, total_steps,
                                               stem_kernel, initial)
    flips = first_epoch_flips(config, len(dataset.x_train))
    flips = None if flips is None else flips.to(device)
    model = model.to(memory_format=torch.channels_last)
    # Static shapes: the evaluation batch must not turn the graph dynamic.
    forward = (torch.compile(model, mode=compile_mode, dynamic=False) if torch_compile
               else model)
    x_train = torch.from_numpy(dataset.x_train).to(device)  # uint8 NHWC
    y_train = torch.from_numpy(dataset.y_train).long().to(device)
    x_test = torch.from_numpy(dataset.x_test).to(device)
    y_test = torch.from_numpy(dataset.y_test).long().to(device)
    augment = augment_lib.device_kwargs(config.augment)
    bfloat16 = config.train.precision == "bfloat16"
    autocast = torch.autocast(device.type, torch.bfloat16, enabled=bfloat16)
    batch_size, eval_batch = config.train.batch_size, config.eval.batch_size

    def batch(indices, epoch=0):
        images = x_train[indices].permute(0, 3, 1, 2)  # NCHW view, channels_last memory
        mirror = None if flips is None else flips[indices] ^ (epoch % 2 == 1)
        images = torch_models.augment_batch(images, mirror=mirror, **augment)
        inputs = torch_models.normalize(images, mean, std)
        return inputs.contiguous(memory_format=torch.channels_last), y_train[indices]

    def test_batches():
        for i in range(0, len(x_test), eval_batch):
            yield x_test[i:i + eval_batch].permute(0, 3, 1, 2), y_test[i:i + eval_batch]

    def evaluate():
        return torch_evaluate(forward, test_batches(), mean=mean, std=std, tta=config.eval.tta,
                              pad_mode=config.augment.pad_mode, device=device,
                              autocast=autocast, tta_images=tta_images(config, dataset))

    # Warm-up (compilation, cuDNN autotuning) without changing the run: forward and
    # backward on one batch and one evaluation batch, then the BatchNorm statistics
    # are put back and the gradients dropped; the optimiser state is untouched.
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    inputs, labels = batch(torch.arange(batch_size, device=device))
    with autocast:
        criterion(forward(inputs), labels).backward()
    optimizer.zero_grad(set_to_none=True)
    forward.eval()
    with torch.no_grad(), autocast:
        forward(torch_models.normalize(x_test[:eval_batch].permute(0, 3, 1, 2), mean, std)
                .contiguous(memory_format=torch.channels_last))
    forward.train()
    model.load_state_dict(saved)
    synchronize(device)
    warmup_seconds = time.perf_counter() - start

    steps_per_epoch = len(x_train) // batch_size
    progress = Progress("torch_fast", config, steps_per_epoch, total_steps, device, evaluate)
    step = 0
    loss_sum, loss_steps = torch.zeros((), device=device), 0
    while step < total_steps:
        order = torch.randperm(len(x_train), device=device)
        epoch = step // steps_per_epoch
        for i in range(min(steps_per_epoch, total_steps - step)):
            inputs, labels = batch(order[i * batch_size:(i + 1) * batch_size], epoch)
            loss = torch_step(forward, optimizer, criterion, inputs, labels, step, autocast)
            loss_sum += loss.detach().float()
            loss_steps += 1
            step += 1
            if progress.after_step(step, lambda: float(loss_sum) / loss_steps):
                loss_sum, loss_steps = torch.zeros((), device=device), 0
    result = progress.result(warmup_seconds, torch_models.count_params(model),
                             config.train.precision)
    result["torch_compile"] = ({"mode": compile_mode, "dynamic": False} if torch_compile
                               else None)
    return result


# ---------------------------------------------------------------- jaxtrain

def run_jax(config, workdir: str) -> dict:
    """jaxtrain itself, in a fresh workdir/jax (an old one would be resumed)."""
    jax_dir = os.path.join(workdir, "jax")
    shutil.rmtree(jax_dir, ignore_errors=True)
    summary = loop.train_and_evaluate(config, jax_dir, warm_up=True)
    curve = [{"seconds": r["seconds"], "test_accuracy": r["test_accuracy"]}
             for r in report.read_metrics(jax_dir) if "test_accuracy" in r]
    warmup_seconds = summary["compile_seconds"] + summary["phase_seconds"]["warmup"]
    return {"device": summary["device_kind"], "warmup_seconds": warmup_seconds,
            "train_seconds": summary["train_seconds"], "eval_seconds": summary["eval_seconds"],
            "images_per_second": summary["images_per_second"],
            "test_accuracy": summary["test_accuracy"], "test_loss": summary["test_loss"],
            "param_count": summary["param_count"], "steps": summary["steps"],
            "examples_seen": summary["steps"] * summary["batch_size"],
            "precision": config.train.precision, "version": f"jax {jax.__version__}",
            "curve": curve}


# ---------------------------------------------------------------- the comparison

TABLE = (("framework", "framework", 14, "s"), ("device", "device", 14, "s"),
         ("precision", "precision", 9, "s"),
         ("warmup_seconds", "warm-up s", 9, ".2f"), ("train_seconds", "train s", 9, ".2f"),
         ("images_per_second", "images/s", 9, ".0f"), ("test_accuracy", "test acc", 8, ".2%"),
         ("test_loss", "test loss", 9, ".4f"), ("param_count", "params", 10, ",d"))


def format_table(results: list[dict]) -> str:
    lines = [" ".join(f"{header:>{width}}" if i else f"{header:<{width}}"
                      for i, (_, header, width, _) in enumerate(TABLE))]
    for row in results:
        lines.append(" ".join(f"{row[key]:>{width}{spec}}" if i else f"{row[key]:<{width}}"
                              for i, (key, _, width, spec) in enumerate(TABLE)))
    return "\n".join(lines)


def plot(results: list[dict], path: str, title: str) -> str:
    """Test accuracy against training wall-clock seconds, one line per framework."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for row in results:
        ax.plot([p["seconds"] for p in row["curve"]],
                [p["test_accuracy"] for p in row["curve"]], "o-",
                label=f"{row['framework']} ({row['device']})")
    ax.set_xlabel("seconds (training and evaluation, compilation excluded)")
    ax.set_ylabel("test accuracy")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def run(config, frameworks=FRAMEWORKS, workdir: str = "runs/compare", *,
        torch_compile=None, torch_compile_mode: str = "default") -> dict:
    """Trains the config with each framework in turn; prints the table and writes
    compare.json and compare.png into workdir. Returns what compare.json holds."""
    frameworks = list(frameworks)
    unknown = [f for f in frameworks if f not in FRAMEWORKS]
    if unknown or not frameworks:
        raise CompareError(f"unknown framework(s) {', '.join(unknown) or '(none given)'}; "
                           f"choose from: {', '.join(FRAMEWORKS)}")
    if any(f != "jax" for f in frameworks):
        unsupported = torch_unsupported(config)
        if unsupported:
            raise CompareError("the PyTorch twins do not implement " + "; ".join(unsupported)
                               + ": run --frameworks=jax, or compare a recipe without them")
        torch = import_torch()  # fail before any training when torch is missing
        check_torch_device(jax.default_backend(), torch.cuda.is_available(), torch.__version__)
    setup = prepare.setup(config)  # checks the config, loads the data, builds the Flax model
    if setup.runs:
        raise CompareError("compare trains one run per framework: drop train.replicas and "
                           "sweep (main.py trains replicas)")
    if setup.placement == "stream" and any(f != "jax" for f in frameworks):
        raise CompareError(f"this run streams its data ({setup.placement_reason}); the PyTorch "
                           "twins train from arrays in memory: run --frameworks=jax")
    dataset, mean, std, total_steps = setup.dataset, setup.mean, setup.std, setup.total_steps
    # model.init_from: the twins start from jaxtrain's starting weights (the same head too)
    initial = ({"params": setup.state.params, "batch_stats": setup.state.batch_stats}
               if config.model.get("init_from") else None)
    param_count = models.count_params(setup.state.params)
    print(f"{config.model.name}: {param_count:,} parameters in jaxtrain; {total_steps} steps "
          f"of batch {config.train.batch_size} on {dataset.origin}", flush=True)

    os.makedirs(workdir, exist_ok=True)
    output = {"model": config.model.name, "param_count": param_count, "steps": total_steps,
              "batch_size": config.train.batch_size, "dataset": dataset.origin,
              "config": config.to_dict(),
              "timing": {framework: TIMING[framework] for framework in frameworks},
              "results": []}
    for framework in frameworks:
        print(f"--- {framework}", flush=True)
        if framework == "jax":
            result = run_jax(config, workdir)
        elif framework == "torch_article":
            result = run_torch_article(config, dataset, mean, std, total_steps,
                                       setup.stem_kernel, initial)
        else:
            result = run_torch_fast(config, dataset, mean, std, total_steps, torch_compile,
                                    setup.stem_kernel, torch_compile_mode, initial)
        print(f"{framework}: {result['param_count']:,} parameters", flush=True)
        if result["param_count"] != param_count:
            raise CompareError(f"{framework} trained {result['param_count']:,} parameters, "
                               f"jaxtrain's {config.model.name} has {param_count:,}")
        output["results"].append({"framework": framework, **result})
        report.write_json_atomically(os.path.join(workdir, JSON_FILE), output)

    print(format_table(output["results"]))
    plot(output["results"], os.path.join(workdir, PLOT_FILE),
         f"{config.model.name}, {total_steps} steps of batch {config.train.batch_size}")
    print(f"-> {os.path.join(workdir, JSON_FILE)}, {os.path.join(workdir, PLOT_FILE)}")
    return output


# ---------------------------------------------------------------- command line

def define_flags():
    from absl import flags
    from ml_collections import config_flags

    config_flags.DEFINE_config_file("config", None, "Path to a config file with get_config().",
                                    lock_config=True)
    flags.DEFINE_list("frameworks", list(FRAMEWORKS), "Comma-separated, run in this order: "
                      + ", ".join(FRAMEWORKS))
    flags.DEFINE_string("workdir", "runs/compare", "Where compare.json, compare.png and "
                        "jaxtrain's run (in jax/, started afresh) go.")
    flags.DEFINE_enum("torch_compile", "auto", ["auto", "on", "off"],
                      "torch_fast: torch.compile the model; auto = on CUDA only.")
    flags.DEFINE_enum("torch_compile_mode", "default", list(TORCH_COMPILE_MODES),
                      "torch_fast: torch.compile's mode (compare.json records it).")
    flags.mark_flag_as_required("config")
    flags.register_validator(
        "frameworks", lambda names: bool(names) and all(n in FRAMEWORKS for n in names),
        message="--frameworks must be a comma-separated list of: " + ", ".join(FRAMEWORKS))


def main(argv):
    from absl import app, flags, logging

    logging.set_verbosity(logging.WARNING)
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    FLAGS = flags.FLAGS
    torch_compile = {"auto": None, "on": True, "off": False}[FLAGS.torch_compile]
    try:
        run(FLAGS.config, FLAGS.frameworks, FLAGS.workdir, torch_compile=torch_compile,
            torch_compile_mode=FLAGS.torch_compile_mode)
    except (CompareError, data.DataError, ConfigError, TrainingError) as error:
        sys.exit(f"error: {error}")


if __name__ == "__main__":
    from absl import app

    from jaxtrain.cli import parse_flags

    define_flags()
    app.run(main, flags_parser=parse_flags)
