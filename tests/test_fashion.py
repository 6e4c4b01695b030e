"""Training on real Fashion-MNIST: the BP network (MLP with BatchNorm) and CNNs on 28x28x1."""
import pytest

from configs import fashion_mnist_cnn, fashion_mnist_mlp
from jaxtrain.run import loop

pytestmark = pytest.mark.slow  # each test is a training run

SYSTEM_DIR = "/usr/share/datasets/fashion-mnist"


def test_short_mlp_run_beats_chance_by_far(tmp_path):
    config = fashion_mnist_mlp.get_config()
    config.data.dir = SYSTEM_DIR
    config.data.source = "files"
    config.train.num_steps = 400  # under one epoch of the article's recipe
    summary = loop.train_and_evaluate(config, str(tmp_path))
    assert summary["test_accuracy"] > 0.75  # chance is 0.10
    assert summary["param_count"] == 248734


@pytest.mark.parametrize("model", ["cifar_cnn", "seed_cnn"])
def test_cnns_train_on_one_channel_images(tmp_path, model):
    config = fashion_mnist_cnn.get_config()
    config.data.dir = SYSTEM_DIR
    config.data.source = "files"
    config.model.name = model
    config.model.widths = (8, 16, 16)
    config.model.batch_norm = True
    config.train.batch_size = 64
    config.train.num_steps = 60
    config.eval.tta = "none"  # the recipe's flip doubles the evaluation of 10,000 images
    summary = loop.train_and_evaluate(config, str(tmp_path))
    assert summary["test_accuracy"] > 0.35  # chance is 0.10; 60 small steps
