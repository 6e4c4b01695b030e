"""Every GPU figure jaxtrain reports, from two prepared device calls on whichever card
is lent (an H100 or an H200), each figure's baseline measured in the same call.

GPU time comes in short loans (about 15 minutes, machine start included, at
most 600 s a device command), so everything is measured by this one script,
most important first, in two calls: part 1 (default budget 540 s: the plain
speedrun as the baseline, its levers, XLA's compile settings, the strongest
PyTorch twin) and part 2 (200 s: the published airbench94_muon, whose cold
torch.compile alone took ~160 s on an H200). Each item is one of jaxtrain's own
commands run as a child process, so a figure here is what a user gets from that
command. Every setup step and item has a cap of its own (PLAN and PLAN_2 below;
`--plan` prints them): one that reaches its cap is stopped with its process group
and the next one starts, so a slow or hung item costs only its own cap. A part's
caps fit its budget, so every item gets its chance (the items that do not fit are
dropped, least informative first, to the head of the extras, and `--plan` names
them); what part 1's items leave unused goes to the extras at the end.

$OUT/gpu.json (part 2: $OUT/gpu_part2.json) is written before anything else (the
environment and the card: its name, memory, clocks and driver as nvidia-smi
reports them), after every setup step and after every item: each entry has its
command, cap, status, seconds, the JSON the command wrote (a benchmark writes its
JSON after compiling and after every run, compare after every framework, the
airbench item after every run it reads, so a cut-off item still reports what it
finished) and any XLA warning about compilation; `ratios` holds every speedrun
item's seconds per run, and the strongest PyTorch twin's, against the baseline's
of the same call. $OUT/logs.tar.gz holds every output; profiler traces (and
inspect's optimised HLO) come back as $OUT/profile_<item>.tar.gz (the device
returns at most 8 files from $OUT, hence the archives). A failing setup step (the
wheels, the data, the preflight) is recorded there and ends the run.

Prepare, once, in the repository root of the development machine (the device
has no network; .gitignore lists the three folders, and they travel with
`carry`):

    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \\
        --implementation cp --platform manylinux2014_x86_64 -d .whl \\
        ml_collections==1.1.0 tensorboardX==2.6.4
    mkdir -p .data && cp ../shared/data/cifar10_jpeg.npz ../shared/data/cifar10_jpeg.py .data/
    # airbench94_muon.py into .airbench/ (never committed: not this project's code), from a
    # clone or git mirror of github.com/KellerJordan/cifar10-airbench (its commit f1c599c,
    # the version read for issue #40), or from the file itself:
    python3 benchmarks/gpu.py --prepare_airbench=PATH

Run on the device (device tool: carry [".whl", ".data", ".airbench"]; part 1 with
timeout_s=600, part 2 with timeout_s=230, on the same warm machine):

    python3 benchmarks/gpu.py --out=$OUT             # part 1
    python3 benchmarks/gpu.py --part=2 --out=$OUT    # part 2: airbench94_muon

Setup: the wheels in .whl (the image has jax, flax, optax, orbax and torch, not
ml_collections or tensorboardX) go into a private folder; the CIFAR-10 JPEG copy
in .data is decoded into the cifar-10-batches-py layout (part 2: and written as
the cifar10/{train,test}.pt airbench reads; extras: a part of it upscaled to
224 px for the ResNet-50 items); the preflight imports every module the items
use, records the versions (jax, jaxlib, the CUDA plugin, CUDA and cuDNN as the
device client reports them, torch and its CUDA and cuDNN) and the card's memory as
JAX's allocator reports it, looks the plan's XLA flags up in the device's jaxlib,
builds the speedrun's optimiser and compiles a small program, so an API change in
the image's jax / optax / flax fails in seconds with one line, not in every item.
Part 2 needs no wheels; its preflight checks torch's CUDA, Triton and the airbench
script before airbench's cold compile.

The same script on a CPU with tiny sizes, a few steps of every item (CI runs
some items: tests/test_gpu.py; run them all before a loan), the airbench item
against benchmarks/airbench_standin.py (airbench needs CUDA):

    python3 benchmarks/gpu.py --dry --data_dir=DIR --out=/tmp/gpu
    python3 benchmarks/gpu.py --dry --part=2 --data_dir=DIR --out=/tmp/gpu
"""
import argparse
import collections
import hashlib
import json
import os
import pickle
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = {1: "gpu.json", 2: "gpu_part2.json"}
SPEEDRUN = "configs/cifar_speedrun.py"
MAX_FILE_BYTES = 15 * 2**20  # the device returns files of up to 16 MiB
# Of each device command's time: the rest is for the archives and slack. 540 + 200 s
# of items, plus the machine's start (60-120 s), fit a loan's 900 s.
BUDGETS = {1: 540.0, 2: 200.0}
BUDGET = BUDGETS[1]
DRY_CAP_SCALE = 10.0  # --dry on a CPU: every cap and the budget times this
# XLA's warning when the ptxas it finds is newer than the driver: compiles get slower.
XLA_WARNINGS = re.compile(r"disabling parallel compilation|ptxas .*(newer|version)", re.I)

Step = collections.namedtuple("Step", "name cap expected yields why")

# The speedrun's variants. Every lever that keeps the recipe (the same numbers to the bit,
# or within float rounding: each has its CPU test), and the settings XLA compiles with.
CORNERS = ("--config.model.pool_impl=corners",)
LEVERS = (*CORNERS, "--config.optimizer.ns_stack=True", "--config.optimizer.flatten=True",
          "--config.train.drop_finished_groups=True", "--config.model.bn_impl=lean")
ONE_LEVER = {"speedrun_ns_stack": "--config.optimizer.ns_stack=True",
             "speedrun_flatten": "--config.optimizer.flatten=True",
             "speedrun_drop_finished_groups": "--config.train.drop_finished_groups=True",
             "speedrun_bn_lean": "--config.model.bn_impl=lean"}
RECIPE_CHANGES = {"speedrun_levers_silu": "--config.model.activation=silu",
                  "speedrun_levers_tta_quarter": "--config.eval.tta_fraction=0.25"}
