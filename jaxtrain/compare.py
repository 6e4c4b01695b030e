"""Train one config with jaxtrain and with PyTorch; compare time and accuracy.

    python -m jaxtrain.compare --config=configs/cifar_seed_cnn.py [--config.KEY=VALUE ...] \
        [--frameworks=jax,torch_article,torch_fast] [--workdir=runs/compare]

The frameworks (jax, torch_article, torch_fast), how each is timed and what
compare.json and compare.png hold: jaxtrain/baselines/runner.py. torch is
imported only when a torch framework runs."""
import sys

from jaxtrain import data
from jaxtrain.baselines import runner
from jaxtrain.errors import ConfigError, TrainingError


def define_flags():
    from absl import flags
    from ml_collections import config_flags

    config_flags.DEFINE_config_file("config", None, "Path to a config file with get_config().",
                                    lock_config=True)
    flags.DEFINE_list("frameworks", list(runner.FRAMEWORKS), "Comma-separated, run in this order: "
                      + ", ".join(runner.FRAMEWORKS))
    flags.DEFINE_string("workdir", "runs/compare", "Where compare.json, compare.png and "
                        "jaxtrain's run (in jax/, started afresh) go.")
    flags.DEFINE_enum("torch_compile", "auto", ["auto", "on", "off"],
                      "torch_fast: torch.compile the model; auto = on CUDA only.")
    flags.DEFINE_enum("torch_compile_mode", runner.DEFAULT_COMPILE_MODE,
                      list(runner.TORCH_COMPILE_MODES),
                      "torch_fast: torch.compile's first mode to try; past --torch_compile_cap "
                      "or failing it falls back to 'default', then to no compilation (the CPU "
                      "takes 'default'); compare.json's measures record what ran and why.")
    flags.DEFINE_float("torch_compile_cap", runner.DEFAULT_COMPILE_CAP,
                       "torch_fast: seconds --torch_compile_mode (unless 'default') may take to "
                       "compile and warm up before torch_fast falls back to 'default'.",
                       lower_bound=0.001)
    flags.DEFINE_enum("torch_bfloat16", "auto", ["auto", "on", "off"],
                      "torch_fast with train.precision='bfloat16': weights (BatchNorm aside, "
                      "float32 master weights stepped) and Newton-Schulz in bfloat16; "
                      "auto = on CUDA only (autocast on the CPU).")
    flags.mark_flag_as_required("config")
    flags.register_validator(
        "frameworks", lambda names: bool(names) and all(n in runner.FRAMEWORKS for n in names),
        message="--frameworks must be a comma-separated list of: " + ", ".join(runner.FRAMEWORKS))


def main(argv):
    from absl import app, flags, logging

    logging.set_verbosity(logging.WARNING)
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    FLAGS = flags.FLAGS
    switch = {"auto": None, "on": True, "off": False}
    try:
        runner.run(FLAGS.config, FLAGS.frameworks, FLAGS.workdir,
                   torch_compile=switch[FLAGS.torch_compile],
                   torch_compile_mode=FLAGS.torch_compile_mode,
                   torch_compile_cap=FLAGS.torch_compile_cap,
                   torch_bfloat16=switch[FLAGS.torch_bfloat16])
    except (runner.CompareError, data.DataError, ConfigError, TrainingError) as error:
        sys.exit(f"error: {error}")


if __name__ == "__main__":
    from absl import app

    from jaxtrain.cli import parse_flags

    define_flags()
    app.run(main, flags_parser=parse_flags)
