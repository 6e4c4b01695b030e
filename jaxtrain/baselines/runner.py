"""Train one config with jaxtrain and with PyTorch; compare time and accuracy.

    python -m jaxtrain.compare --config=configs/cifar_seed_cnn.py [--config.KEY=VALUE ...] \
        [--frameworks=jax,torch_article,torch_fast] [--workdir=runs/compare]

- jax: jaxtrain itself (loop.train_and_evaluate).
- torch_article: the seed article's PyTorch: a Dataset with per-sample transforms,
  a DataLoader with 2 workers, the plain loop with loss.item() every step.
- torch_fast: the best PyTorch we can write for the same recipe, with every speed
  measure of the published speedruns (airbench94_muon) that leaves the recipe as it
  is: the data on the device as uint8, each epoch's batches gathered, flipped and
  translated there in one go and sliced per step; channels_last; on CUDA with
  train.precision='bfloat16' the weights in bfloat16 (BatchNorm in float32, the
  optimiser stepping float32 master weights) and Muon's Newton-Schulz in bfloat16,
  batched over same-shape matrices and compiled; fused SGD/Adam(W); torch.compile
  (mode max-autotune with CUDA graphs on CUDA, static shapes) within a time cap,
  falling back to mode 'default' (then to no compilation); the TTA views of a test
  batch in one forward; the whitened stem computed in torch inside the clock.
  compare.json's "measures" records what each did (fallbacks and their reasons).

Timing is the same for jax and torch_fast: compilation and an untimed execution
of what will be timed (jax: every compiled chunk and the evaluation, on a copy of
the state; torch_fast: training steps and the evaluation, with the weights,
BatchNorm statistics and optimiser state put back after) are excluded, so neither
side's first-run costs (lazy kernel loading, autotuning, CUDA graph recording) are
counted. compare.json's "timing" says so.

All three train the same architecture (parameter counts checked), with the same
initialisation scheme, optimiser (jaxtrain/baselines/torch_optim.py: parameter groups and
Muon included), schedule, batch size, number of examples, augmentation, label
smoothing and evaluation, so the table compares frameworks.
torch_article always trains in float32, as the article does. Writes
compare.json and compare.png (test accuracy against seconds) into the workdir.
torch is imported only when a torch framework runs."""
import contextlib
import functools
import os
import shutil
import signal
import threading
import time
import warnings

import jax
import numpy as np

from jaxtrain import models
from jaxtrain.config import checks
from jaxtrain.models import user, whitening
from jaxtrain.run import loop, plan
from jaxtrain.runtime import report, xla_flags
from jaxtrain.training import augment as augment_lib
from jaxtrain.training import inputs as inputs_lib
from jaxtrain.training import prepare

