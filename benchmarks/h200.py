"""Every GPU figure jaxtrain reports, from one prepared run on one H200.

GPU time comes in short loans (about 15 minutes, machine start included), so
everything is measured by this one script, most important first, within a
time budget (default 9 minutes). Each item is one of jaxtrain's own commands
run as a child process, so a figure here is what a user gets from that
command. After every item $OUT/h200.json (every item's command, status,
seconds and the JSON the command wrote) and $OUT/logs.tar.gz (their output)
are rewritten, so a cut-off run still reports what it finished; the profiler
traces come back as $OUT/profile_<item>.tar.gz. (The device returns at most 8
files from $OUT, hence the archives.)

Prepare, once, in the repository root of the development machine (the device
has no network; .gitignore lists both folders, and they travel with `carry`):

    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \\
        --implementation cp --platform manylinux2014_x86_64 -d .whl \\
        ml_collections==1.1.0 tensorboardX==2.6.4
    mkdir -p .data && cp ../shared/data/cifar10_jpeg.npz ../shared/data/cifar10_jpeg.py .data/

Run on the device (device tool: carry [".whl", ".data"], timeout_s=600):

    python3 benchmarks/h200.py --out=$OUT

An item that fails is recorded in h200.json (its status and the last lines of
its output) and the script goes on to the next one.

It installs the wheels in .whl (the image has jax, flax, optax, orbax and torch,
not ml_collections or tensorboardX) into a private folder, decodes the CIFAR-10
JPEG copy in .data into the cifar-10-batches-py layout, then runs the items.

The same script on a CPU with tiny sizes, a few steps of every item but the
extras, so it cannot break between GPU loans (CI runs one item per command:
tests/test_h200.py; run them all before a loan):

    python3 benchmarks/h200.py --dry --data_dir=DIR --out=/tmp/h200
"""
import argparse
import json
import os
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

# Tiny sizes for --dry: every item's code path, a few steps each.
DRY_SPEEDRUN = ("--config.model.widths=(8,16,16)", "--config.model.stem_width=12",
                "--config.train.batch_size=200", "--config.train.num_steps=4",
                "--config.eval.batch_size=250")
DRY_CIFAR = ("--config.model.widths=(8,16,16)", "--config.model.stem_width=8",
             "--config.train.batch_size=100", "--config.train.num_steps=4",
             "--config.eval.batch_size=250")
DRY_SEED = ("--config.train.num_steps=20", "--config.train.log_every_steps=10",
            "--config.eval.batch_size=250")


