"""Classify image files with a trained run: `python -m jaxtrain.predict WORKDIR PATH...`.

PATHs are image files or folders of them (walked recursively; JPEG, PNG, BMP,
WebP in any mode and size), decoded and resized as the run's data were, and
printed one line per image: the path, then the --top most probable classes with
their probabilities (--json: one JSON object per line). A file that cannot be
read is one line on stderr (--json: a JSON object with its path and the error);
the others are still classified, and the exit status is then 1. A WORKDIR without a
checkpoint, or a bad flag: one line, exit 2.
"""
import json
import sys

from absl import app, flags, logging

from jaxtrain.cli import usage_error

FLAGS = flags.FLAGS
FAILED = 1  # exit status: some files could not be classified (the rest were)


def format_line(path: str, top: list[tuple[str, float]]) -> str:
    return f"{path}: " + ", ".join(f"{name} {probability:.4f}" for name, probability in top)


def format_json(path: str, label: int, top: list[tuple[str, float]], class_names) -> str:
    return json.dumps({"path": path, "label": label, "class": class_names[label],
                       "top": [{"class": name, "label": class_names.index(name),
                                "probability": round(probability, 6)}
                               for name, probability in top]})


def main(argv):
    from jaxtrain.inference import classifier as classifier_lib
    from jaxtrain.training import checkpoint
    logging.set_verbosity(logging.WARNING)  # Orbax's restore logs a page at INFO
    if len(argv) < 3:
        usage_error("usage: python -m jaxtrain.predict WORKDIR PATH... [--top=3] "
                    "[--checkpoint=STEP|best] [--json]")
    workdir, paths = argv[1], argv[2:]
    try:
        classifier = classifier_lib.restore_for(workdir, FLAGS.checkpoint, FLAGS.weights,
                                                FLAGS.tta, model=FLAGS.model)
    except (checkpoint.CheckpointError, ValueError) as error:
        usage_error(str(error).splitlines()[0])
    result = classifier.predict_files(paths)
    for path, why in result.errors:  # --json: a JSON line each, as the results are
        print(json.dumps({"path": path, "error": why}) if FLAGS.json else
              f"error: {path}: {why}" if not why.startswith(path) else f"error: {why}",
              file=sys.stderr)
    k = min(FLAGS.top, len(result.class_names))
    for i, path in enumerate(result.paths):
        top = result.top(i, k)
        print(format_json(path, int(result.labels[i]), top, result.class_names) if FLAGS.json
              else format_line(path, top))
    sys.stdout.flush()
    sys.exit(FAILED if result.errors else 0)


def define_flags():
    flags.DEFINE_integer("top", 3, "How many of the most probable classes to print per image.",
                         lower_bound=1)
    flags.DEFINE_string("checkpoint", None, "A step number, or 'best' (the run's "
                        "checkpoint.best_metric), instead of the newest checkpoint.")
    flags.DEFINE_enum("weights", "raw", ["raw", "ema"], "ema: the moving average of the weights "
                      "a train.ema_decay run kept.")
    flags.DEFINE_enum("tta", None, ["none", "flip", "flip_translate"],
                      "Test-time augmentation (default: the run's eval.tta).")
    flags.DEFINE_bool("json", False, "One JSON object per line: path, label, class, top "
                      "[{class, label, probability}].")
    define_model_flag()


def define_model_flag():
    """--model, for predict and export: a run trained on a model passed from Python."""
    flags.DEFINE_string("model", None, "package.module:ClassName: the class of the model a run "
                        "was given from Python (train_and_evaluate(model=...)), built as a "
                        "model.name is (default: the class the run recorded, if importable).")


def parse_flags(argv):
    """absl's parsing with one-line errors (exit status 2), for this CLI and export's."""
    try:
        return FLAGS(argv)
    except flags.Error as error:
        usage_error(str(error).splitlines()[0])


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=parse_flags)