# The compile A/B (train.xla_flags; names checked against jaxlib 0.10.2's XLA, and by the
# preflight against the device's): today's autotuning level is 4 (on, buffers
# initialised, reinitialised and results checked), Triton GEMMs on, LLVM modules
# compiled one at a time; parallel, they take as many threads as
# --xla_gpu_force_compilation_parallelism says (16: the device's cores).
XLA_SETTINGS = {
    "compile_no_triton_gemm": "--xla_gpu_enable_triton_gemm=false",
    "compile_parallel_llvm": "--xla_gpu_enable_llvm_module_compilation_parallelism=true "
                             "--xla_gpu_force_compilation_parallelism=16",
    "compile_autotune_1": "--xla_gpu_autotune_level=1",
    "compile_autotune_0": "--xla_gpu_autotune_level=0",
    "compile_autotune_2": "--xla_gpu_autotune_level=2",
}
AUTOTUNE_ITEMS = ("compile_autotune_0", "compile_autotune_1", "compile_autotune_2")
# whole_process_best's choice: the levers' config if its mean reaches the target over at
# least 10 seeds and it runs faster, else the faster of corners and the plain speedrun;
# each compile setting that saves at least a second of
# compilation without slowing a run by more than half a percent (one autotuning level).
TARGET_ACCURACY = 0.907
MIN_COMPILE_SAVING = 1.0
STEP_TOLERANCE = 0.005
# The strongest PyTorch twin: compare.py's torch_fast in torch.compile's max-autotune mode
# (its default) with CUDA graphs, falling back to 'default' past this cap. MARKED: the cap
# is this script's choice (compare.py's default is 90 s); the flag name is compare.py's.
STRONG_TWIN = ("--frameworks=torch_fast", "--torch_compile_cap=60")
# The other compare items keep the first loan's torch.compile mode, so their caps still
# hold (max-autotune on ResNet-50 would spend its cap and then compile again).
DEFAULT_COMPILE = ("--torch_compile_mode=default",)
# airbench94_muon: the version read for issue #40, and where the prepared copy goes.
AIRBENCH_REPOSITORY = "KellerJordan/cifar10-airbench"
AIRBENCH_COMMIT = "f1c599c4af24aca803e3e65a6a7e52a502e09d0e"
AIRBENCH_SHA256 = "704e29251a5207d8aed8a35adf13f772ff386b90a712aaddc2a28854385b536e"
AIRBENCH_DIR = os.path.join(REPO, ".airbench")
AIRBENCH_SCRIPT = os.path.join(AIRBENCH_DIR, "airbench94_muon.py")
AIRBENCH_STANDIN = os.path.join(REPO, "benchmarks", "airbench_standin.py")
AIRBENCH_MARGIN = 5.0  # the wrapper stops airbench this long before the item's limit

# The budget on paper: (name, cap s, expected s, what it yields, why it is here).
# Expected times are from the first loan, on an H200 (2026-12-04,
# benchmarks/results/h200.json, BENCHMARKS.md), rounded up: a speedrun process is ~5.5 s
# of start-up and data, 30.5 s of compiling, 1.37 s a run; another card's, the compile
# settings' and the levers' own effects are guesses until measured (the caps leave each
# about 25% more; the speedrun items more, for a card slower than the H200). Part 1 as
# wanted, most important first; PLAN is what fits its budget.
PLAN_WANTED = (
    Step("wheels", 8, 4, "ml_collections and tensorboardX importable",
         "every item needs them"),
    Step("data", 20, 12, "cifar-10-batches-py (the ResNet items' 2,560 + 512 images at 224 "
         "px are written from it before them)", "every item needs the data"),
    Step("preflight", 20, 15, "the versions; every module imported, the plan's XLA flags looked "
         "up in the device's jaxlib, the speedrun's optimiser built, a program compiled",
         "an API change fails here in seconds, not in every item"),
    Step("speedrun", 66, 52, "10 seeds (0-9) of the speedrun with today's default settings "
         "(XLA's max-pooling on a GPU): accuracy, seconds per run, compile seconds",
         "the baseline: every lever's ratio and the PyTorch twin's are to it, measured in "
         "the same call on the same card (the first loan, an H200: 1.370 s)"),
    Step("speedrun_corners", 66, 52, "10 seeds (0-9) of the speedrun with "
         "model.pool_impl='corners' (the same numbers to the bit): accuracy, seconds per run, "
         "compile seconds; the compile settings' baseline", "max-pooling and its gradient's "
         "scatter were 1.5 of the 6.63 ms step on the H200"),
    Step("speedrun_levers", 110, 85, "30 seeds (0-29) with every lever that keeps the recipe: "
         "corners, optimizer.ns_stack, optimizer.flatten, train.drop_finished_groups, "
         "model.bn_impl='lean': mean accuracy and its standard error, seconds per run",
         "the candidate for 1.0 s a run, and the >= 90.70% over >= 30 seeds; its seeds 0-9 "
         "compare with speedrun_corners'"),
    Step("inspect_speedrun_corners", 50, 40, "the step with corners: kernels by kind, the 60 "
         "costliest kernels by name, the optimised HLO, a trace", "where the time goes after "
         "pooling: the float32 buffers kept for BatchNorm's backward, Muon's products"),
    Step("compile_no_triton_gemm", 46, 38, "the speedrun (corners) compiled cold with "
         "--xla_gpu_enable_triton_gemm=false: compile seconds, the whole process to the first "
         "run's accuracy, a second run's seconds", "compile is 30.3 of the 36.7 s cold start; "
         "fewer GEMM candidates to autotune"),
    Step("compile_parallel_llvm", 46, 36, "the same with LLVM modules compiled in parallel "
         "(--xla_gpu_enable_llvm_module_compilation_parallelism, 16 threads)",
         "code generation on 16 cores instead of one"),
    Step("compile_autotune_1", 45, 36, "the same with --xla_gpu_autotune_level=1 (autotuning "
         "without initialising, re-initialising and checking buffers; today's level is 4)",
         "the autotuner's checks, without its choices"),
    Step("compile_autotune_0", 40, 30, "the same with --xla_gpu_autotune_level=0 (no "
         "autotuning)", "the most compile time to save, and what it costs each step"),
    Step("compare_speedrun_strong", 113, 95, "the speedrun recipe in the strongest PyTorch "
         "twin (torch_fast: max-autotune with CUDA graphs within a 60 s compile cap, else "
         "default mode; fused SGD, batched bf16 Newton-Schulz): one run's seconds, accuracy "
         "and what compiled", "the ratio to the fastest PyTorch in the same call (jaxtrain's "
         "side: the speedrun items; on the H200 the first loan's twin took 2.10 s)"),
)
# What part 1 drops first when its wanted items' caps exceed its budget: a trace, then the
# compile settings that matter least (the levers, the baseline and the twin stay).
LEAST_INFORMATIVE_FIRST = ("inspect_speedrun_corners", "compile_autotune_0",
                           "compile_autotune_1", "compile_parallel_llvm",
                           "compile_no_triton_gemm")
