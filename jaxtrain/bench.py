"""Speed: the speedrun benchmark and the XLA inspection report.

    python -m jaxtrain.bench --config=configs/cifar_speedrun.py --runs=10 [--json=FILE]
        [--devices=N] [--compilation_cache=DIR] [--whole_process]
    python -m jaxtrain.bench --config=configs/cifar.py --inspect [--profile=DIR] [--json=FILE]
        [--hlo=FILE]
    python -m jaxtrain.bench --config=configs/imagenet_resnet50.py --input-only [--batches=N]
    python -m jaxtrain.bench --config=configs/imagenet_resnet50.py --memory [--json=FILE]

- the benchmark: each seed's run from its first step to its test accuracy, as the
  public speedruns time it, compiled once for all seeds; --whole_process: the whole
  process, cold and then with the compilation cache warm (jaxtrain/perf/benchmark.py).
- --inspect: one training step as XLA compiled it, its FLOPs and time; --profile adds a
  trace's costliest ops and kernels (jaxtrain/perf/inspection.py).
- --input-only: the streaming input pipeline alone (jaxtrain/perf/benchmark.py).
- --memory: what one step needs per device, compiled for shapes only
  (jaxtrain/perf/memory.py): the effect of train.accumulate_steps, model.remat and
  parallel.fsdp, seen before a run is started."""
import functools
import sys

from jaxtrain.perf import benchmark  # first: its clock starts the whole-process time
from jaxtrain import data
from jaxtrain.config import checks
from jaxtrain.errors import ConfigError, TrainingError
from jaxtrain.perf import inspection, memory
from jaxtrain.perf.benchmark import UsageError
from jaxtrain.runtime import processes, report


def main(argv):
    from absl import flags
    from absl import logging
    from ml_collections import config_flags

    FLAGS = flags.FLAGS
    logging.set_verbosity(logging.WARNING)
    if len(argv) > 1:
        sys.exit(f"error: unexpected arguments: {' '.join(argv[1:])}")
    distributed = (FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id)
    try:
        if FLAGS.inspect and (FLAGS["devices"].present or FLAGS.whole_process):
            raise UsageError("--devices and --whole_process are for the benchmark; --inspect "
                             "compiles for every device")
        input_only_flag = FLAGS["input-only"].value
        if input_only_flag and (FLAGS.inspect or FLAGS.whole_process):
            raise UsageError("--input-only times the input pipeline alone; drop --inspect "
                             "and --whole_process")
        if FLAGS.memory and (FLAGS.inspect or input_only_flag or FLAGS.whole_process
                             or FLAGS["devices"].present):
            raise UsageError("--memory compiles one step for every device and runs nothing; "
                             "drop --inspect, --input-only, --whole_process and --devices")
        if FLAGS.profile and not FLAGS.inspect:
            raise UsageError("--profile traces the steps --inspect compiles; add --inspect")
        if FLAGS.hlo and not FLAGS.inspect:
            raise UsageError("--hlo writes the step --inspect compiles; add --inspect")
        if FLAGS.whole_process:  # the child processes check the config, each a command
            if processes.distributed_settings(*distributed) is not None:
                raise UsageError("--whole_process runs single-process benchmarks only")
            result = benchmark.whole_process(sys.argv[1:], FLAGS.compilation_cache)
        else:
            checks.check_config(FLAGS.config)  # once, here, for whichever report runs
            if FLAGS.compilation_cache:
                benchmark.enable_compilation_cache(FLAGS.compilation_cache)
            processes.initialize(*distributed)
            if FLAGS.memory:
                result = memory.step_memory(FLAGS.config)
                if processes.is_main_process():
                    print(memory.describe(result), flush=True)
            elif input_only_flag:
                result = benchmark.input_only(FLAGS.config, FLAGS.batches)
            elif FLAGS.inspect:
                result = inspection.inspect(
                    FLAGS.config, FLAGS.steps, FLAGS.profile, FLAGS.repeats,
                    inspection.hlo_path(FLAGS.hlo, FLAGS.profile, FLAGS.json))
                if processes.is_main_process():
                    inspection.print_inspection(
                        result, config_flags.get_config_filename(FLAGS["config"]))
            else:
                write = FLAGS.json and processes.is_main_process()
                result = benchmark.benchmark(
                    FLAGS.config, FLAGS.runs, FLAGS.warmup, FLAGS.seed, FLAGS.devices,
                    progress=(functools.partial(report.write_json_atomically, FLAGS.json)
                              if write else None))
    except (data.DataError, ConfigError, TrainingError, processes.DistributedError, UsageError,
            benchmark.ChildFailed) as error:
        sys.exit(f"error: {error}")
    # (--whole_process: this process asks no device anything, not even its process index)
    if FLAGS.json and (FLAGS.whole_process or processes.is_main_process()):
        report.write_json_atomically(FLAGS.json, result)


