"""model.init_from: a run's starting weights from a jaxtrain run, a PyTorch state_dict, a
.safetensors file or a named torchvision/timm weight (readers.py; pretrained.py resolves
the names to verified local files)."""
