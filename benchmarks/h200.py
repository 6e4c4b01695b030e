"""Every GPU figure jaxtrain reports, from one prepared run on one H200.

GPU time comes in short loans (about 15 minutes, machine start included), so
everything is measured by this one script, most important first, within a
time budget (default 560 s of a 600 s device command). Each item is one of
jaxtrain's own commands run as a child process, so a figure here is what a
user gets from that command. Every setup step and item has a cap of its own
(PLAN below; `--plan` prints it): one that reaches its cap is stopped with its
process group and the next one starts, so a slow or hung item costs only its
own cap. The caps add up to the budget, so every item gets its chance; what an
item leaves unused goes to the extras at the end.

$OUT/h200.json is written before anything else (the environment), after every
setup step and after every item: each entry has its command, cap, status,
seconds, the JSON the command wrote (a benchmark writes its JSON after compiling
and after every run, compare after every framework, so a cut-off item still
reports what it finished) and any XLA warning about compilation. $OUT/logs.tar.gz
holds every output; profiler traces come back as $OUT/profile_<item>.tar.gz (the
device returns at most 8 files from $OUT, hence the archives). A failing setup
step (the wheels, the data, the preflight) is recorded there and ends the run.

Prepare, once, in the repository root of the development machine (the device
has no network; .gitignore lists both folders, and they travel with `carry`):

    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \\
        --implementation cp --platform manylinux2014_x86_64 -d .whl \\
        ml_collections==1.1.0 tensorboardX==2.6.4
    mkdir -p .data && cp ../shared/data/cifar10_jpeg.npz ../shared/data/cifar10_jpeg.py .data/

Run on the device (device tool: carry [".whl", ".data"], timeout_s=600):

    python3 benchmarks/h200.py --out=$OUT

Setup: the wheels in .whl (the image has jax, flax, optax, orbax and torch, not
ml_collections or tensorboardX) go into a private folder; the CIFAR-10 JPEG copy
in .data is decoded into the cifar-10-batches-py layout, and a part of it is
upscaled to 224 px for the ResNet-50 item; the preflight imports every module
the items use, records the versions (jax, jaxlib, the CUDA plugin, CUDA and
cuDNN as the device client reports them, torch and its CUDA and cuDNN), builds
the speedrun's optimiser and compiles a small program, so an API change in the
image's jax / optax / flax fails in seconds with one line, not in every item.

The same script on a CPU with tiny sizes, a few steps of every item (CI runs
some items: tests/test_h200.py; run them all before a loan):

    python3 benchmarks/h200.py --dry --data_dir=DIR --out=/tmp/h200
"""
import argparse
import collections
import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = "h200.json"
SPEEDRUN = "configs/cifar_speedrun.py"
MAX_FILE_BYTES = 15 * 2**20  # the device returns files of up to 16 MiB
BUDGET = 560.0  # of the device command's 600 s: the rest is for the archives and slack
DRY_CAP_SCALE = 10.0  # --dry on a CPU: every cap and the budget times this
# XLA's warning when the ptxas it finds is newer than the driver: compiles get slower.
XLA_WARNINGS = re.compile(r"disabling parallel compilation|ptxas .*(newer|version)", re.I)

Step = collections.namedtuple("Step", "name cap expected yields why")