def items(data_dir: str, work: str, dry: bool) -> list:
    """(name, command, JSON file the command writes, what the item is) in the order run:
    the figures that matter most first."""
    python = [sys.executable]
    data = f"--config.data.dir={data_dir}"
    speedrun = [f"--config={SPEEDRUN}", data, *(DRY_SPEEDRUN if dry else ())]
    cifar = ["--config=configs/cifar.py", data, *(DRY_CIFAR if dry else ())]
    seed = ["--config=configs/cifar_seed_cnn.py", data, *(DRY_SEED if dry else ())]
    runs = ["--runs=2", "--warmup=0"] if dry else ["--runs=10"]
    steps = "--steps=2" if dry else "--steps=20"

    def path(name):
        return os.path.join(work, name)

    listed = [
        ("speedrun", python + ["-m", "jaxtrain.bench", *speedrun, *runs,
                               f"--json={path('speedrun.json')}"], path("speedrun.json"),
         "the speedrun: per-run and mean/std accuracy and seconds, compile seconds"),
        ("speedrun_whole_process",
         python + ["-m", "jaxtrain.bench", *speedrun, "--runs=1", "--warmup=0",
                   "--whole_process", f"--compilation_cache={path('xla')}",
                   f"--json={path('speedrun_whole_process.json')}"],
         path("speedrun_whole_process.json"),
         "one speedrun run as a user starts it: whole process cold, then with a warm cache"),
        ("inspect_speedrun",
         python + ["-m", "jaxtrain.bench", *speedrun, "--inspect", steps,
                   f"--profile={path('profile/speedrun')}",
                   f"--json={path('inspect_speedrun.json')}"], path("inspect_speedrun.json"),
         "the speedrun's step: kernels by kind, FLOPs, TFLOP/s, fraction of peak, top ops"),
        ("inspect_cifar",
         python + ["-m", "jaxtrain.bench", *cifar, "--inspect", steps,
                   f"--profile={path('profile/cifar')}",
                   f"--json={path('inspect_cifar.json')}"], path("inspect_cifar.json"),
         "configs/cifar.py's step: the same report"),
        ("cifar_train",
         python + ["main.py", *cifar, f"--workdir={path('cifar')}"],
         path("cifar/summary.json"),
         "configs/cifar.py trained once in full: test accuracy, train and compile seconds"),
        ("compare_speedrun",
         python + ["-m", "jaxtrain.compare", *speedrun, "--frameworks=jax,torch_fast",
                   f"--workdir={path('compare_speedrun')}"],
         path("compare_speedrun/compare.json"),
         "the speedrun recipe in jaxtrain and in PyTorch (torch.compile), side by side"),
        ("compare_seed",
         python + ["-m", "jaxtrain.compare", *seed,
                   "--frameworks=jax,torch_article,torch_fast",
                   f"--workdir={path('compare_seed')}"],
         path("compare_seed/compare.json"),
         "the seed article's recipe in jaxtrain, the article's PyTorch and the fastest PyTorch"),
        ("seed_single",
         python + ["main.py", *seed, f"--workdir={path('seed_single')}"],
         path("seed_single/summary.json"),
         "the seed recipe trained once: the images/s one run gets from the chip"),
        ("seed_64_replicas",
         python + ["main.py", *seed, "--config.train.replicas=" + ("4" if dry else "64"),
                   f"--workdir={path('seed_64_replicas')}"],
         path("seed_64_replicas/summary.json"),
         "64 seeds of the seed recipe in one program (train.replicas): images/s per replica "
         "against seed_single's, and the spread of test accuracy"),
    ]
    if dry:  # the extras below are the first item with another epoch count: nothing new
        return listed
    # Extras, if time is left: the speedrun's epoch count chosen on this data (the record's 8
    # is its choice on the original CIFAR-10).
    for epochs in (7, 9):
        name = f"speedrun_{epochs}_epochs"
        listed.append((name, python + ["-m", "jaxtrain.bench", *speedrun,
                                       f"--config.train.num_epochs={epochs}", *runs,
                                       f"--json={path(name + '.json')}"], path(name + ".json"),
                       f"the speedrun with {epochs} epochs instead of 8"))
    return listed


def run_item(command: list, log_path: str, timeout: float, env: dict) -> tuple[str, float]:
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
            status = f"stopped after {timeout:.0f} s (out of time)"
    return status, time.perf_counter() - start


def last_error(log_path: str) -> str | None:
    with open(log_path) as f:
        lines = [line.strip() for line in f if line.strip()]
    return next((line for line in reversed(lines) if line.startswith("error:")),
                lines[-1] if lines else None)


def install_wheels(wheels: str, target: str) -> str | None:
    """pip-installs every wheel in `wheels` into `target` (no index, no dependencies);
    returns target for PYTHONPATH, or None when there are no wheels."""
    found = sorted(f for f in os.listdir(wheels) if f.endswith(".whl")) if os.path.isdir(
        wheels) else []
    if not found:
        return None
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                    "--no-compile", "--no-cache-dir", "--upgrade", "--target", target,
                    *(os.path.join(wheels, f) for f in found)], check=True)
    return target


def decode_cifar(npz_dir: str, target: str) -> str:
    """The shared JPEG copy (cifar10_jpeg.npz and its script, carried in npz_dir) written
    as target/cifar-10-batches-py; returns target."""
    if not os.path.isdir(os.path.join(target, "cifar-10-batches-py")):
        subprocess.run([sys.executable, os.path.join(npz_dir, "cifar10_jpeg.py"), "batches",
                        target], check=True, stdout=subprocess.DEVNULL)
    return target