# Part 2, a second device call: airbench needs most of it.
PLAN_2 = (
    Step("data", 18, 12, "cifar-10-batches-py; from it, before its item, airbench's "
         "cifar10/train.pt and test.pt (uint8 images N x 32 x 32 x 3, int64 labels, the "
         "class names)", "airbench reads them (the device cannot download)"),
    Step("preflight", 12, 8, "the versions and the card; torch with CUDA, Triton (what "
         "torch.compile's max-autotune generates kernels with) and the airbench script",
         "a missing piece fails here in seconds, not after the item's cold compile"),
    Step("airbench94_muon", 170, 165, "the published airbench94_muon (torch.compile "
         "max-autotune) on the same JPEG CIFAR-10, stopped at its cap: each finished run's "
         "TTA accuracy and seconds as it prints them, the time to its first run",
         "the anchor (1.47 s a run on the H200 before); its 200 runs after a ~160 s cold "
         "compile do not fit a loan, so the runs before its cap are read"),
)
# If part 1 has time left, each with at most its cap of what is left, most useful first:
# the whole process with the best settings, the levers that change the recipe, one lever
# at a time, and what the first loan measured or could not reach.
EXTRAS = (
    Step("whole_process_best", 60, 45, "the whole process cold and warm (two runs each) with "
         "the best settings the items above found (gpu.json records the choice and why)",
         "the whole-process target is 20 s cold"),
    Step("speedrun_levers_silu", 62, 55, "10 seeds (0-9) of speedrun_levers with "
         "model.activation='silu'", "a cheaper activation; its accuracy over the same seeds"),
    Step("speedrun_levers_tta_quarter", 62, 55, "10 seeds (0-9) of speedrun_levers with "
         "eval.tta_fraction=0.25", "TTA on the least confident quarter: ~30 of the 45 ms "
         "evaluation; its accuracy over the same seeds"),
    Step("inspect_speedrun_levers", 50, 40, "the step with every lever: kernels, top 60, HLO, "
         "a trace", "what the levers left"),
    Step("compile_autotune_2", 46, 38, "the compile A/B with --xla_gpu_autotune_level=2",
         "between levels 1 and 4"),
    *(Step(name, 62, 52, "10 seeds (0-9) of speedrun_corners with "
           + flag.removeprefix("--config."), "one lever's own seconds and accuracy")
      for name, flag in ONE_LEVER.items()),
    Step("compare_speedrun", 90, 79, "the speedrun recipe in jaxtrain and in PyTorch "
         "(torch_fast) side by side", "the first loan's comparison"),
    Step("inspect_speedrun", 42, 36, "the speedrun's step with XLA's max-pooling: kernels, "
         "top ops, a trace", "the first loan's item"),
    Step("compare_seed", 108, 85, "the seed recipe in jaxtrain (one run: its images/s) and "
         "the fastest PyTorch", "the first loan's 55 s cap cut PyTorch's side off (jaxtrain: "
         "2.99 s; the article's PyTorch as written: 82.6 s)"),
    Step("resnet50_largest_batch", 110, 95, "the largest ResNet-50 batch at 224 px whose "
         "train step fits the card's own memory (as JAX's allocator reports it), plain, with "
         "model.remat and with accumulate_steps=4 (compiled memory analyses, nothing "
         "trained)", "issue #30; the first loan's 40 s showed only that 1,024 fits the H200 "
         "(42.1 GB plain, 14.9 GB with remat)"),
    Step("finetune_resnet50_224", 100, 91, "configs/finetune.py: ResNet-50 at 224 px from "
         "random-init torchvision weights (model.init_from), 40 steps of batch 256, jaxtrain "
         "and PyTorch (channels_last, bf16 autocast, torch.compile) from the same weights: "
         "images/s each", "the ImageNet-class throughput frameworks are compared by, on the "
         "path people fine-tune with"),
    Step("speedrun_whole_process", 55, 49, "one speedrun as a user starts it: whole process "
         "cold, then with a warm cache", "the first loan's item: 36.7 s cold, 8.9 s warm"),
    Step("cifar_train", 40, 32, "configs/cifar.py trained in full: test accuracy, train and "
         "compile seconds", "the main command of the README"),
    Step("resnet50_224", 100, 91, "ResNet-50 at 224 px from scratch (the ImageNet recipe), 40 "
         "steps of batch 256, jaxtrain and PyTorch: images/s each", "the fine-tuning item's "
         "throughput without init_from"),
    Step("seed_64_replicas", 95, 86, "64 seeds of the seed recipe in one program: images/s "
         "per replica, the spread of accuracy", "issue #18's target is for a GPU"),
)
SETUP = ("wheels", "data", "preflight")


def fit_to_budget(wanted: tuple, budget: float, least_informative_first: tuple) -> tuple:
    """(kept, dropped): `wanted` less the items of least_informative_first, in that order,
    that must go for the kept caps to fit the budget."""
    kept, dropped = list(wanted), []
    for name in least_informative_first:
        if sum(step.cap for step in kept) <= budget:
            break
        step = next(step for step in kept if step.name == name)
        kept.remove(step)
        dropped.append(step)
    if sum(step.cap for step in kept) > budget:
        raise ValueError(f"the plan's caps exceed its {budget:g} s budget with every "
                         "droppable item dropped")
    return tuple(kept), tuple(dropped)


PLAN, DROPPED = fit_to_budget(PLAN_WANTED, BUDGETS[1], LEAST_INFORMATIVE_FIRST)
EXTRAS = DROPPED + EXTRAS  # a dropped item still runs first if part 1 leaves the time
PARTS = {1: (PLAN, EXTRAS), 2: (PLAN_2, ())}

# Tiny sizes for --dry: every item's code path, a few steps each.
DRY_SPEEDRUN = ("--config.model.widths=(8,16,16)", "--config.model.stem_width=12",
                "--config.train.batch_size=200", "--config.train.num_steps=4",
                "--config.eval.batch_size=250")
DRY_CIFAR = ("--config.model.widths=(8,16,16)", "--config.model.stem_width=8",
             "--config.train.batch_size=100", "--config.train.num_steps=4",
             "--config.eval.batch_size=250",
             "--config.eval.tta=none")  # six views of 10,000 images: the speedrun items test TTA
DRY_SEED = ("--config.train.num_steps=20", "--config.train.log_every_steps=10",
            "--config.eval.batch_size=250")
# ResNet-50's throughput: CIFAR-10 images upscaled 7x (224 px) held on the device.
RESNET_IMAGES = {False: (2560, 512, 7), True: (64, 32, 2)}  # (train, test, factor) by dry
DRY_RESNET = ("--config.model.name=resnet18", "--config.train.batch_size=8",
              "--config.train.num_steps=2", "--config.eval.batch_size=16")
DRY_LARGEST = ("--model=resnet18", "--image_size=32", "--limit_gib=0.25", "--start=16",
               "--max_probes=3")
START_WEIGHTS = "resnet50_random.pth"  # the fine-tuning item's torchvision weights (random)
RESNET_ITEMS = {"resnet50_224", "finetune_resnet50_224"}