FRAMEWORKS = ("jax", "torch_article", "torch_fast")
TORCH_COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
DEFAULT_COMPILE_MODE = "max-autotune"  # the published speedruns'; CUDA graphs included
DEFAULT_COMPILE_CAP = 90.0  # seconds torch_fast's torch.compile may take before it falls back
WHITENING_TOLERANCE = 0.02  # torch_fast's stem against jaxtrain's, of its largest entry
TIMING = {
    "jax": "train_seconds excludes compilation and one untimed execution of every compiled "
           "program (each chunk length, the evaluation) on a copy of the state; a whitened "
           "stem's filters are computed before the clock (prepare.setup)",
    "torch_fast": "train_seconds includes computing a whitened stem's filters; it excludes "
                  "building the model, torch.compile and an untimed warm-up (two training "
                  "steps and an evaluation; twice over with CUDA graphs, which record on "
                  "their second run), after which the weights, BatchNorm statistics and "
                  "optimiser state are put back",
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


def torch_unsupported(config) -> list[str]:
    """Config settings the PyTorch twins do not reproduce (config keys, with values)."""
    found = []
    if user.is_user_model(config.model.name):
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


def torch_recipe(config, dataset, device, total_steps: int, stem_kernel=None, initial=None,
                 **optimizer_kwargs):
    """The twin model (seeded by config.seed), its optimisers (torch_optim, with the
    learning rates of total_steps steps; optimizer_kwargs: torch_fast's implementations)
    and the loss. A whitened stem is frozen; `stem_kernel` (prepare.setup's) fixes its
    weights (torch_fast computes its own). `initial` ({'params', 'batch_stats'}:
    jaxtrain's starting variables, model.init_from's weights with its fresh head) are
    the twin's starting weights too, so both sides fine-tune the same network."""
    import torch

    from jaxtrain.baselines import torch_models, torch_optim

    torch.manual_seed(config.seed)
    model = torch_models.create_model(config.model, dataset.num_classes, dataset.image_shape)
    if initial is not None:
        torch_models.load_flax_variables(model, jax.device_get(initial), dataset.image_shape)
    if config.model.get("freeze_batch_stats", False):
        torch_models.freeze_batch_norm(model)
    if whitening.has_whitened_stem(config.model):  # a fixed whitening stem, never trained
        stem = model[0]
        if stem_kernel is not None:  # jaxtrain's (prepare.setup's; HWIO -> OIHW)
            with torch.no_grad():
                stem.weight.copy_(torch.from_numpy(np.array(stem_kernel).transpose(3, 2, 0, 1)))
        stem.weight.requires_grad_(False)
    model = model.to(device)
    optimizer = torch_optim.create_torch_optimizer(config.optimizer, model, total_steps,
                                                   **optimizer_kwargs)
    criterion = torch.nn.CrossEntropyLoss(label_smoothing=config.train.label_smoothing)
    return model, optimizer, criterion


def torch_step(model, optimizer, criterion, inputs, labels, step: int,
               autocast=contextlib.nullcontext()):
    """Training step `step` (from 0): its learning rates, forward, loss, backward, update."""
    from jaxtrain.baselines import torch_optim

    torch_optim.set_step(optimizer, step)
    optimizer.zero_grad()
    with autocast:
        loss = criterion(model(inputs), labels)
    loss.backward()
    optimizer.step()
    return loss


def tta_logits(model, images, mode: str, *, mean, std, pad_mode: str, one_batch=False,
               dtype=None):
    """The float32 logits of `mode`'s TTA views (torch_models.tta_views) of NCHW images,
    weighted and summed. one_batch: every view in one forward (torch_fast; the same
    logits, as BatchNorm is in eval mode), else a forward per view; dtype: the model's
    input dtype (default float32)."""
    import torch

    from jaxtrain.baselines import torch_models

    dtype = dtype or torch.float32
    views, weights = torch_models.tta_views(images, mode, pad_mode)
    if one_batch and len(views) > 1:
        inputs = torch_models.normalize(torch.cat(views), mean, std).to(dtype)
        outputs = model(inputs.contiguous(memory_format=torch.channels_last))
        return sum(w * v.float() for v, w in zip(outputs.split(len(images)), weights))
    return sum(w * model(torch_models.normalize(v, mean, std).to(dtype)).float()
               for v, w in zip(views, weights))


def torch_evaluate(model, batches, *, mean, std, tta, pad_mode, device,
                   autocast=contextlib.nullcontext(), tta_images=None, tta_in_one_batch=False,
                   dtype=None):
    """Test loss and accuracy with BatchNorm in eval mode and the config's TTA; batches
    yield (images in [0, 1] or uint8, NCHW, labels). tta_images (inputs_lib.tta_image_count):
    None = TTA on every image, k = only on the k least confident (evaluation.eval_logits).
    tta_in_one_batch, dtype: tta_logits' one_batch and dtype."""
    import torch

    def logits_of(images, mode):
        return tta_logits(model, images.to(device), mode, mean=mean, std=std,
                          pad_mode=pad_mode, one_batch=tta_in_one_batch, dtype=dtype)

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
    """eval.tta_fraction as torch_evaluate's tta_images (inputs_lib.tta_image_count)."""
    return inputs_lib.tta_image_count(config.eval.tta_fraction, len(dataset.x_test))


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
        if not plan.evaluates_after(step, self.steps_per_epoch, self.total_steps,
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

    from jaxtrain.baselines import torch_models

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


class CompileCapExceeded(BaseException):
    """torch.compile ran past its cap. A BaseException, so torch's own `except Exception`
    handlers let it through to first_that_compiles."""


@contextlib.contextmanager
def time_cap(seconds):
    """Raises CompileCapExceeded in the main thread once `seconds` have passed (SIGALRM);
    yields whether the cap is enforced (not from another thread, nor for None)."""
    if (seconds is None or not hasattr(signal, "setitimer")
            or threading.current_thread() is not threading.main_thread()):
        yield False
        return

    def on_alarm(signum, frame):
        raise CompileCapExceeded(f"past its {seconds:g} s cap")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield True
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def compile_modes(requested: str, device_type: str) -> tuple[list, list[dict]]:
    """The torch.compile modes torch_fast tries in turn (None: no compilation), and the
    fallbacks decided up front: the modes beyond 'default' (CUDA graphs, autotuned
    Triton kernels) are for CUDA, so a CPU run takes 'default' (it may be slow or
    unsupported there)."""
    if requested not in TORCH_COMPILE_MODES:
        raise CompareError(f"unknown torch.compile mode {requested!r}; choose one of: "
                           + ", ".join(TORCH_COMPILE_MODES))
    fallbacks = []
    if device_type != "cuda" and requested != "default":
        fallbacks.append({"mode": requested, "reason": f"not tried on {device_type}: its CUDA "
                          "graphs and autotuned kernels are for CUDA", "seconds": 0.0})
        requested = "default"
    return [requested] + (["default"] if requested != "default" else []) + [None], fallbacks


def first_that_compiles(modes, attempt, cap_seconds, undo):
    """attempt(mode) for each mode in turn until one returns; a compiled mode (not None)
    that raises, or runs past cap_seconds (every mode but 'default', the fallback,
    which may take what it takes), is recorded as a fallback with its reason, then
    undo() puts the run back. Returns (mode, attempt's result, fallbacks, whether a cap
    was enforced, seconds of the attempt that worked)."""
    fallbacks, enforced = [], False
    for mode in modes:
        start = time.perf_counter()
        capped = mode not in (None, "default")
        try:
            with time_cap(cap_seconds if capped else None) as enforced_now:
                enforced = enforced or enforced_now
                result = attempt(mode)
            return mode, result, fallbacks, enforced, time.perf_counter() - start
        except CompileCapExceeded:
            reason = f"did not compile and warm up within its {cap_seconds:g} s cap"
        except Exception as error:  # noqa: BLE001  any failure to compile falls back
            if mode is None:
                raise
            reason = f"{type(error).__name__}: " + (str(error).strip().splitlines() or [""])[0]
        fallbacks.append({"mode": mode, "reason": reason[:300],
                          "seconds": round(time.perf_counter() - start, 2)})
        undo()
    raise CompareError("no torch.compile mode to try")  # modes ends with None: unreachable


def bfloat16_weights(choice, device_type: str, precision: str, model) -> tuple[bool, str]:
    """Whether torch_fast runs its weights in bfloat16 (choice: None = auto, True, False):
    auto = on CUDA with train.precision='bfloat16', for models whose only normalisation
    is BatchNorm (kept in float32); the reason, for compare.json."""
    import torch

    others = [type(m).__name__ for m in model.modules()
              if isinstance(m, (torch.nn.LayerNorm, torch.nn.GroupNorm))]
    if choice is False:
        return False, "off (--torch_bfloat16=off)"
    if choice is True:
        if precision != "bfloat16":
            raise CompareError("--torch_bfloat16=on needs config.train.precision='bfloat16' "
                               f"(it is {precision!r})")
        if others:
            raise CompareError(f"--torch_bfloat16=on: this model has {others[0]}, which would "
                               "run in bfloat16; only BatchNorm models keep theirs in float32")
        return True, "on (--torch_bfloat16=on)"
    if precision != "bfloat16":
        return False, f"auto: train.precision={precision!r}"
    if device_type != "cuda":
        return False, f"auto: on CUDA only (this run is on {device_type}; autocast instead)"
    if others:
        return False, f"auto: the model has {others[0]} (autocast instead)"
    return True, "auto: CUDA and train.precision='bfloat16'"


def augmented_epoch(images, labels, order, draws: dict, *, mean, std, pad_mode: str,
                    cutout: int = 0, dtype=None):
    """One epoch's (or its first steps') training inputs in one go: the images (uint8
    NCHW) and labels of `order` gathered, augmented with the epoch's draws
    (torch_models.draw_augmentation, one per image of order), normalised to `dtype`
    (default float32), channels_last. Slice it per step: the images are a per-batch
    augmentation's (tests/test_compare.py)."""
    import torch

    from jaxtrain.baselines import torch_models

    x = torch_models.apply_augmentation(images[order], draws, pad_mode=pad_mode, cutout=cutout)
    x = torch_models.normalize(x, mean, std).to(dtype or torch.float32)
    return x.contiguous(memory_format=torch.channels_last), labels[order]


def fast_step(loss_of, optimizer, inputs, labels, step: int,
              autocast=contextlib.nullcontext(), mark_step=None):
    """torch_step for torch_fast: the loss module (model and criterion, compiled
    together), and a new CUDA graph step marked first where CUDA graphs run."""
    from jaxtrain.baselines import torch_optim

    torch_optim.set_step(optimizer, step)
    optimizer.zero_grad()
    if mark_step is not None:
        mark_step()
    with autocast:
        loss = loss_of(inputs, labels)
    loss.backward()
    optimizer.step()
    return loss


def run_torch_fast(config, dataset, mean, std, total_steps: int,
                   torch_compile=None, stem_kernel=None,
                   compile_mode: str = DEFAULT_COMPILE_MODE, initial=None, *,
                   compile_cap: float = DEFAULT_COMPILE_CAP, bfloat16=None) -> dict:
    """The same recipe as fast as we can write it (the module docstring lists the
    measures). torch_compile: None = on CUDA only (compiling on a CPU costs more than
    it saves for these runs); compile_mode is tried first within compile_cap seconds,
    then 'default' (uncapped), then no compilation. bfloat16: None = auto (bfloat16_weights).
    `stem_kernel`: jaxtrain's whitened stem, which the stem torch computes inside its
    clock is checked against. compare.json's "measures" says what each measure did."""
    import torch

    from jaxtrain.baselines import torch_models, torch_optim

    start = time.perf_counter()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch_compile = device.type == "cuda" if torch_compile is None else torch_compile
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    precision = checks.resolve_precision(config.train.precision)
    # Newton-Schulz in bfloat16 where the weights would be (the model aside)
    ns_bfloat16 = bfloat16 if bfloat16 is not None else (device.type == "cuda"
                                                         and precision == "bfloat16")
    model, optimizer, criterion = torch_recipe(
        config, dataset, device, total_steps, initial=initial, fast=True,
        ns_dtype=torch.bfloat16 if ns_bfloat16 else torch.float32)
    low, weights_reason = bfloat16_weights(bfloat16, device.type, precision, model)
    model = model.to(memory_format=torch.channels_last)
    compute = torch_models.low_precision_copy(model) if low else model
    if low:  # the optimiser steps the float32 weights; the passes run the bfloat16 copy
        optimizer = torch_optim.MasterWeights(optimizer, [
            (master, copy) for master, copy in zip(model.parameters(), compute.parameters())
            if master is not copy and master.requires_grad])
    input_dtype = torch.bfloat16 if low else torch.float32
    autocasts = precision == "bfloat16" and not low
    autocast = torch.autocast(device.type, torch.bfloat16, enabled=autocasts)
    whitened = whitening.has_whitened_stem(config.model)
    stems = [m[0] for m in {id(model): model, id(compute): compute}.values()] if whitened else []
    flips = first_epoch_flips(config, len(dataset.x_train))
    flips = None if flips is None else flips.to(device)
    x_train = torch.from_numpy(dataset.x_train).to(device)  # uint8 NHWC
    images = x_train.permute(0, 3, 1, 2)  # NCHW view, channels_last memory
    y_train = torch.from_numpy(dataset.y_train).long().to(device)
    x_test = torch.from_numpy(dataset.x_test).to(device)
    y_test = torch.from_numpy(dataset.y_test).long().to(device)
    augment = augment_lib.device_kwargs(config.augment)
    batch_size, eval_batch = config.train.batch_size, config.eval.batch_size
    steps_per_epoch = len(x_train) // batch_size
    height, width = dataset.image_shape[:2]

    def epoch_inputs(epoch: int, steps: int):
        """The first `steps` batches of epoch `epoch`, augmented in one go."""
        order = torch.randperm(len(x_train), device=device)[:steps * batch_size]
        mirror = None if flips is None else flips[order] ^ (epoch % 2 == 1)
        draws = torch_models.draw_augmentation(len(order), height, width, device,
                                               mirror=mirror, **augment)
        return augmented_epoch(images, y_train, order, draws, mean=mean, std=std,
                               pad_mode=augment.get("pad_mode", "reflect"),
                               cutout=augment.get("cutout", 0), dtype=input_dtype)

    @torch.no_grad()
    def whiten():
        """The fixed stem's filters, from the first training images (as jaxtrain's)."""
        kernel = torch_models.whitening_kernel(x_train, mean, std, config.model.stem_width,
                                               max_images=whitening.WHITENING_IMAGES)
        for stem in stems:
            stem.weight.copy_(kernel)
        return kernel

    def test_batches():
        for i in range(0, len(x_test), eval_batch):
            yield x_test[i:i + eval_batch].permute(0, 3, 1, 2), y_test[i:i + eval_batch]

    loss_module = torch_models.TrainingLoss(compute, criterion)
    run = {}  # this attempt's loss module, evaluation forward and CUDA graph step mark

    def evaluate():
        return torch_evaluate(run["forward"], test_batches(), mean=mean, std=std,
                              tta=config.eval.tta, pad_mode=config.augment.pad_mode,
                              device=device, autocast=autocast,
                              tta_images=tta_images(config, dataset), tta_in_one_batch=True,
                              dtype=input_dtype)

    tensors = {id(t): t for m in (model, compute) for t in [*m.parameters(), *m.buffers()]}
    saved = {key: t.detach().clone() for key, t in tensors.items()}

    @torch.no_grad()
    def undo():
        """Back to the starting weights, statistics and optimiser state."""
        for key, t in tensors.items():
            t.copy_(saved[key])
        optimizer.zero_grad(set_to_none=True)
        optimizer.reset_state()
        compute.train()

    muons = [tx for tx in getattr(optimizer, "optimizer", optimizer).optimizers
             if isinstance(tx, torch_optim.Muon)]

    def attempt(mode):
        """Compiles with `mode` (None: not at all) and warms up: every program the run
        will use runs (twice with CUDA graphs: they record on the second), then undo().
        Returns whether the mode runs CUDA graphs, and how many compiled graphs inductor
        left without one (its log says why)."""
        from torch._dynamo.utils import counters

        torch._dynamo.reset()
        skips = counters["inductor"]["cudagraph_skips"]
        graphs = False
        if mode is None:
            run.update(loss=loss_module, forward=compute, mark=None)
        else:
            from torch import _inductor

            graphs = (device.type == "cuda"
                      and _inductor.list_mode_options(mode).get("triton.cudagraphs", False))
            mark = torch.compiler.cudagraph_mark_step_begin if graphs else None
            forward = torch.compile(compute, mode=mode, dynamic=False)
            run.update(loss=torch.compile(loss_module, mode=mode, dynamic=False),
                       forward=torch_models.MarkedForward(forward, mark) if mark else forward,
                       mark=mark)
        for tx in muons:
            tx.compile_newton_schulz(mode is not None)
        steps = min(2, steps_per_epoch, total_steps)
        for _ in range(2 if graphs else 1):
            if whitened:
                whiten()
            inputs, labels = epoch_inputs(0, steps)
            for step in range(steps):
                fast_step(run["loss"], optimizer, inputs[step * batch_size:][:batch_size],
                          labels[step * batch_size:][:batch_size], step, autocast, run["mark"])
            evaluate()
        synchronize(device)
        undo()
        return graphs, counters["inductor"]["cudagraph_skips"] - skips

    modes, fallbacks = (compile_modes(compile_mode, device.type) if torch_compile
                        else ([None], []))
    mode, (cuda_graphs, graphs_skipped), tried, cap_enforced, compile_seconds = \
        first_that_compiles(modes, attempt, compile_cap, undo)
    fallbacks += tried
    synchronize(device)
    warmup_seconds = time.perf_counter() - start

    progress = Progress("torch_fast", config, steps_per_epoch, total_steps, device, evaluate)
    kernel = whiten() if whitened else None  # inside the clock, as the speedruns count it
    step = 0
    loss_sum, loss_steps = torch.zeros((), device=device), 0
    while step < total_steps:
        steps = min(steps_per_epoch, total_steps - step)
        inputs, labels = epoch_inputs(step // steps_per_epoch, steps)
        for i in range(steps):
            loss = fast_step(run["loss"], optimizer, inputs[i * batch_size:(i + 1) * batch_size],
                             labels[i * batch_size:(i + 1) * batch_size], step, autocast,
                             run["mark"])
            loss_sum += loss.detach().float()
            loss_steps += 1
            step += 1
            if progress.after_step(step, lambda: float(loss_sum) / loss_steps):
                loss_sum, loss_steps = torch.zeros((), device=device), 0
    result = progress.result(warmup_seconds, torch_models.count_params(model), precision)
    result["torch_compile"] = {"mode": mode, "dynamic": False} if mode else None
    result["measures"] = {
        "compile": {"requested": compile_mode if torch_compile else None, "mode": mode,
                    "cuda_graphs": bool(cuda_graphs),
                    "graphs_without_cuda_graph": graphs_skipped if cuda_graphs else None,
                    "cap_seconds": compile_cap,
                    "cap_enforced": cap_enforced, "fallbacks": fallbacks,
                    "compile_and_warmup_seconds": round(compile_seconds, 2),
                    "newton_schulz_compiled": bool(muons) and mode is not None},
        "weights": {"dtype": "bfloat16" if low else "float32", "why": weights_reason,
                    "batch_norm": "float32",
                    "optimizer_steps": "float32 master weights" if low else "the weights",
                    "autocast": "bfloat16" if autocasts else None,
                    "memory_format": "channels_last"},
        "optimizers": optimizer.describe(),
        "augmentation": "per epoch on the device: gathered, flipped and translated in one go, "
                        "sliced per step",
        "tta": "the views of a test batch in one forward" if config.eval.tta != "none"
               else "none",
        "whitening": whitening_check(kernel, stem_kernel) if whitened else None}
    return result


def whitening_check(kernel, reference) -> dict:
    """torch_fast's stem (OIHW, computed in its clock) against jaxtrain's (HWIO), as the
    largest difference over the largest entry; a warning if past WHITENING_TOLERANCE."""
    record = {"computed": "in torch, inside the clock"}
    if reference is None:
        return record
    expected = np.asarray(reference, np.float32).transpose(3, 2, 0, 1)
    difference = float(np.abs(kernel.float().cpu().numpy() - expected).max()
                       / max(float(np.abs(expected).max()), 1e-12))
    record.update(difference_from_jaxtrain=difference,
                  matches_jaxtrain=difference <= WHITENING_TOLERANCE)
    if difference > WHITENING_TOLERANCE:
        print(f"warning: torch_fast's whitened stem differs from jaxtrain's by {difference:.2%} "
              f"of its largest entry (tolerance {WHITENING_TOLERANCE:.0%})", flush=True)
    return record


def run_jax(config, workdir: str) -> dict:
    """jaxtrain itself, in a fresh workdir/jax (an old one would be resumed)."""
    jax_dir = os.path.join(workdir, "jax")
    shutil.rmtree(jax_dir, ignore_errors=True)
    summary = loop.run_checked(config, jax_dir, warm_up=True)  # run() checked it
    curve = [{"seconds": r["seconds"], "test_accuracy": r["test_accuracy"]}
             for r in report.read_metrics(jax_dir) if "test_accuracy" in r]
    warmup_seconds = summary["compile_seconds"] + summary["phase_seconds"]["warmup"]
    return {"device": summary["device_kind"], "warmup_seconds": warmup_seconds,
            "train_seconds": summary["train_seconds"], "eval_seconds": summary["eval_seconds"],
            "images_per_second": summary["images_per_second"],
            "test_accuracy": summary["test_accuracy"], "test_loss": summary["test_loss"],
            "param_count": summary["param_count"], "steps": summary["steps"],
            "examples_seen": summary["steps"] * summary["batch_size"],
            "precision": checks.resolve_precision(config.train.precision),
            "version": f"jax {jax.__version__}",
            "curve": curve}


def start_of(framework: str, config, initial, result: dict) -> str:
    """How a framework's network started, against jaxtrain's, for the table: the same
    weights (model.init_from's, copied), or its own draw of the same initialisation;
    with a whitened stem, whether the stem is jaxtrain's (torch_fast computes its own
    and says when it differs: the twin then trains a different network)."""
    if framework == "jax":
        return "-"
    start = "same weights" if initial is not None else "own draw"
    if whitening.has_whitened_stem(config.model):
        check = (result.get("measures") or {}).get("whitening") or {}
        start += ", stem DIFFERS" if check.get("matches_jaxtrain") is False else ", same stem"
    return start


TABLE = (("framework", "framework", 14, "s"), ("device", "device", 14, "s"),
         ("precision", "precision", 9, "s"), ("start", "start", 23, "s"),
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
        torch_compile=None, torch_compile_mode: str = DEFAULT_COMPILE_MODE,
        torch_compile_cap: float = DEFAULT_COMPILE_CAP, torch_bfloat16=None) -> dict:
    """Trains the config with each framework in turn; prints the table and writes
    compare.json and compare.png into workdir. Returns what compare.json holds.
    torch_*: torch_fast's compilation and bfloat16 weights (run_torch_fast)."""
    frameworks = list(frameworks)
    unknown = [f for f in frameworks if f not in FRAMEWORKS]
    if unknown or not frameworks:
        raise CompareError(f"unknown framework(s) {', '.join(unknown) or '(none given)'}; "
                           f"choose from: {', '.join(FRAMEWORKS)}")
    checks.check_config(config)
    if any(f != "jax" for f in frameworks):
        unsupported = torch_unsupported(config)
        if unsupported:
            raise CompareError("the PyTorch twins do not implement " + "; ".join(unsupported)
                               + ": run --frameworks=jax, or compare a recipe without them")
        torch = import_torch()  # fail before any training when torch is missing
        check_torch_device(jax.default_backend(), torch.cuda.is_available(), torch.__version__)
    setup = prepare.setup(config)  # loads the data, builds the Flax model
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
              "xla_flags": xla_flags.in_effect(),
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
                                    setup.stem_kernel, torch_compile_mode, initial,
                                    compile_cap=torch_compile_cap, bfloat16=torch_bfloat16)
        print(f"{framework}: {result['param_count']:,} parameters", flush=True)
        if result["param_count"] != param_count:
            raise CompareError(f"{framework} trained {result['param_count']:,} parameters, "
                               f"jaxtrain's {config.model.name} has {param_count:,}")
        result["start"] = start_of(framework, config, initial, result)
        output["results"].append({"framework": framework, **result})
        report.write_json_atomically(os.path.join(workdir, JSON_FILE), output)

    print(format_table(output["results"]))
    plot(output["results"], os.path.join(workdir, PLOT_FILE),
         f"{config.model.name}, {total_steps} steps of batch {config.train.batch_size}")
    print(f"-> {os.path.join(workdir, JSON_FILE)}, {os.path.join(workdir, PLOT_FILE)}")
    return output
