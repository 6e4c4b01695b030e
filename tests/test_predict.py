"""jaxtrain.predict on real image files of mixed sizes and modes: the same classes and
probabilities as restore().predict on the arrays the run's own folder loader makes of them."""
import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from tolerances import ELEMENTWISE
import fork_server

import jaxtrain
from jaxtrain.config.defaults import get_config
from jaxtrain.data import folder
from jaxtrain.run import loop

REPO = Path(__file__).resolve().parents[1]
IMAGE_SIZE = 24  # the run resizes its 32 px CIFAR JPEGs, so every file here is resized too


@pytest.fixture(scope="module")
def folder_run(cifar_jpeg_folder, tmp_path_factory):
    """A short seed_cnn run (BatchNorm) trained on a folder of real CIFAR-10 JPEGs at 24 px."""
    config = get_config()
    config.data.name, config.data.dir = "folder", str(cifar_jpeg_folder)
    config.data.image_size, config.data.resize = IMAGE_SIZE, "crop"
    config.model.name, config.model.batch_norm = "seed_cnn", True
    config.train.precision = "float32"
    config.train.batch_size, config.train.num_steps = 64, 6
    config.optimizer.learning_rate = 0.05
    workdir = str(tmp_path_factory.mktemp("folder_run"))
    loop.train_and_evaluate(config, workdir)
    return workdir


@pytest.fixture(scope="module")
def photos(cifar_jpeg_folder, tmp_path_factory):
    """A user's folder: real photographs and CIFAR images in every mode and format the
    CLI reads (RGB/L/RGBA/P/I;16 PNG, JPEG, grey JPEG, BMP, WebP), of mixed sizes, in
    nested folders, beside a file that is not an image. Returns (root, good files)."""
    import skimage
    from PIL import Image

    samples = Path(skimage.__file__).parent / "data"
    root = tmp_path_factory.mktemp("photos")
    (root / "nested" / "deeper").mkdir(parents=True)
    cifar = sorted((cifar_jpeg_folder / "test").rglob("*.jpg"))[:6]
    for i, path in enumerate(cifar):  # the shared copy's own JPEG bytes, 32 x 32 RGB
        shutil.copy(path, root / f"cifar_{i}.jpg")
    Image.open(samples / "astronaut.png").save(root / "astronaut_rgb.png")       # RGB 512 x 512
    Image.open(samples / "camera.png").save(root / "nested" / "camera_l.png")   # L
    Image.open(samples / "logo.png").save(root / "logo_rgba.png")                # RGBA
    Image.open(samples / "coffee.png").convert("P").save(root / "coffee_p.png")  # palette, 600 x 400
    Image.open(samples / "chelsea.png").save(root / "nested" / "chelsea.bmp")   # BMP 451 x 300
    Image.open(samples / "rocket.jpg").save(root / "nested" / "deeper" / "rocket.webp")
    Image.open(samples / "coins.png").save(root / "coins_grey.jpg", quality=90)  # grey JPEG
    wide = np.asarray(Image.open(samples / "moon.png"), np.uint16) * 257
    Image.fromarray(wide[:100, :300]).save(root / "moon_16bit.png")              # I;16, 300 x 100
    (root / "notes.txt").write_text("not an image: predict skips it in a folder")
    good = sorted(str(p) for p in root.rglob("*") if p.suffix != ".txt" and p.is_file())
    return root, good


@pytest.fixture(scope="module")
def loader_arrays(photos, tmp_path_factory, folder_run):
    """The good files as the run's data loader sees them: laid out as a training folder
    (a flat copy in one class) and decoded by folder.load_folder at the run's size."""
    _, good = photos
    tree = tmp_path_factory.mktemp("as_training_folder")
    names = []
    for i, path in enumerate(good):
        name = f"{i:03d}{Path(path).suffix}"
        names.append(name)
        for split in ("train", "test"):
            (tree / split / "all").mkdir(parents=True, exist_ok=True)
            shutil.copy(path, tree / split / "all" / name)
    data = folder.load_folder(tree, image_size=IMAGE_SIZE, resize="crop", workers=1,
                              cache_dir=None)
    assert len(data.x_test) == len(good)
    return dict(zip(good, data.x_test))