def items(data_dir: str, arrays: str, work: str, dry: bool, runs: int | None = None,
          start_weights: str = START_WEIGHTS, *, part: int = 1,
          airbench_script: str | None = None, airbench_dir: str | None = None) -> list:
    """(Step, command, JSON file the command writes) in the order run: the part's plan,
    then (part 1) the extras. A command may be a function of the items run so far
    (whole_process_best), returning (command, what it chose); "{limit}" in a command
    becomes the seconds its item may run, less AIRBENCH_MARGIN."""
    python = [sys.executable]
    data = f"--config.data.dir={data_dir}"
    speedrun = [f"--config={SPEEDRUN}", data, *(DRY_SPEEDRUN if dry else ())]
    cifar = ["--config=configs/cifar.py", data, *(DRY_CIFAR if dry else ())]
    seed = ["--config=configs/cifar_seed_cnn.py", data, *(DRY_SEED if dry else ())]

    def seeds(count):  # --runs wins; --dry: 2
        return f"--runs={runs if runs is not None else (2 if dry else count)}"

    warmup = "--warmup=0" if dry else "--warmup=1"
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

    def bench(name, *flags):
        return (python + ["-m", "jaxtrain.bench", *speedrun, *flags,
                          f"--json={path(name + '.json')}"], path(name + ".json"))

    def inspect(name, *flags):
        return bench(name, *flags, "--inspect", steps,
                     f"--profile={path('profile/' + name.removeprefix('inspect_'))}")

    def whole_process_best(done: dict):
        chosen = best_settings(done)
        xla = [f"--config.train.xla_flags={chosen['xla_flags']}"] if chosen["xla_flags"] else []
        command, _ = bench("whole_process_best", *chosen["overrides"], *xla, "--runs=2",
                           "--warmup=0", "--whole_process",
                           f"--compilation_cache={path('xla_best')}")
        return command, chosen

    commands = {
        "speedrun_corners": bench("speedrun_corners", *CORNERS, seeds(10), warmup),
        "speedrun_levers": bench("speedrun_levers", *LEVERS, seeds(30), warmup),
        "inspect_speedrun_corners": inspect("inspect_speedrun_corners", *CORNERS),
        # Cold, as a user's first run: no compilation cache, no warm-up; the second run's
        # seconds are the step's (the first run's include first-execution costs).
        **{name: bench(name, *CORNERS, f"--config.train.xla_flags={flags}", "--runs=2",
                       "--warmup=0") for name, flags in XLA_SETTINGS.items()},
        "compare_speedrun_strong": (python + ["-m", "jaxtrain.compare", *speedrun,
                                              *STRONG_TWIN, *torch_compile,
                                              f"--workdir={path('compare_speedrun_strong')}"],
                                    path("compare_speedrun_strong/compare.json")),
        "airbench94_muon": (python + [os.path.abspath(__file__),
                                      f"--airbench={airbench_script or AIRBENCH_SCRIPT}",
                                      f"--airbench_dir={airbench_dir or path('airbench')}",
                                      "--airbench_seconds={limit}",
                                      f"--airbench_json={path('airbench94_muon.json')}"],
                            path("airbench94_muon.json")),
        "whole_process_best": (whole_process_best, path("whole_process_best.json")),
        **{name: bench(name, *LEVERS, flag, seeds(10), warmup)
           for name, flag in RECIPE_CHANGES.items()},
        "inspect_speedrun_levers": inspect("inspect_speedrun_levers", *LEVERS),
        **{name: bench(name, *CORNERS, flag, seeds(10), warmup)
           for name, flag in ONE_LEVER.items()},
        "speedrun": bench("speedrun", seeds(10), warmup),
        "compare_speedrun": (python + ["-m", "jaxtrain.compare", *speedrun,
                                       "--frameworks=jax,torch_fast",
                                       *DEFAULT_COMPILE, *torch_compile,
                                       f"--workdir={path('compare_speedrun')}"],
                             path("compare_speedrun/compare.json")),
        "inspect_speedrun": inspect("inspect_speedrun"),
        "speedrun_whole_process": bench("speedrun_whole_process", "--runs=1", "--warmup=0",
                                        "--whole_process", f"--compilation_cache={path('xla')}"),
        "cifar_train": (python + ["main.py", *cifar, f"--workdir={path('cifar')}"],
                        path("cifar/summary.json")),
        "seed_64_replicas": (
            python + ["main.py", *seed, "--config.train.replicas=" + ("4" if dry else "64"),
                      f"--workdir={path('seed_64_replicas')}"],
            path("seed_64_replicas/summary.json")),
        "compare_seed": (python + ["-m", "jaxtrain.compare", *seed,
                                   "--frameworks=jax,torch_fast",
                                   *DEFAULT_COMPILE, *torch_compile,
                                   f"--workdir={path('compare_seed')}"],
                         path("compare_seed/compare.json")),
        "finetune_resnet50_224": (python + ["-m", "jaxtrain.compare", *finetune,
                                            "--frameworks=jax,torch_fast",
                                            *DEFAULT_COMPILE, *torch_compile,
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
                                   "--frameworks=jax,torch_fast",
                                   *DEFAULT_COMPILE, *torch_compile,
                                   f"--workdir={path('resnet50_224')}"],
                         path("resnet50_224/compare.json")),
    }
    plan, extras = PARTS[part]
    return [(step, *commands[step.name]) for step in plan + extras if step.name not in SETUP]


