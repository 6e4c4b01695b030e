"""Keyword overrides for the tests' small configs: section__name=value sets config.section.name
(any depth: optimizer__groups__head__lr_scale)."""


def with_overrides(config, overrides):
    """Set each `a__b__c` in `overrides` on `config` (config.a.b.c); return it."""
    for key, value in overrides.items():
        *scopes, name = key.split("__")
        node = config
        for scope in scopes:
            node = node[scope]
        node[name] = value
    return config
