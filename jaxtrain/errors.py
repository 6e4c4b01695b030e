"""The errors jaxtrain reports as one line (main.py prints `error: MESSAGE`)."""


class ConfigError(ValueError):
    """A config value that cannot work; the message names the key."""


class TrainingError(RuntimeError):
    """Training cannot go on (e.g. a non-finite loss); the message names the step."""