def define_flags():
    from absl import flags
    from ml_collections import config_flags

    config_flags.DEFINE_config_file("config", None, "Path to a config file with get_config().",
                                    lock_config=True)
    flags.DEFINE_integer("runs", 10, "Timed runs, seeds --seed, --seed + 1, ...; 0: compile only.",
                         lower_bound=0)
    flags.DEFINE_integer("warmup", 1, "Untimed runs before the timed ones (same program).",
                         lower_bound=0)
    flags.DEFINE_integer("seed", None, "First seed (default: config.seed).")
    flags.DEFINE_integer("devices", 1, "Benchmark on the first N devices (the public records "
                         "use one GPU).")
    flags.DEFINE_string("compilation_cache", None, "Keep compiled programs in this folder "
                        "(JAX's persistent compilation cache), for later processes to reuse.")
    flags.DEFINE_bool("whole_process", False, "Run the benchmark twice in new processes, with "
                      "an empty compilation cache and then the one the first run wrote, and "
                      "report both whole-process times.")
    flags.DEFINE_bool("inspect", False, "Report XLA kernels, FLOPs and speed of one train "
                      "step instead of benchmarking.")
    flags.DEFINE_integer("steps", 10, "--inspect: steps in the timed chunk.", lower_bound=1)
    flags.DEFINE_integer("repeats", 5, "--inspect: timed chunks; the step time is the "
                         "fastest.", lower_bound=1)
    flags.DEFINE_bool("input-only", False, "Time the streaming input pipeline alone "
                      "(images/s read, decoded and put on the devices; no training).")
    flags.DEFINE_bool("memory", False, "Print what the config's train step needs per device "
                      "(XLA's memory analysis of the step compiled for shapes only; nothing "
                      "is initialised or run).")
    flags.DEFINE_integer("batches", 50, "--input-only: batches to time.", lower_bound=1)
    flags.DEFINE_string("profile", None, "--inspect: also trace one chunk of --steps steps "
                        "with jax.profiler into this folder (TensorBoard, Perfetto) and list "
                        "the ten XLA ops and the 60 kernels (by name) that took the most "
                        "time.")
    flags.DEFINE_string("hlo", None, "--inspect: write the train step's optimised HLO text "
                        "(gzip) here; default: train_step.hlo.txt.gz in the --profile folder, "
                        "else FILE.hlo.txt.gz beside --json=FILE.json.")
    flags.DEFINE_string("json", None, "Also write the results to this JSON file.")
    flags.DEFINE_string("coordinator_address", None, "Multi-process runs, as in main.py.")
    flags.DEFINE_integer("num_processes", None, "Multi-process runs, as in main.py.")
    flags.DEFINE_integer("process_id", None, "Multi-process runs, as in main.py.")
    flags.mark_flags_as_required(["config"])


if __name__ == "__main__":
    from absl import app

    from jaxtrain.cli import parse_flags

    define_flags()
    app.run(main, flags_parser=parse_flags)