def best_settings(done: dict) -> dict:
    """whole_process_best's settings from the items before it (gpu.json's entries):
    the levers' config when speedrun_levers reached TARGET_ACCURACY over at least 10 seeds
    and ran faster than speedrun_corners, else corners, unless the plain speedrun (the
    baseline) ran no slower than corners; each compile setting that saved at
    least MIN_COMPILE_SAVING seconds of speedrun_corners' compile without slowing its
    second run by more than STEP_TOLERANCE of speedrun_corners' mean (of the autotuning
    levels, the one that saved most). Returns {"config", "overrides", "xla_flags",
    "settings", "why"}."""
    def result(name):
        return (done.get(name) or {}).get("result") or {}

    corners, levers = result("speedrun_corners"), result("speedrun_levers")
    chosen = {"config": "corners", "overrides": list(CORNERS), "xla_flags": "",
              "settings": [], "why": []}
    why = chosen["why"]
    if not corners.get("runs"):
        why.append("speedrun_corners has no runs: corners, XLA's default settings")
        return chosen
    if (len(levers.get("runs", ())) >= 10 and levers["accuracy_mean"] >= TARGET_ACCURACY
            and levers["seconds_mean"] < corners["seconds_mean"]):
        chosen.update(config="levers", overrides=list(LEVERS))
        why.append(f"levers: {levers['accuracy_mean']:.2%} over {len(levers['runs'])} seeds "
                   f"in {levers['seconds_mean']:.3f} s against corners' "
                   f"{corners['seconds_mean']:.3f} s")
    else:
        why.append("corners: speedrun_levers has fewer than 10 runs, misses "
                   f"{TARGET_ACCURACY:.2%} or is not faster")
        plain = result("speedrun")
        if plain.get("runs") and plain["seconds_mean"] <= corners["seconds_mean"]:
            chosen.update(config="plain", overrides=[])
            why.append(f"plain: the default pooling's {plain['seconds_mean']:.3f} s is no "
                       f"slower than corners' {corners['seconds_mean']:.3f} s")
    saved = {}
    for name in XLA_SETTINGS:
        found = result(name)
        if len(found.get("runs", ())) < 2:
            why.append(f"{name}: not measured")
            continue
        saving = corners["compile_seconds"] - found["compile_seconds"]
        slower = found["runs"][-1]["seconds"] / corners["seconds_mean"] - 1
        keep = saving >= MIN_COMPILE_SAVING and slower <= STEP_TOLERANCE
        if keep:
            saved[name] = saving
        why.append(f"{name}: compile {saving:+.1f} s saved, a run {slower:+.1%}"
                   + (" (kept)" if keep else ""))
    levels = [name for name in saved if name in AUTOTUNE_ITEMS]
    best_level = max(levels, key=saved.get) if levels else None
    chosen["settings"] = [name for name in XLA_SETTINGS if name in saved
                          and (name not in AUTOTUNE_ITEMS or name == best_level)]
    chosen["xla_flags"] = " ".join(XLA_SETTINGS[name] for name in chosen["settings"])
    return chosen


def ratios(items: dict, card: str | None) -> dict:
    """Each speedrun item's seconds per run, and the strongest PyTorch twin's (train and
    TTA evaluation, as a benchmark run's seconds count them), over the baseline's: the
    plain speedrun of the same call on the same card. A cold item (no warm-up run) counts
    its last run; {} until the baseline has runs."""
    def seconds(result):
        if not result.get("runs"):
            return None
        if result.get("warmup_runs") == 0:
            return result["runs"][-1]["seconds"]
        return result["seconds_mean"]

    results = {name: (entry.get("result") or {}) for name, entry in items.items()}
    base = seconds(results.get("speedrun", {}))
    if not base:
        return {}
    found = {name: round(seconds(result) / base, 4) for name, result in results.items()
             if name != "speedrun" and "runs_asked" in result and seconds(result)}
    for row in results.get("compare_speedrun_strong", {}).get("results", ()):
        if row.get("framework") == "torch_fast" and row.get("train_seconds"):
            found["compare_speedrun_strong (torch_fast)"] = round(
                (row["train_seconds"] + row.get("eval_seconds", 0.0)) / base, 4)
    return {"card": card, "baseline": "speedrun", "baseline_seconds": base,
            "over_baseline": found}


def plan_table(scale: float = 1.0) -> str:
    """Both parts and the extras as a Markdown table, with each part's totals: the budget
    on paper."""
    rows = ["| part | step | cap s | expected s | yields | why here |",
            "| - | - | - | - | - | - |"]
    for part, (plan, extras) in PARTS.items():
        for step in plan:
            rows.append(f"| {part} | {step.name} | {step.cap * scale:g} | "
                        f"{step.expected * scale:g} | {step.yields} | {step.why} |")
        caps = sum(step.cap for step in plan) * scale
        expected = sum(step.expected for step in plan) * scale
        rows.append(f"| {part} | all of part {part} | {caps:g} | {expected:g} | | its budget "
                    f"is {BUDGETS[part] * scale:g} s |")
        for step in extras:
            when = "dropped to fit, run if time is left" if step in DROPPED else (
                "if time is left")
            rows.append(f"| {part}, {when} | {step.name} | {step.cap * scale:g} | "
                        f"{step.expected * scale:g} | {step.yields} | {step.why} |")
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


def versions() -> dict:
    """The packages, the device as JAX sees it (its kind and what its allocator can hold),
    CUDA's libraries as the plugin reports them, and torch's view of CUDA."""
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

    device = jax.devices()[0]
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    info.update(backend=jax.default_backend(), devices=[d.device_kind for d in jax.devices()],
                platform_version=str(device.client.platform_version),
                device_memory_bytes=(stats or {}).get("bytes_limit"))
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
    if torch.cuda.is_available():  # torch.compile's max-autotune writes Triton kernels
        import triton
        info["triton"] = triton.__version__
    return info


def preflight() -> dict:
    """Part 1's, in a child with the items' environment: the versions, then every module
    the items use imported, the speedrun's optimiser built and a small program compiled
    and run. Raises on the first failure; the caller prints it as one line."""
    import importlib

    import jax
    import jax.numpy as jnp
    import torch

    info = versions()
    sys.path.insert(0, REPO)
    for module in ("main", "jaxtrain.bench", "jaxtrain.compare", "jaxtrain.run.loop",
                   "jaxtrain.baselines.torch_models", "jaxtrain.baselines.torch_optim",
                   "jaxtrain.perf.memory", "torchvision", "ml_collections", "tensorboardX",
                   "configs.cifar_speedrun", "configs.imagenet_resnet50", "configs.finetune"):
        importlib.import_module(module)
    from configs import cifar_speedrun
    from jaxtrain import models
    from jaxtrain.baselines import runner
    from jaxtrain.config import checks
    from jaxtrain.runtime import xla_flags
    from jaxtrain.training import model_state, optim

    runner.check_torch_device(info["backend"], torch.cuda.is_available(), torch.__version__)
    # Not a failure here: an item with a flag the device's XLA lacks fails in seconds, alone.
    info["xla_flags_unknown"] = xla_flags.unknown_names(
        name for text in XLA_SETTINGS.values() for name, _ in xla_flags.parse(text))
    config = cifar_speedrun.get_config()
    checks.check_config(config)
    model = models.create_model(config.model, 10, checks.compute_dtype(config.train.precision))
    params = model_state.abstract_init(model, config.model, (32, 32, 3))["params"]
    tx = optim.create_optimizer(config.optimizer, optim.create_schedule(config.optimizer, 100))
    opt_state = jax.eval_shape(tx.init, params)
    jax.eval_shape(tx.update, params, opt_state, params)
    x = jnp.ones((256, 256), jnp.bfloat16)
    jax.block_until_ready(jax.jit(lambda x: (x @ x).sum()).lower(x).compile()(x))
    info["preflight"] = "ok: modules imported, the speedrun's optimiser built, a program ran"
    return info