# The budget on paper: (name, cap s, expected s, what it yields, why it is here).
# Expected times are the first H200 loan's (2026-12-04, benchmarks/results/h200.json
# and h200_rerun.json), rounded up; compare_seed's PyTorch side and the exact largest
# batches were not reached then, so theirs are estimates. That loan also settled the
# epoch count (8 is the fewest whose mean reaches 90.70%): those items are gone.
PLAN = (
    Step("wheels", 8, 4, "ml_collections and tensorboardX importable",
         "every item needs them"),
    Step("data", 20, 12, "cifar-10-batches-py, and 2,560 + 512 images at 224 px",
         "every item needs the data"),
    Step("preflight", 20, 15, "the versions; every module imported, the speedrun's optimiser "
         "built, a program compiled", "an API change fails here in seconds, not in every item"),
    Step("speedrun", 62, 52, "10 seeds of the speedrun: accuracy mean/std, seconds per run, "
         "compile seconds", "the figure the project is judged by"),
    Step("speedrun_pool_corners", 55, 47, "5 seeds of the speedrun with model.pool_impl="
         "'corners' (the same numbers to the bit): seconds per run against the speedrun "
         "item's", "the first loan's trace: the max-pool gradient's scatter and windowed "
         "reductions were 1.5 ms of the step's 6.63"),
    Step("compare_speedrun", 90, 79, "the speedrun recipe in jaxtrain and in PyTorch "
         "(torch.compile) side by side", "the bar is beating PyTorch on the same recipe"),
    Step("inspect_speedrun", 42, 36, "the speedrun's step: kernels by kind, FLOPs, TFLOP/s, "
         "fraction of peak, top ops, a trace", "where the speedrun's time goes"),
    Step("inspect_speedrun_corners", 45, 38, "the speedrun's step with model.pool_impl="
         "'corners': step time, top ops, a trace", "whether the scatter left the trace"),
    Step("compare_seed", 108, 85, "the seed recipe in jaxtrain (one run: its images/s) and "
         "the fastest PyTorch", "the first loan's 55 s cap cut PyTorch's side off (jaxtrain: "
         "2.99 s; the article's PyTorch as written: 82.6 s)"),
    Step("resnet50_largest_batch", 110, 95, "the largest ResNet-50 batch at 224 px whose "
         "train step fits the H200, plain, with model.remat and with accumulate_steps=4 "
         "(compiled memory analyses, nothing trained)", "issue #30; the first loan's 40 s "
         "showed only that 1,024 fits (42.1 GB plain, 14.9 GB with remat)"),
)
# If time is left, each with at most its cap of what is left: figures the first loan
# measured already (finetune_resnet50_224, speedrun_whole_process, cifar_train,
# seed_64_replicas), and ResNet-50 from scratch, which it did not reach.
EXTRAS = (
    Step("finetune_resnet50_224", 100, 91, "configs/finetune.py: ResNet-50 at 224 px from "
         "random-init torchvision weights (model.init_from), 40 steps of batch 256, jaxtrain "
         "and PyTorch (channels_last, bf16 autocast, torch.compile) from the same weights: "
         "images/s each", "the ImageNet-class throughput frameworks are compared by, on the "
         "path people fine-tune with"),
    Step("speedrun_whole_process", 55, 49, "one speedrun as a user starts it: whole process "
         "cold, then with a warm cache", "what a user waits for, compilation included"),
    Step("cifar_train", 40, 32, "configs/cifar.py trained in full: test accuracy, train and "
         "compile seconds", "the main command of the README"),
    Step("resnet50_224", 100, 91, "ResNet-50 at 224 px from scratch (the ImageNet recipe), 40 "
         "steps of batch 256, jaxtrain and PyTorch: images/s each", "the fine-tuning item's "
         "throughput without init_from"),
    Step("seed_64_replicas", 95, 86, "64 seeds of the seed recipe in one program: images/s "
         "per replica, the spread of accuracy", "issue #18's target is for a GPU"),
)
SETUP = ("wheels", "data", "preflight")

# Tiny sizes for --dry: every item's code path, a few steps each.
DRY_SPEEDRUN = ("--config.model.widths=(8,16,16)", "--config.model.stem_width=12",
                "--config.train.batch_size=200", "--config.train.num_steps=4",
                "--config.eval.batch_size=250")
DRY_CIFAR = ("--config.model.widths=(8,16,16)", "--config.model.stem_width=8",
             "--config.train.batch_size=100", "--config.train.num_steps=4",
             "--config.eval.batch_size=250")
