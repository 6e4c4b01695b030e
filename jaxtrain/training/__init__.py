"""The compiled side of training, as pure functions of config blocks: the state, the step,
chunks of steps, evaluation, augmentation, optimisers, replicas, checkpoints, the input
batches, and prepare.py, which builds all of it from a config (the Setup) with a module a
job: inputs.py (the data and its statistics), model_state.py (the model and its initial
state), placement.py (the devices' mesh and what goes on them)."""