def preflight_part2(airbench_script: str) -> dict:
    """Part 2's: the versions, torch with CUDA where JAX has a GPU, Triton where torch has
    CUDA (max-autotune's kernels), the airbench script and whether it is the one read."""
    import torch

    info = versions()
    if info["backend"] == "gpu" and not torch.cuda.is_available():
        raise RuntimeError(f"JAX has the GPU but torch {torch.__version__} sees no CUDA device")
    if not os.path.isfile(airbench_script):
        raise FileNotFoundError(f"no {airbench_script}: prepare it first (benchmarks/gpu.py's "
                                "header: --prepare_airbench)")
    info["airbench"] = {"script": airbench_script, "sha256": file_sha256(airbench_script),
                        "reviewed": file_sha256(airbench_script) == AIRBENCH_SHA256}
    info["preflight"] = "ok: torch, the airbench script"
    return info


def write_airbench_data(batches_dir: str, folder: str) -> str:
    """cifar-10-batches-py as airbench's cifar10/train.pt and test.pt in `folder`, the
    layout its loader reads (what it saves from torchvision's CIFAR10 when they are
    missing): {"images": uint8 (N, 32, 32, 3), "labels": int64 (N,), "classes": names},
    in the batches' order."""
    import numpy as np
    import torch

    def read(name):
        with open(os.path.join(batches_dir, "cifar-10-batches-py", name), "rb") as f:
            return {k.decode() if isinstance(k, bytes) else k: v
                    for k, v in pickle.load(f, encoding="latin1").items()}

    classes = [c.decode() if isinstance(c, bytes) else str(c)
               for c in read("batches.meta")["label_names"]]
    out = os.path.join(folder, "cifar10")
    os.makedirs(out, exist_ok=True)
    for split, names in (("train", [f"data_batch_{i}" for i in range(1, 6)]),
                         ("test", ["test_batch"])):
        batches = [read(name) for name in names]
        images = np.concatenate([np.asarray(b["data"], np.uint8) for b in batches])
        images = np.ascontiguousarray(images.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1))
        labels = np.concatenate([np.asarray(b["labels"], np.int64) for b in batches])
        torch.save({"images": torch.from_numpy(images), "labels": torch.from_numpy(labels),
                    "classes": classes}, os.path.join(out, f"{split}.pt"))
    return out


AIRBENCH_COLUMNS = ("run", "epoch", "train_acc", "val_acc", "tta_val_acc", "time_seconds")


def parse_airbench(lines) -> dict:
    """airbench94_muon's output (or a part of it) as figures. It prints a table row per
    epoch and one per run's end, `|  run  |  eval  |  train_acc  |  val_acc  |
    tta_val_acc  |  time_seconds  |`, the run's name only on its first row ('warmup' for
    the untimed first run, then 0, 1, ...); its time is the run's training, whitening
    and TTA evaluation by CUDA events, without the per-epoch evaluations. After its 200
    runs: `Mean: A    Std: S`."""
    header, current, epochs, ends, mean_line = None, None, 0, [], None
    for line in lines:
        text = line.strip()
        if text.startswith("Mean:"):
            mean_line = text
            continue
        if not (text.startswith("|") and text.endswith("|") and len(text) > 1):
            continue
        cells = [cell.strip() for cell in text[1:-1].split("|")]
        if set(AIRBENCH_COLUMNS) <= set(cells):
            header = cells
            continue
        if header is None or len(cells) != len(header):
            continue
        row = dict(zip(header, cells))
        if row["run"]:
            current, epochs = row["run"], 0
        if row["epoch"] != "eval":
            epochs += 1
            continue
        try:
            end = {"run": int(current) if current.isdigit() else current, "epochs": epochs,
                   **{name: float(row[name]) for name in AIRBENCH_COLUMNS[2:] if row[name]}}
        except (ValueError, AttributeError):
            continue
        ends.append(end)
    runs = [end for end in ends if end["run"] != "warmup"]
    result = {"warmup": next((end for end in ends if end["run"] == "warmup"), None),
              "runs": runs, "finished": mean_line is not None, "mean_line": mean_line}
    if runs:
        accuracy = [run["tta_val_acc"] for run in runs]
        seconds = [run["time_seconds"] for run in runs]
        result.update(accuracy_mean=statistics.fmean(accuracy),
                      accuracy_std=statistics.pstdev(accuracy),
                      seconds_mean=statistics.fmean(seconds),
                      seconds_std=statistics.pstdev(seconds),
                      seconds_min=min(seconds), seconds_max=max(seconds))
    return result


def file_sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def run_airbench(script: str, folder: str, seconds: float, json_path: str,
                 stream=sys.stdout) -> int:
    """Runs airbench94_muon.py (or its stand-in) as published, in `folder` (where it reads
    cifar10/ and writes logs/), copying its output to `stream`; stops it with its process
    group (torch.compile's workers too) after `seconds`; writes what it finished to
    json_path after each run and at the end. Exit status 0 when a run finished."""
    script = os.path.abspath(script)
    report = {"script": script, "runs": [], "stopped_after_seconds": None}
    if not os.path.isfile(script):
        print(f"error: no {script}: prepare it first (benchmarks/gpu.py's header: "
              "--prepare_airbench)", file=stream, flush=True)
        return 1
    report.update(sha256=file_sha256(script), reviewed=file_sha256(script) == AIRBENCH_SHA256)
    source = os.path.join(os.path.dirname(script), "source.json")
    if os.path.isfile(source):
        with open(source) as f:
            report["source"] = json.load(f)
    start = time.perf_counter()
    child = subprocess.Popen([sys.executable, script], cwd=folder, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, errors="replace",
                             env=dict(os.environ, PYTHONUNBUFFERED="1"), start_new_session=True)
    stopped = threading.Event()

    def stop():
        stopped.set()
        try:
            os.killpg(child.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    timer = threading.Timer(seconds, stop)
    timer.start()
    lines, end_seconds = [], []  # end_seconds: when each run's last row came, from the start

    def write():
        parsed = parse_airbench(lines)
        for end, at in zip(filter(None, [parsed["warmup"], *parsed["runs"]]), end_seconds):
            end["wall_seconds"] = at
        report.update(parsed, seconds=time.perf_counter() - start)
        write_json(report, json_path)

    try:
        for line in child.stdout:
            stream.write(line)
            stream.flush()
            lines.append(line.rstrip("\n"))
            cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
            if len(cells) > 1 and cells[1] == "eval":
                end_seconds.append(time.perf_counter() - start)
                write()
        child.wait()
    finally:
        timer.cancel()
    if stopped.is_set():
        report["stopped_after_seconds"] = seconds
    report["exit"] = child.returncode
    write()
    done = len(report["runs"])
    print(f"airbench: {done} runs read" + (f" (stopped after {seconds:g} s)" if stopped.is_set()
                                           else f", exit {child.returncode}"),
          file=stream, flush=True)
    return 0 if done else 1


def prepare_airbench(source: str, folder: str = AIRBENCH_DIR) -> str:
    """airbench94_muon.py into `folder` (ignored by git, carried to the device) from
    `source`: the file itself, or a clone or git mirror of KellerJordan/cifar10-airbench
    (its AIRBENCH_COMMIT if it has it, else its HEAD); source.json beside it says
    whence. Returns the copy's path."""
    if os.path.isdir(source):
        commit = AIRBENCH_COMMIT
        found = subprocess.run(["git", "-C", source, "cat-file", "-e", f"{commit}^{{commit}}"],
                               capture_output=True)
        if found.returncode != 0:
            commit = subprocess.run(["git", "-C", source, "rev-parse", "HEAD"], check=True,
                                    capture_output=True, text=True).stdout.strip()
        text = subprocess.run(["git", "-C", source, "show", f"{commit}:airbench94_muon.py"],
                              check=True, capture_output=True).stdout
    else:
        commit = None
        with open(source, "rb") as f:
            text = f.read()
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "airbench94_muon.py")
    with open(path, "wb") as f:
        f.write(text)
    digest = hashlib.sha256(text).hexdigest()
    write_json({"repository": AIRBENCH_REPOSITORY, "commit": commit, "from": os.path.abspath(
        source), "sha256": digest, "reviewed": digest == AIRBENCH_SHA256},
        os.path.join(folder, "source.json"))
    return path