def environment(env: dict) -> dict:
    """Versions and the GPU, as the children see them."""
    probe = ("import json, jax, flax, optax, sys\n"
             "info = {'python': sys.version.split()[0], 'jax': jax.__version__,"
             " 'flax': flax.__version__, 'optax': optax.__version__,"
             " 'backend': jax.default_backend(),"
             " 'devices': [d.device_kind for d in jax.devices()]}\n"
             "try:\n    import torch; info['torch'] = torch.__version__\n"
             "except ImportError:\n    info['torch'] = None\n"
             "print(json.dumps(info))")
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO, env=env,
                            capture_output=True, text=True)
    info = (json.loads(result.stdout.strip().splitlines()[-1]) if result.returncode == 0
            else {"error": result.stderr.strip().splitlines()[-1:]})
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
    with open(log_path) as f:
        return "".join(f.readlines()[-lines:])


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
    parser.add_argument("--budget", type=float, default=540.0,
                        help="seconds for everything; an item is stopped when it runs out")
    parser.add_argument("--only", default="", help="comma-separated item names to run")
    parser.add_argument("--dry", action="store_true",
                        help="tiny sizes, a few steps of every item: the CPU check CI runs")
    args = parser.parse_args(argv)
    if not args.out:
        parser.error("--out is required when $OUT is not set")
    scratch = tempfile.mkdtemp(prefix="jaxtrain-h200-")
    work, logs = os.path.join(scratch, "work"), os.path.join(scratch, "logs")
    listed = items(args.data_dir or os.path.join(scratch, "data"), work, args.dry)
    only = {name for name in args.only.split(",") if name}
    unknown = only - {name for name, *_ in listed}
    if unknown:
        parser.error(f"--only: unknown item(s) {', '.join(sorted(unknown))}; choose from "
                     + ", ".join(name for name, *_ in listed))
    try:
        return run_all(args, listed, only, scratch, work, logs)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def run_all(args, listed: list, only: set, scratch: str, work: str, logs: str) -> int:
    start = time.perf_counter()
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(work)
    os.makedirs(logs)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    site = install_wheels(args.wheels, os.path.join(scratch, "site"))
    if site:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [site, env.get("PYTHONPATH")]))
    if not args.data_dir:
        decode_cifar(args.data_npz_dir, os.path.join(scratch, "data"))
    results = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "dry": args.dry,
               "budget_seconds": args.budget, "environment": environment(env),
               "setup_seconds": time.perf_counter() - start, "items": {}}
    results_path = os.path.join(args.out, RESULTS)
    for name, command, json_path, what in listed:
        if only and name not in only:
            continue
        left = args.budget - (time.perf_counter() - start)
        entry = {"what": what, "command": " ".join(command)}
        if left < 5:
            entry["status"] = f"skipped ({left:.0f} s of the budget left)"
        else:
            log_path = os.path.join(logs, f"{name}.log")
            entry["status"], entry["seconds"] = run_item(command, log_path, left, env)
            if entry["status"] != "ok":
                entry["error"] = last_error(log_path)
            if os.path.exists(json_path):  # also a cut-off compare's finished frameworks
                with open(json_path) as f:
                    entry["result"] = json.load(f)
            print(f"--- {name}: {entry['status']} in {entry['seconds']:.1f} s\n"
                  + log_tail(log_path), end="", flush=True)
            archive(logs, os.path.join(args.out, "logs.tar.gz"))
            traces = os.path.join(work, "profile", name.removeprefix("inspect_"))
            if os.path.isdir(traces):
                archive_trace(traces, os.path.join(args.out, f"profile_{name}.tar.gz"))
        results["items"][name] = entry
        results["total_seconds"] = time.perf_counter() - start
        write_json(results, results_path)
    failed = [name for name, entry in results["items"].items() if entry["status"] != "ok"]
    print(f"-> {results_path} ({results['total_seconds']:.0f} s)"
          + (f"; not ok: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
