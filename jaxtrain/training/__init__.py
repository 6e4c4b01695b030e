"""The compiled side of training, as pure functions of config blocks: the state, the step,
chunks of steps, evaluation, augmentation, optimisers, replicas, checkpoints, the input
batches, and prepare.py, which builds all of it from a config (the Setup)."""
