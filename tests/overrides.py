"""Keyword overrides for the tests' small configs: section__name=value sets config.section.name."""


def with_overrides(config, overrides):
    """Set each `section__name` in `overrides` on `config`; return it."""
    for key, value in overrides.items():
        section, name = key.split("__")
        config[section][name] = value
    return config
