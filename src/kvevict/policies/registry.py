"""Policy names -> classes. An unknown name is an error that lists the known ones."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .base import Policy

POLICIES: dict[str, type[Policy]] = {}


def register(*names: str):
    def deco(cls):
        for n in names:
            POLICIES[n] = cls
        return cls

    return deco


ADAPTIVE = "ada-"  # "ada-h2o": a policy with Ada-KV head-adaptive budgets (adaptive=True)
MERGE = "merge-"  # "merge-kvzip-span": evicted tokens kept as one mean slot per head (merge=True)


def policy_class(name) -> tuple[type[Policy], dict] | None:
    """The class of a policy name (``"h2o"``, ``"ada-h2o"`` for its adaptive form, ``"merge-h2o"``
    with its evicted tokens merged, see kvevict.merge) and the parameters the name implies; None
    when unknown."""
    if not isinstance(name, str):
        return None
    name = name.lower()
    if name.startswith(MERGE):
        found = policy_class(name[len(MERGE) :])
        return None if found is None else (found[0], {**found[1], "merge": True})
    if name in POLICIES:
        return POLICIES[name], {}
    if name.startswith(ADAPTIVE) and name[len(ADAPTIVE) :] in POLICIES:
        return POLICIES[name[len(ADAPTIVE) :]], {"adaptive": True}
    return None


def make_policy(policy, **params):
    """A policy instance from a name (``"h2o"``, ``"ada-h2o"``) or an instance (returned as is)."""
    from .base import Policy

    if isinstance(policy, Policy):
        if params:
            raise ValueError("pass policy parameters to the policy object, not to make_cache.")
        return policy
    found = policy_class(policy)
    if found is None:
        known = ", ".join(sorted(POLICIES))
        raise ValueError(
            f"unknown policy {policy!r}; known policies: {known} (any of them as ada-NAME "
            "for head-adaptive budgets, merge-NAME to keep the evicted tokens as one mean slot "
            "per head)."
        )
    cls, implied = found
    params = {**implied, **params}
    try:
        return cls(**params)
    except TypeError as err:
        raise ValueError(f"bad parameters for policy {policy!r}: {err}") from None