DRY_SEED = ("--config.train.num_steps=20", "--config.train.log_every_steps=10",
            "--config.eval.batch_size=250")
# ResNet-50's throughput: CIFAR-10 images upscaled 7x (224 px) held on the device.
RESNET_IMAGES = {False: (2560, 512, 7), True: (64, 32, 2)}  # (train, test, factor) by dry
DRY_RESNET = ("--config.model.name=resnet18", "--config.train.batch_size=8",
              "--config.train.num_steps=2", "--config.eval.batch_size=16")
DRY_LARGEST = ("--model=resnet18", "--image_size=32", "--limit_gib=0.25", "--start=16",
               "--max_probes=3")
START_WEIGHTS = "resnet50_random.pth"  # the fine-tuning item's torchvision weights (random)


def items(data_dir: str, arrays: str, work: str, dry: bool, runs: int | None = None,
          start_weights: str = START_WEIGHTS) -> list:
    """(Step, command, JSON file the command writes) in the order run: PLAN's, then
    EXTRAS'."""
    python = [sys.executable]
    data = f"--config.data.dir={data_dir}"
    speedrun = [f"--config={SPEEDRUN}", data, *(DRY_SPEEDRUN if dry else ())]
    cifar = ["--config=configs/cifar.py", data, *(DRY_CIFAR if dry else ())]
    seed = ["--config=configs/cifar_seed_cnn.py", data, *(DRY_SEED if dry else ())]
    runs = runs if runs is not None else (2 if dry else 10)
    warmup = "--warmup=0" if dry else "--warmup=1"
    timed = [f"--runs={runs}", warmup]
    steps = "--steps=2" if dry else "--steps=20"
    # On a CPU torch.compile is off by default: the dry run switches it on, so the
    # path a GPU takes is compiled here too.
    torch_compile = ["--torch_compile=on"] if dry else []
    resnet = ["--config=configs/imagenet_resnet50.py", "--config.data.name=arrays",
              f"--config.data.dir={arrays}", "--config.data.placement=device",
              "--config.augment.crop=none", "--config.augment.flip=True",
              "--config.train.batch_size=256", "--config.optimizer.learning_rate=0.1",
              "--config.train.num_steps=40", "--config.train.log_every_steps=10",
              "--config.checkpoint.every_steps=0", "--config.eval.every_epochs=0",
              "--config.eval.batch_size=256", *(DRY_RESNET if dry else ())]

    finetune = ["--config=configs/finetune.py", "--config.data.name=arrays",
                f"--config.data.dir={arrays}", "--config.data.placement=device",
                f"--config.model.init_from={start_weights}",
                "--config.train.batch_size=256", "--config.train.num_steps=40",
                "--config.train.log_every_steps=10", "--config.checkpoint.every_epochs=0",
                "--config.eval.every_epochs=0", "--config.eval.batch_size=256",
                *(DRY_RESNET if dry else ())]

    def path(name):
        return os.path.join(work, name)

    commands = {
        "speedrun": (python + ["-m", "jaxtrain.bench", *speedrun, *timed,
                               f"--json={path('speedrun.json')}"], path("speedrun.json")),
        "compare_speedrun": (python + ["-m", "jaxtrain.compare", *speedrun,
                                       "--frameworks=jax,torch_fast", *torch_compile,
                                       f"--workdir={path('compare_speedrun')}"],
                             path("compare_speedrun/compare.json")),
        "inspect_speedrun": (python + ["-m", "jaxtrain.bench", *speedrun, "--inspect", steps,
                                       f"--profile={path('profile/speedrun')}",
                                       f"--json={path('inspect_speedrun.json')}"],
                             path("inspect_speedrun.json")),
        "speedrun_pool_corners": (
            python + ["-m", "jaxtrain.bench", *speedrun, "--config.model.pool_impl=corners",
                      f"--runs={min(runs, 5)}", warmup,
                      f"--json={path('speedrun_pool_corners.json')}"],
            path("speedrun_pool_corners.json")),
        "inspect_speedrun_corners": (
            python + ["-m", "jaxtrain.bench", *speedrun, "--config.model.pool_impl=corners",
                      "--inspect", steps, f"--profile={path('profile/speedrun_corners')}",
                      f"--json={path('inspect_speedrun_corners.json')}"],
            path("inspect_speedrun_corners.json")),
        "speedrun_whole_process": (
            python + ["-m", "jaxtrain.bench", *speedrun, "--runs=1", "--warmup=0",
                      "--whole_process", f"--compilation_cache={path('xla')}",
                      f"--json={path('speedrun_whole_process.json')}"],
            path("speedrun_whole_process.json")),
        "cifar_train": (python + ["main.py", *cifar, f"--workdir={path('cifar')}"],
                        path("cifar/summary.json")),
        "seed_64_replicas": (
            python + ["main.py", *seed, "--config.train.replicas=" + ("4" if dry else "64"),
                      f"--workdir={path('seed_64_replicas')}"],
            path("seed_64_replicas/summary.json")),
        "compare_seed": (python + ["-m", "jaxtrain.compare", *seed,
                                   "--frameworks=jax,torch_fast", *torch_compile,
                                   f"--workdir={path('compare_seed')}"],
                         path("compare_seed/compare.json")),
        "finetune_resnet50_224": (python + ["-m", "jaxtrain.compare", *finetune,
                                            "--frameworks=jax,torch_fast", *torch_compile,
                                            f"--workdir={path('finetune_resnet50_224')}"],
                                  path("finetune_resnet50_224/compare.json")),
        "resnet50_largest_batch": (
            python + ["benchmarks/memory.py", "--largest_batch",
                      *(DRY_LARGEST if dry else ("--model=resnet50", "--image_size=224",
                                                 "--start=2048", "--max_probes=5",
                                                 "--seconds=100")),
                      f"--json={path('resnet50_largest_batch.json')}"],
            path("resnet50_largest_batch.json")),
        "resnet50_224": (python + ["-m", "jaxtrain.compare", *resnet,
                                   "--frameworks=jax,torch_fast", *torch_compile,
                                   f"--workdir={path('resnet50_224')}"],
                         path("resnet50_224/compare.json")),
    }
    steps_run = [step for step in PLAN + EXTRAS if step.name not in SETUP]
    return [(step, *commands[step.name]) for step in steps_run]


