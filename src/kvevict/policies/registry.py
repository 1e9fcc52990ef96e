"""Policy names -> classes. An unknown name is an error that lists the known ones."""

from __future__ import annotations

POLICIES: dict[str, type] = {}


def register(*names: str):
    def deco(cls):
        for n in names:
            POLICIES[n] = cls
        return cls
    return deco


def make_policy(policy, **params):
    """A policy instance from a name (``"h2o"``) or an instance (returned as is)."""
    from .base import Policy

    if isinstance(policy, Policy):
        if params:
            raise ValueError("pass policy parameters to the policy object, not to make_cache.")
        return policy
    if not isinstance(policy, str) or policy.lower() not in POLICIES:
        known = ", ".join(sorted(POLICIES))
        raise ValueError(f"unknown policy {policy!r}; known policies: {known}.")
    cls = POLICIES[policy.lower()]
    try:
        return cls(**params)
    except TypeError as err:
        raise ValueError(f"bad parameters for policy {policy!r}: {err}") from None
