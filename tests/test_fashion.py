"""Training on real Fashion-MNIST: CNNs on 28x28x1 (the BP network, the MLP recipe, trains in
docs/python.md's script, which tests/test_docs.py runs)."""
import pytest

from configs import fashion_mnist_cnn
from jaxtrain.run import loop

pytestmark = pytest.mark.slow  # each test is a training run

SYSTEM_DIR = "/usr/share/datasets/fashion-mnist"


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