def plan_table(scale: float = 1.0) -> str:
    """PLAN and EXTRAS as a Markdown table, with the totals: the budget on paper."""
    rows = ["| step | cap s | expected s | yields | why here |", "| - | - | - | - | - |"]
    for step in PLAN + EXTRAS:
        rows.append(f"| {step.name} | {step.cap * scale:g} | {step.expected * scale:g} | "
                    f"{step.yields} | {step.why} |")
    caps = sum(step.cap for step in PLAN) * scale
    expected = sum(step.expected for step in PLAN) * scale
    rows.append(f"| all but the extras | {caps:g} | {expected:g} | | the budget is "
                f"{BUDGET * scale:g} s |")
    return "\n".join(rows)


def run_item(command: list, log_path: str, timeout: float, env: dict,
             why_stopped: str | None = None) -> tuple[str, float]:
    """Runs one command with its output in log_path; (status, seconds). A command past its
    time is stopped with its whole process group (compare's DataLoader workers too)."""
    start = time.perf_counter()
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(command) + "\n")
        log.flush()
        child = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                 env=env, start_new_session=True)
        try:
            code = child.wait(timeout=timeout)
            status = "ok" if code == 0 else f"failed (exit {code})"
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            status = f"stopped after {timeout:.0f} s ({why_stopped or 'out of time'})"
    return status, time.perf_counter() - start


def log_lines(log_path: str) -> list:
    with open(log_path, errors="replace") as f:
        return [line.rstrip("\n") for line in f]