def parent_environment() -> dict:
    """What this process sees, written before any setup: the variables that change how
    XLA and its allocator behave, and the GPU as nvidia-smi reports it."""
    info = {"python": sys.version.split()[0], "argv": sys.argv[1:],
            "variables": {k: v for k, v in sorted(os.environ.items())
                          if k == "XLA_FLAGS" or k.startswith(("XLA_PYTHON_CLIENT_", "JAX_"))
                          or k in ("CUDA_VISIBLE_DEVICES", "CUDA_MODULE_LOADING",
                                   "TF_CPP_MIN_LOG_LEVEL", "NVIDIA_TF32_OVERRIDE")}}
    if shutil.which("nvidia-smi"):
        smi = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(SMI_FIELDS)}",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True)
        info["nvidia_smi"] = (smi.stdout + smi.stderr).strip()
        info["card"] = card_from_smi(smi.stdout)
    return info


# What nvidia-smi is asked about the card (fields every driver of the last years has).
SMI_FIELDS = ("name", "driver_version", "memory.total", "clocks.max.sm", "clocks.max.memory",
              "power.limit")
CARD_KEYS = ("name", "driver", "memory_mib", "max_sm_clock_mhz", "max_memory_clock_mhz",
             "power_limit_w")


def card_from_smi(text: str) -> dict | None:
    """The first GPU of nvidia-smi's `--query-gpu=SMI_FIELDS --format=csv,noheader,nounits`
    output, under CARD_KEYS (a field it cannot give, "[N/A]", is None); None when the
    output holds no such line."""
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.split(",")]
        if len(cells) != len(SMI_FIELDS) or not cells[0]:
            continue
        card = {}
        for key, cell in zip(CARD_KEYS, cells):
            if key in ("name", "driver"):
                card[key] = cell
                continue
            try:
                card[key] = float(cell)
            except ValueError:
                card[key] = None  # "[N/A]", "[Not Supported]"
        return card
    return None


