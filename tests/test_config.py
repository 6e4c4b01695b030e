"""Every config key has a bad-value error that names it (checks.check_config)."""
from pathlib import Path

import pytest

from configs import cifar_speedrun, default
from jaxtrain import ConfigError
from jaxtrain.config import checks


@pytest.mark.parametrize("key,value,message", [
    ("model.activation", "tanh", "config.model.activation='tanh': must be one of gelu_tanh"),
    ("model.conv_init", "identity", "config.model.conv_init='identity': must be one of"),
    ("model.bn_epsilon", 0.0, "config.model.bn_epsilon=0.0: must be > 0"),
    ("model.head_init_std", -1.0, "config.model.head_init_std=-1.0: must be >= 0"),
    ("optimizer.name", "loin", r"config.optimizer.name='loin': unknown optimiser \(did you mean "
                               "'lion'"),
    ("optimizer.name", "contrib.schedule_free_adam",
     "did you mean 'contrib.schedule_free_adamw'"),
    ("optimizer.clip_norm", -1.0, r"config.optimizer.clip_norm=-1.0: must be >= 0 \(0: off\)"),
    ("train.loss", "hinge", "config.train.loss='hinge': must be one of softmax_xent, "
                            "sigmoid_xent, focal, or 'package.module:function'"),
    ("train.focal_gamma", -1.0, "config.train.focal_gamma=-1.0: must be >= 0"),
    ("augment.fn", "noise", r"config.augment.fn='noise': must be '' \(none\) or "
                            "'package.module:function'"),
    ("optimizer.ns_steps", 0, "config.optimizer.ns_steps=0: must be an int >= 1"),
    ("optimizer.ns_coeffs", (1.0, 2.0), r"config.optimizer.ns_coeffs=\(1.0, 2.0\): must be three"),
    ("optimizer.lookahead_steps", -1, "config.optimizer.lookahead_steps=-1: must be an int >= 0"),
    ("optimizer.lookahead_alpha", 0.0, r"config.optimizer.lookahead_alpha=0.0: must be in \(0, 1\]"),
    ("augment.alternate_flip", True, "config.augment.alternate_flip=True: needs augment.flip=True"),
    ("eval.tta_fraction", 1.5, r"config.eval.tta_fraction=1.5: must be in \[0, 1\]"),
])
def test_bad_values_of_new_keys_name_the_key(key, value, message):
    config = default.get_config()
    section, name = key.split(".")
    config[section][name] = value
    with pytest.raises(ConfigError, match=message):
        checks.check_config(config)


def test_a_group_must_be_a_param_group():
    config = default.get_config()
    config.optimizer.groups.head = 0.5
    with pytest.raises(ConfigError, match="config.optimizer.groups.head=0.5: must be a group"):
        checks.check_config(config)


def test_the_recipes_pass_the_checks():
    """Every recipe jaxtrain carries passes the checks a run starts with, and the checks
    read that recipe: the same recipe with one key out of range or one unknown key
    stops with the line naming it."""
    from jaxtrain import config as config_lib
    names = config_lib.names()
    assert len(names) >= 10
    for name in names:
        config = config_lib.load(name)
        checks.check_config(config)  # raises on a recipe the checks refuse
        config.train.batch_size = 0
        with pytest.raises(ConfigError, match=r"^config\.train\.batch_size=0: must be "):
            checks.check_config(config)
        config = config_lib.load(name)
        with config.unlocked():
            config.train.batch_szie = 64
        with pytest.raises(ConfigError, match="batch_szie"):
            checks.check_config(config)


def test_a_recipe_loads_by_name_or_path_and_a_wrong_one_is_one_line(tmp_path):
    import jaxtrain
    from jaxtrain import config as config_lib
    names = config_lib.names()
    assert {"cifar", "cifar_speedrun", "fashion_mnist_mlp", "default"} <= set(names)
    assert "__init__" not in names
    by_name = jaxtrain.config.load("cifar_speedrun")
    assert by_name.to_dict() == cifar_speedrun.get_config().to_dict()
    assert config_lib.load("configs/cifar_speedrun.py").to_dict() == by_name.to_dict()
    with pytest.raises(ConfigError, match=r"^no recipe named 'cifar10': jaxtrain's recipes "
                                          r"are cifar, .*fashion_mnist_mlp, "):
        config_lib.load("cifar10")
    with pytest.raises(ConfigError, match=f"^no config file {tmp_path}/missing.py$"):
        config_lib.load(str(tmp_path / "missing.py"))
    (tmp_path / "empty.py").write_text("x = 1\n")
    with pytest.raises(ConfigError, match="defines get_config"):
        config_lib.load(str(tmp_path / "empty.py"))
    # an installed jaxtrain carries them: pyproject.toml's packages are setuptools' find of
    # jaxtrain*, which follows the recipes/ link to configs/
    import setuptools
    repo = Path(__file__).resolve().parents[1]
    assert "jaxtrain.recipes" in setuptools.find_packages(str(repo), include=["jaxtrain*"])
    assert (repo / "jaxtrain" / "recipes" / "cifar_speedrun.py").samefile(
        repo / "configs" / "cifar_speedrun.py")