def last_error(log_path: str) -> str | None:
    lines = [line.strip() for line in log_lines(log_path) if line.strip()]
    return next((line for line in reversed(lines) if line.startswith("error:")),
                lines[-1] if lines else None)


def last_json_line(log_path: str) -> dict | None:
    """The last line of a log that is a JSON object (the preflight's report)."""
    for line in reversed(log_lines(log_path)):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                continue
    return None


def xla_warnings(log_path: str) -> list:
    """XLA's compile-speed warnings in a log (a ptxas newer than the driver), once each."""
    return list(dict.fromkeys(line.strip() for line in log_lines(log_path)
                              if XLA_WARNINGS.search(line)))


def wheel_command(wheels: str, target: str) -> list | None:
    """pip-installs every wheel in `wheels` into `target` (no index, no dependencies);
    None when there are no wheels."""
    found = sorted(f for f in os.listdir(wheels) if f.endswith(".whl")) if os.path.isdir(
        wheels) else []
    if not found:
        return None
    return [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
            "--no-compile", "--no-cache-dir", "--upgrade", "--target", target,
            *(os.path.join(wheels, f) for f in found)]


def write_start_weights(path: str, dry: bool) -> str:
    """torchvision's ResNet-50 (ResNet-18 dry) with its random init, saved as its ImageNet
    weights are: the fine-tuning item's model.init_from (the device has no network)."""
    import torch
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.resnet18 if dry else torchvision.models.resnet50
    torch.save(model(weights=None).state_dict(), path)
    return path


def write_resnet_arrays(batches_dir: str, path: str, dry: bool) -> str:
    """The first training and test images of cifar-10-batches-py, upscaled (nearest
    neighbour, 7x: 224 px) into an arrays .npz for the ResNet-50 throughput item."""
    import numpy as np

    train, test, factor = RESNET_IMAGES[dry]

    def read(name, count):
        with open(os.path.join(batches_dir, "cifar-10-batches-py", name), "rb") as f:
            batch = {k.decode() if isinstance(k, bytes) else k: v
                     for k, v in pickle.load(f, encoding="latin1").items()}
        images = np.asarray(batch["data"][:count], np.uint8).reshape(-1, 3, 32, 32)
        images = images.transpose(0, 2, 3, 1).repeat(factor, axis=1).repeat(factor, axis=2)
        return images, np.asarray(batch["labels"][:count], np.int64)

    x_train, y_train = read("data_batch_1", train)
    x_test, y_test = read("test_batch", test)
    np.savez(path, x_train=x_train, y_train=y_train, x_test=x_test, y_test=y_test)
    return path