def truncated_copy(source, target):
    blob = Path(source).read_bytes()
    Path(target).write_bytes(blob[:len(blob) // 2])
    return str(target)


def predict_cli(*args):
    return fork_server.run([sys.executable, "-m", "jaxtrain.predict", *map(str, args)],
                           cwd=REPO, capture_output=True, text=True, timeout=300,
                           env={**os.environ, "JAX_PLATFORMS": "cpu"})


@pytest.mark.slow
def test_predict_files_matches_predict_on_the_loaders_arrays(folder_run, photos, loader_arrays):
    root, good = photos
    classifier = jaxtrain.restore(folder_run)
    assert classifier.image_shape == (IMAGE_SIZE, IMAGE_SIZE, 3)
    result = classifier.predict_files([root])
    assert result.paths == tuple(good)  # walked recursively in name order; notes.txt skipped
    assert result.errors == ()
    expected_labels, expected = classifier.predict(np.stack([loader_arrays[p] for p in good]))
    np.testing.assert_allclose(result.probabilities, expected, rtol=0, atol=ELEMENTWISE)
    np.testing.assert_array_equal(result.labels, expected_labels)
    assert result.class_names == classifier.class_names and len(result.class_names) == 10
    name, probability = result.top(0, 1)[0]
    assert name == result.class_names[result.labels[0]]
    assert probability == pytest.approx(result.probabilities[0].max())


@pytest.mark.slow
def test_cli_json_classifies_the_rest_when_files_are_unreadable(folder_run, photos,
                                                                 loader_arrays, tmp_path):
    root, good = photos
    broken = tmp_path / "broken"
    broken.mkdir()
    truncated = truncated_copy(good[-1], broken / "half_a_photo.jpg")
    garbage = broken / "not_really.png"
    garbage.write_text("this is text with an image's name")
    missing = tmp_path / "no_such_file.jpg"

    done = predict_cli(folder_run, root, broken, missing, "--json", "--top=2")
    assert done.returncode == 1, done.stderr
    errors = [json.loads(line) for line in done.stderr.strip().splitlines()]
    assert len(errors) == 3, done.stderr  # one JSON line per bad path, no traceback
    assert sorted(error["path"] for error in errors) == sorted(
        [str(broken / "half_a_photo.jpg"), str(garbage), str(missing)])
    for path in (truncated, str(garbage), str(missing)):
        assert sum(path in error["error"] or path == error["path"] for error in errors) == 1, \
            (path, errors)

    rows = [json.loads(line) for line in done.stdout.strip().splitlines()]
    assert [row["path"] for row in rows] == good
    classifier = jaxtrain.restore(folder_run)
    labels, probabilities = classifier.predict(np.stack([loader_arrays[p] for p in good]))
    for row, label, p in zip(rows, labels, probabilities):
        assert row["label"] == label and row["class"] == classifier.class_names[label]
        assert len(row["top"]) == 2 and row["top"][0]["label"] == label
        assert row["top"][0]["probability"] == pytest.approx(p[label], abs=1e-6)
        second = int(np.argsort(-p, kind="stable")[1])
        assert row["top"][1]["label"] == second
        assert row["top"][1]["class"] == classifier.class_names[second]


@pytest.mark.slow
def test_cli_text_lines_for_a_named_checkpoint(folder_run, photos):
    _, good = photos
    step = jaxtrain.restore(folder_run).step
    done = predict_cli(folder_run, good[0], good[1], f"--checkpoint={step}", "--top=3")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 2
    result = jaxtrain.restore(folder_run, step=step).predict_files(good[:2])
    for line, i in zip(lines, range(2)):
        path, rest = line.rsplit(": ", 1)
        assert path == good[i]
        shown = [part.rsplit(" ", 1) for part in rest.split(", ")]
        assert [name for name, _ in shown] == [name for name, _ in result.top(i, 3)]
        for (_, printed), (_, p) in zip(shown, result.top(i, 3)):
            assert float(printed) == pytest.approx(p, abs=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("args, message", [
    (("{empty}", "{photo}"), "not a jaxtrain run"),
    (("{run}", "{photo}", "--checkpoint=999"), "no such step"),
    (("{run}", "{photo}", "--checkpoint=newest"), "expected a step number or 'best'"),
    (("{run}", "{photo}", "--top=0"), "--top"),
    (("{run}",), "usage"),
])
def test_cli_bad_input_is_one_line_exit_2(folder_run, photos, tmp_path, args, message):
    _, good = photos
    values = {"empty": tmp_path, "photo": good[0], "run": folder_run}
    done = predict_cli(*(arg.format(**values) for arg in args))
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], done.stderr
