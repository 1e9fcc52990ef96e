"""Eviction policies: each a small dataclass defining its score (and, if it differs from the
recent window + sinks, its eviction scope). See base.py for the decomposition."""

from . import (  # noqa: F401  (register)
    adakv,
    aqas,
    expected,
    h2o,
    knorm,
    kvzip,
    mas,
    oracle,
    probe,
    pyramidkv,
    random,
    recency,
    roco,
    sample,
    scissorhands,
    snapkv,
    tova,
)
from .base import Candidates, Policy
from .registry import POLICIES, make_policy, policy_class, register

__all__ = ["Candidates", "Policy", "POLICIES", "make_policy", "policy_class", "register"]