def preflight() -> dict:
    """In a child with the items' environment: the versions, then every module the items
    use imported, the speedrun's optimiser built and a small program compiled and run.
    Raises on the first failure; the caller prints it as one line."""
    import importlib
    import importlib.metadata as metadata

    info = {"python": sys.version.split()[0], "packages": {}}
    for name in ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda13-pjrt", "jax-cuda12-plugin",
                 "jax-cuda12-pjrt", "flax", "optax", "orbax-checkpoint", "ml_collections",
                 "tensorboardX", "grain", "numpy", "torch", "torchvision"):
        try:
            info["packages"][name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    import jax
    import jax.numpy as jnp

    device = jax.devices()[0]
    info.update(backend=jax.default_backend(), devices=[d.device_kind for d in jax.devices()],
                platform_version=str(device.client.platform_version))
    try:
        from jax._src.lib import cuda_versions  # None without a CUDA plugin
    except ImportError:
        cuda_versions = None
    if cuda_versions is not None:
        for name in ("cuda_runtime_get_version", "cuda_runtime_build_version",
                     "cuda_driver_get_version", "cudnn_get_version", "cudnn_build_version",
                     "cublas_get_version", "cufft_get_version", "cusolver_get_version",
                     "cusparse_get_version"):
            if hasattr(cuda_versions, name):
                try:
                    info[name] = getattr(cuda_versions, name)()
                except Exception as error:  # a library the plugin did not load
                    info[name] = f"unavailable ({error})"
    import torch

    info["torch"] = {"version": torch.__version__, "cuda": torch.version.cuda,
                     "cudnn": torch.backends.cudnn.version(),
                     "cuda_available": torch.cuda.is_available(),
                     "device": (torch.cuda.get_device_name(0) if torch.cuda.is_available()
                                else None)}
    sys.path.insert(0, REPO)
    for module in ("main", "jaxtrain.bench", "jaxtrain.compare", "jaxtrain.loop",
                   "jaxtrain.torch_models", "jaxtrain.torch_optim", "ml_collections",
                   "tensorboardX", "configs.cifar_speedrun", "configs.imagenet_resnet50"):
        importlib.import_module(module)
    from configs import cifar_speedrun
    from jaxtrain import checks, compare, models, optim, prepare

    compare.check_torch_device(info["backend"], torch.cuda.is_available(), torch.__version__)
    config = cifar_speedrun.get_config()
    checks.check_config(config)
    model = models.create_model(config.model, 10, checks.PRECISIONS[config.train.precision])
    params = prepare.abstract_init(model, config.model, (32, 32, 3))["params"]
    tx = optim.create_optimizer(config.optimizer, optim.create_schedule(config.optimizer, 100))
    opt_state = jax.eval_shape(tx.init, params)
    jax.eval_shape(tx.update, params, opt_state, params)
    x = jnp.ones((256, 256), jnp.bfloat16)
    jax.block_until_ready(jax.jit(lambda x: (x @ x).sum()).lower(x).compile()(x))
    info["preflight"] = "ok: modules imported, the speedrun's optimiser built, a program ran"
    return info


def parent_environment() -> dict:
    """What this process sees, written before any setup: the variables that change how
    XLA and its allocator behave, and the GPU as nvidia-smi reports it."""
    info = {"python": sys.version.split()[0], "argv": sys.argv[1:],
            "variables": {k: v for k, v in sorted(os.environ.items())
                          if k == "XLA_FLAGS" or k.startswith(("XLA_PYTHON_CLIENT_", "JAX_"))
                          or k in ("CUDA_VISIBLE_DEVICES", "CUDA_MODULE_LOADING",
                                   "TF_CPP_MIN_LOG_LEVEL", "NVIDIA_TF32_OVERRIDE")}}
    if shutil.which("nvidia-smi"):
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                              "--format=csv,noheader"], capture_output=True, text=True)
        info["nvidia_smi"] = smi.stdout.strip()
    return info


def archive(folder: str, path: str, skip_suffix: str | None = None) -> None:
    """folder as a .tar.gz at path, written whole or not at all; files ending in
    skip_suffix are left out."""
    def keep(info):
        return None if skip_suffix and info.name.endswith(skip_suffix) else info

    with tarfile.open(path + ".tmp", "w:gz") as tar:
        tar.add(folder, arcname=os.path.basename(path).removesuffix(".tar.gz"), filter=keep)
    os.replace(path + ".tmp", path)


def archive_trace(folder: str, path: str) -> None:
    """A profile folder as an archive the device can return (16 MiB a file): the Perfetto
    copy (.trace.json.gz) is left out when both do not fit; the .xplane.pb has it all."""
    archive(folder, path)
    if os.path.getsize(path) > MAX_FILE_BYTES:
        archive(folder, path, skip_suffix=".trace.json.gz")


def write_json(results: dict, path: str) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(results, f, indent=1)
    os.replace(path + ".tmp", path)


def log_tail(log_path: str, lines: int = 3) -> str:
    return "".join(line + "\n" for line in log_lines(log_path)[-lines:])


