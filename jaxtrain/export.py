"""A trained run as a file other programs run: `python -m jaxtrain.export WORKDIR
--format=onnx|stablehlo --out=FILE [--batch=N]`.

What the exported function takes and gives, and the two formats:
jaxtrain/inference/exporters.py."""
from jaxtrain.inference import exporters


def main(argv):
    from absl import flags
    from absl import logging as absl_logging

    from jaxtrain.cli import usage_error
    from jaxtrain.training import checkpoint
    FLAGS = flags.FLAGS
    absl_logging.set_verbosity(absl_logging.WARNING)  # Orbax's restore logs a page at INFO
    if len(argv) != 2:
        usage_error("usage: python -m jaxtrain.export WORKDIR --format=onnx|stablehlo "
                    "--out=FILE [--batch=N]")
    platforms = tuple(p.strip() for p in FLAGS.platforms.split(",") if p.strip())
    try:
        description = exporters.export(argv[1], FLAGS.format, FLAGS.out, FLAGS.batch,
                                       checkpoint=FLAGS.checkpoint, tta=FLAGS.tta,
                                       weights=FLAGS.weights, precision=FLAGS.precision,
                                       platforms=platforms, opset=FLAGS.opset,
                                       model=FLAGS.model)
    except (exporters.ExportError, checkpoint.CheckpointError, ValueError) as error:
        usage_error(str(error).splitlines()[0])
    batch = "a dynamic batch" if FLAGS.batch is None else f"batch {FLAGS.batch}"
    print(f"wrote {FLAGS.out} ({description['bytes'] / 1e6:.1f} MB, {FLAGS.format}, {batch} of "
          f"uint8 {'x'.join(map(str, description['input']['shape'][1:]))} -> "
          f"{len(description['class_names'])} class probabilities) and {FLAGS.out}.json")


def define_flags():
    from absl import flags
    flags.DEFINE_enum("format", None, list(exporters.FORMATS), "onnx (onnxruntime) or stablehlo "
                      "(jax.export).")
    flags.DEFINE_string("out", None, "The file to write; FILE.json is written beside it.")
    flags.DEFINE_integer("batch", None, "A fixed batch size (default: dynamic).")
    flags.DEFINE_string("checkpoint", None, "A step number, or 'best', instead of the newest.")
    flags.DEFINE_enum("tta", None, ["none", "flip", "flip_translate"],
                      "Test-time augmentation inside the exported function (default: the "
                      "run's eval.tta, as jaxtrain.predict applies it).")
    flags.DEFINE_enum("weights", "raw", ["raw", "ema"], "ema: a train.ema_decay run's average.")
    flags.DEFINE_enum("precision", "float32", ["float32", "bfloat16"],
                      "What the exported model computes in (onnx: float32 only).")
    flags.DEFINE_string("platforms", ",".join(exporters.PLATFORMS), "stablehlo: the platforms to "
                        "lower for, comma-separated (cpu, cuda, rocm, tpu).")
    flags.DEFINE_integer("opset", exporters.ONNX_OPSET, "onnx: the ONNX opset to write, from "
                         f"{exporters.MIN_ONNX_OPSET} ({exporters.MIN_TTA_OPSET} with TTA "
                         f"inside) to {exporters.ONNX_OPSET}: older runtimes and converters "
                         "read the older ones.")
    flags.mark_flags_as_required(["format", "out"])
    from jaxtrain import predict
    predict.define_model_flag()


if __name__ == "__main__":
    from absl import app

    from jaxtrain import predict
    define_flags()
    app.run(main, flags_parser=predict.parse_flags)