def describe_card(smi_card: dict | None, child: dict | None) -> dict:
    """The card every figure of this call is from: nvidia-smi's view of it where there is
    one, with what JAX's allocator can hold on it (the largest-batch item's limit); on a
    machine without a GPU, the device JAX sees."""
    child = child or {}
    card = dict(smi_card) if smi_card else {
        "name": (child.get("devices") or ["unknown"])[0], **{key: None for key in CARD_KEYS[1:]}}
    card["jax_device_kind"] = (child.get("devices") or [None])[0]
    card["jax_memory_bytes"] = child.get("device_memory_bytes")
    return card


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
                        help="where gpu.json and the archives go (default: $OUT)")
    parser.add_argument("--part", type=int, choices=sorted(PARTS), default=1,
                        help="which device call: 1 (the plan, then the extras) or 2 "
                        "(airbench94_muon); each has its own budget")
    parser.add_argument("--data_dir", help="a folder holding cifar-10-batches-py (default: "
                        "decode .data/cifar10_jpeg.npz into a temporary folder)")
    parser.add_argument("--data_npz_dir", default=os.path.join(REPO, ".data"),
                        help="the carried cifar10_jpeg.npz and cifar10_jpeg.py")
    parser.add_argument("--wheels", default=os.path.join(REPO, ".whl"),
                        help="wheels the image lacks, installed first when present")
    parser.add_argument("--budget", type=float, default=None,
                        help=f"seconds for everything (default: the part's, "
                        f"{' and '.join(f'{b:g}' for b in BUDGETS.values())}; --dry: "
                        f"x{DRY_CAP_SCALE:g}); an item gets at most what is left")
    parser.add_argument("--caps", default="", help="NAME=SECONDS,...: other caps for these "
                        "steps or items (default: the plan's, x10 with --dry)")
    parser.add_argument("--runs", type=int, default=None,
                        help="timed runs of every speedrun item (default: each item's, 10 or "
                        "30; --dry: 2)")
    parser.add_argument("--only", default="", help="comma-separated item names to run")
    parser.add_argument("--dry", action="store_true",
                        help="tiny sizes, a few steps of every item: the CPU check CI runs "
                        "(the airbench item runs benchmarks/airbench_standin.py)")
    parser.add_argument("--plan", action="store_true",
                        help="print the plan (caps, expected seconds, yields) and exit")
    parser.add_argument("--prepare_airbench", metavar="PATH",
                        help="copy airbench94_muon.py into .airbench/ from PATH (the file, or "
                        "a clone or git mirror of KellerJordan/cifar10-airbench) and exit")
    parser.add_argument("--preflight", action="store_true", help=argparse.SUPPRESS)
    # The airbench item's own process (run_airbench): the script, its folder, its seconds.
    parser.add_argument("--airbench", help=argparse.SUPPRESS)
    parser.add_argument("--airbench_dir", help=argparse.SUPPRESS)
    parser.add_argument("--airbench_seconds", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--airbench_json", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.plan:
        print(plan_table(DRY_CAP_SCALE if args.dry else 1.0))
        return 0
    if args.prepare_airbench:
        try:
            path = prepare_airbench(args.prepare_airbench)
        except (OSError, subprocess.CalledProcessError) as error:
            print(f"error: --prepare_airbench={args.prepare_airbench}: {error}", file=sys.stderr)
            return 1
        with open(os.path.join(os.path.dirname(path), "source.json")) as f:
            source = json.load(f)
        print(f"{path}: commit {source['commit'] or '(a file)'}, sha256 {source['sha256'][:12]}"
              + ("" if source["reviewed"] else " (not the version read for issue #40)"))
        return 0
    if args.preflight:  # the child the setup runs: one JSON line, or one error line
        try:
            print(json.dumps(preflight_part2(args.airbench) if args.part == 2
                             else preflight()))
        except Exception as error:
            print(f"error: preflight: {type(error).__name__}: {error}".splitlines()[0])
            return 1
        return 0
    if args.airbench:
        return run_airbench(args.airbench, args.airbench_dir, args.airbench_seconds,
                            args.airbench_json)
    if not args.out:
        parser.error("--out is required when $OUT is not set")
    scratch = tempfile.mkdtemp(prefix="jaxtrain-gpu-")
    work, logs = os.path.join(scratch, "work"), os.path.join(scratch, "logs")
    start_weights = os.path.join(scratch, START_WEIGHTS)
    listed = items(args.data_dir or os.path.join(scratch, "data"),
                   os.path.join(scratch, "resnet_224.npz"), work, args.dry, args.runs,
                   start_weights, part=args.part,
                   airbench_script=AIRBENCH_STANDIN if args.dry else AIRBENCH_SCRIPT)
    names = {step.name for step, *_ in listed}
    only = {name for name in args.only.split(",") if name}
    if only - names:
        parser.error(f"--only: unknown item(s) {', '.join(sorted(only - names))}; choose from "
                     + ", ".join(step.name for step, *_ in listed)
                     + ("" if args.part == 2 else " (part 2: airbench94_muon)"))
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
    budget = args.budget if args.budget is not None else BUDGETS[args.part] * scale
    plan, extras = PARTS[args.part]
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(work)
    os.makedirs(logs)
    results_path = os.path.join(args.out, RESULTS[args.part])
    results = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "dry": args.dry, "part": args.part,
               "budget_seconds": budget, "environment": parent_environment(),
               "plan": [dict(step._asdict(), cap=caps.get(step.name, step.cap * scale))
                        for step in plan + extras], "setup": {}, "items": {}}
    write_json(results, results_path)  # before anything can fail
    env = dict(os.environ, PYTHONUNBUFFERED="1")

    def elapsed():
        return time.perf_counter() - start

    def cap_of(step):
        return caps.get(step.name, step.cap * scale)

    def run_logged(step, command, record: dict) -> str:
        """Runs command under the step's cap (and what the budget has left); fills record."""
        cap, left = cap_of(step), budget - elapsed()
        limit, why = (cap, f"its {cap:g} s cap") if cap <= left else (left, "the budget ran out")
        command = [arg.replace("{limit}", f"{max(limit - AIRBENCH_MARGIN, 1.0):.0f}")
                   for arg in command]
        record.update(command=" ".join(command), cap_seconds=cap)
        log_path = os.path.join(logs, f"{step.name}.log")
        if left < 5:
            record["status"] = f"skipped ({left:.0f} s of the budget left)"
            return record["status"]
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
    setup_steps = [step for step in plan if step.name in SETUP]
    site = os.path.join(scratch, "site")
    data_dir = args.data_dir or os.path.join(scratch, "data")
    commands = {
        "wheels": wheel_command(args.wheels, site),
        "data": None if args.data_dir else [
            sys.executable, os.path.join(args.data_npz_dir, "cifar10_jpeg.py"), "batches",
            data_dir],
        "preflight": [sys.executable, os.path.abspath(__file__), "--preflight",
                      f"--part={args.part}",
                      f"--airbench={AIRBENCH_STANDIN if args.dry else AIRBENCH_SCRIPT}"],
    }
    for step in setup_steps:
        name, record = step.name, {}
        results["setup"][name] = record
        command = commands[name]
        if command is None:
            record["status"] = "not needed"
        else:
            status = run_logged(step, command, record)
            if status == "ok" and name == "wheels":
                env["PYTHONPATH"] = os.pathsep.join(filter(None, [site, env.get("PYTHONPATH")]))
            if status == "ok" and name == "preflight":
                results["environment"]["child"] = last_json_line(
                    os.path.join(logs, "preflight.log"))
                results["card"] = describe_card(results["environment"].get("card"),
                                                results["environment"]["child"])
        record.setdefault("seconds", 0.0)
        results["total_seconds"] = elapsed()
        write_json(results, results_path)
        if record["status"] not in ("ok", "not needed"):
            print(f"-> {results_path}: setup step {name} {record['status']}: "
                  f"{record.get('error')}", flush=True)
            return 1

    def prepare(step) -> str | None:
        """What an item needs beyond the data, written before its first use; None, or
        why it could not be."""
        try:
            if step.name in RESNET_ITEMS and not os.path.exists(
                    os.path.join(scratch, "resnet_224.npz")):
                write_resnet_arrays(data_dir, os.path.join(scratch, "resnet_224.npz"), args.dry)
            if step.name == "finetune_resnet50_224" and not os.path.exists(
                    os.path.join(scratch, START_WEIGHTS)):
                write_start_weights(os.path.join(scratch, START_WEIGHTS), args.dry)
            if step.name == "airbench94_muon":
                write_airbench_data(data_dir, os.path.join(work, "airbench"))
        except (OSError, KeyError, ValueError, ImportError, pickle.UnpicklingError) as error:
            return f"preparing its inputs: {type(error).__name__}: {error}"
        return None

    for step, command, json_path in listed:
        if only and step.name not in only:
            continue
        entry = {"what": step.yields}
        results["items"][step.name] = entry
        if callable(command):  # built from the items before it
            command, entry["chosen"] = command(results["items"])
        failed_prepare = prepare(step)
        if failed_prepare:
            entry.update(command=" ".join(command), cap_seconds=cap_of(step), seconds=0.0,
                         status="failed", error=failed_prepare)
        else:
            run_logged(step, command, entry)
        if os.path.exists(json_path):  # also a cut-off item's finished runs or frameworks
            with open(json_path) as f:
                entry["result"] = json.load(f)
        results["ratios"] = ratios(results["items"], (results.get("card") or {}).get("name"))
        traces = os.path.join(work, "profile", step.name.removeprefix("inspect_"))
        if step.name.startswith("inspect_") and os.path.isdir(traces):
            archive_trace(traces, os.path.join(args.out, f"profile_{step.name}.tar.gz"))
        results["total_seconds"] = elapsed()
        write_json(results, results_path)
    failed = [name for name, entry in results["items"].items() if entry["status"] != "ok"]
    print(f"-> {results_path} ({results['total_seconds']:.0f} s)"
          + (f"; not ok: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