def parse_caps(text: str, names: set) -> dict:
    """'name=seconds,...' -> {name: seconds}; unknown names and bad numbers are usage errors."""
    caps = {}
    for part in filter(None, text.split(",")):
        name, sep, value = part.partition("=")
        if not sep or name not in names:
            raise ValueError(f"--caps: {part!r} is not NAME=SECONDS with NAME one of "
                             + ", ".join(sorted(names)))
        try:
            caps[name] = float(value)
        except ValueError:
            raise ValueError(f"--caps: {value!r} is not a number of seconds") from None
    return caps


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT"),
                        help="where h200.json and the archives go (default: $OUT)")
    parser.add_argument("--data_dir", help="a folder holding cifar-10-batches-py (default: "
                        "decode .data/cifar10_jpeg.npz into a temporary folder)")
    parser.add_argument("--data_npz_dir", default=os.path.join(REPO, ".data"),
                        help="the carried cifar10_jpeg.npz and cifar10_jpeg.py")
    parser.add_argument("--wheels", default=os.path.join(REPO, ".whl"),
                        help="wheels the image lacks, installed first when present")
    parser.add_argument("--budget", type=float, default=None,
                        help=f"seconds for everything (default {BUDGET:g}; --dry: "
                        f"x{DRY_CAP_SCALE:g}); an item gets at most what is left")
    parser.add_argument("--caps", default="", help="NAME=SECONDS,...: other caps for these "
                        "steps or items (default: the plan's, x10 with --dry)")
    parser.add_argument("--runs", type=int, default=None,
                        help="timed runs of the speedrun items (default 10; --dry: 2)")
    parser.add_argument("--only", default="", help="comma-separated item names to run")
    parser.add_argument("--dry", action="store_true",
                        help="tiny sizes, a few steps of every item: the CPU check CI runs")
    parser.add_argument("--plan", action="store_true",
                        help="print the plan (caps, expected seconds, yields) and exit")
    parser.add_argument("--preflight", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.plan:
        print(plan_table(DRY_CAP_SCALE if args.dry else 1.0))
        return 0
    if args.preflight:  # the child the setup runs: one JSON line, or one error line
        try:
            print(json.dumps(preflight()))
        except Exception as error:
            print(f"error: preflight: {type(error).__name__}: {error}".splitlines()[0])
            return 1
        return 0
    if not args.out:
        parser.error("--out is required when $OUT is not set")
    scratch = tempfile.mkdtemp(prefix="jaxtrain-h200-")
    work, logs = os.path.join(scratch, "work"), os.path.join(scratch, "logs")
    start_weights = os.path.join(scratch, START_WEIGHTS)
    listed = items(args.data_dir or os.path.join(scratch, "data"),
                   os.path.join(scratch, "resnet_224.npz"), work, args.dry, args.runs,
                   start_weights)
    names = {step.name for step, *_ in listed}
    only = {name for name in args.only.split(",") if name}
    if only - names:
        parser.error(f"--only: unknown item(s) {', '.join(sorted(only - names))}; choose from "
                     + ", ".join(step.name for step, *_ in listed))
    try:
        caps = parse_caps(args.caps, names | set(SETUP))
    except ValueError as error:
        parser.error(str(error))
    try:
        return run_all(args, listed, only, caps, scratch, work, logs)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def run_all(args, listed: list, only: set, caps: dict, scratch: str, work: str,
            logs: str) -> int:
    start = time.perf_counter()
    scale = DRY_CAP_SCALE if args.dry else 1.0
    budget = args.budget if args.budget is not None else BUDGET * scale
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(work)
    os.makedirs(logs)
    results_path = os.path.join(args.out, RESULTS)
    results = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "dry": args.dry,
               "budget_seconds": budget, "environment": parent_environment(),
               "plan": [dict(step._asdict(), cap=caps.get(step.name, step.cap * scale))
                        for step in PLAN + EXTRAS], "setup": {}, "items": {}}
    write_json(results, results_path)  # before anything can fail
    env = dict(os.environ, PYTHONUNBUFFERED="1")

    def elapsed():
        return time.perf_counter() - start

    def cap_of(step):
        return caps.get(step.name, step.cap * scale)

    def run_logged(step, command, record: dict) -> str:
        """Runs command under the step's cap (and what the budget has left); fills record."""
        cap, left = cap_of(step), budget - elapsed()
        record.update(command=" ".join(command), cap_seconds=cap)
        log_path = os.path.join(logs, f"{step.name}.log")
        if left < 5:
            record["status"] = f"skipped ({left:.0f} s of the budget left)"
            return record["status"]
        limit, why = (cap, f"its {cap:g} s cap") if cap <= left else (left, "the budget ran out")
        record["status"], record["seconds"] = run_item(command, log_path, limit, env, why)
        if record["status"] != "ok":
            record["error"] = last_error(log_path)
        warnings = xla_warnings(log_path)
        if warnings:
            record["xla_warnings"] = warnings
        print(f"--- {step.name}: {record['status']} in {record['seconds']:.1f} s\n"
              + log_tail(log_path), end="", flush=True)
        archive(logs, os.path.join(args.out, "logs.tar.gz"))
        return record["status"]

    # Setup: each step capped and recorded; a failure ends the run with the file written.
    setup_steps = {step.name: step for step in PLAN if step.name in SETUP}
    site = os.path.join(scratch, "site")
    data_dir = args.data_dir or os.path.join(scratch, "data")
    commands = {
        "wheels": wheel_command(args.wheels, site),
        "data": None if args.data_dir else [
            sys.executable, os.path.join(args.data_npz_dir, "cifar10_jpeg.py"), "batches",
            data_dir],
        "preflight": None,  # after the data: filled below with this file's --preflight
    }
    for name in SETUP:
        step, record = setup_steps[name], {}
        results["setup"][name] = record
        command = commands[name]
        if name == "preflight":
            command = [sys.executable, os.path.abspath(__file__), "--preflight"]
        if command is None:
            record["status"] = "not needed"
        else:
            status = run_logged(step, command, record)
            if status == "ok" and name == "wheels":
                env["PYTHONPATH"] = os.pathsep.join(filter(None, [site, env.get("PYTHONPATH")]))
            if status == "ok" and name == "preflight":
                results["environment"]["child"] = last_json_line(
                    os.path.join(logs, "preflight.log"))
        resnets = {"resnet50_224", "finetune_resnet50_224"}
        if record["status"] in ("ok", "not needed") and name == "data" and (
                not only or resnets & only):
            try:
                write_resnet_arrays(data_dir, os.path.join(scratch, "resnet_224.npz"), args.dry)
                if not only or "finetune_resnet50_224" in only:
                    write_start_weights(os.path.join(scratch, START_WEIGHTS), args.dry)
            except (OSError, KeyError, ValueError, ImportError, pickle.UnpicklingError) as error:
                record.update(status="failed", error=f"the 224 px arrays and weights: {error}")
        record.setdefault("seconds", 0.0)
        results["total_seconds"] = elapsed()
        write_json(results, results_path)
        if record["status"] not in ("ok", "not needed"):
            print(f"-> {results_path}: setup step {name} {record['status']}: "
                  f"{record.get('error')}", flush=True)
            return 1

    for step, command, json_path in listed:
        if only and step.name not in only:
            continue
        entry = {"what": step.yields}
        run_logged(step, command, entry)
        if os.path.exists(json_path):  # also a cut-off item's finished runs or frameworks
            with open(json_path) as f:
                entry["result"] = json.load(f)
        traces = os.path.join(work, "profile", step.name.removeprefix("inspect_"))
        if os.path.isdir(traces):
            archive_trace(traces, os.path.join(args.out, f"profile_{step.name}.tar.gz"))
        results["items"][step.name] = entry
        results["total_seconds"] = elapsed()
        write_json(results, results_path)
    failed = [name for name, entry in results["items"].items() if entry["status"] != "ok"]
    print(f"-> {results_path} ({results['total_seconds']:.0f} s)"
          + (f"; not ok: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
