"""The PyTorch twins `python -m jaxtrain.compare` runs beside jaxtrain: the recipes and
their timing (runner.py), the models (torch_models.py) and optimisers (torch_optim.py)."""
