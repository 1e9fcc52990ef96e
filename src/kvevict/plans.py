"""Calibrated memory plans, read by ``memory=``: the JSON file ``kvevict calibrate`` writes per model
(``kvevict.eval.calibrate`` measures it), keyed by the model's signature (its architecture and
shapes), one entry per memory share: the storage that measured best there. kvevict ships the plans
it measured for known models (``SHIPPED``), used where the user has calibrated none of their own."""

from __future__ import annotations

import functools
import hashlib
import json
import math
from pathlib import Path

from .fetch import cache_dir
from .shape import text_config

FORMAT = "kvevict-plan/1"
KINDS = ("fp16", "int8", "int4", "int8+int4")
SIGNATURE_KEYS = (
    "model_type",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_size",
    "vocab_size",
    "sliding_window",
    "layer_types",
)


def signature(model) -> dict:
    """What a plan depends on: the architecture and shapes of the model (not its weights' path)."""
    config = text_config(model)
    sig = {k: getattr(config, k, None) for k in SIGNATURE_KEYS}
    sig = {k: (list(v) if isinstance(v, tuple) else v) for k, v in sig.items()}
    sig["dtype"] = str(model.dtype).removeprefix("torch.")
    return sig


def signature_id(sig: dict) -> str:
    name = sig.get("model_type") or "model"
    return f"{name}-{hashlib.sha256(json.dumps(sig, sort_keys=True).encode()).hexdigest()[:12]}"


SHIPPED = Path(__file__).with_name("shipped_plans")  # plans measured for known models (package data)
PLANS_ENV = "KVEVICT_PLANS"  # the folder of calibrated plans (default: plans/ in kvevict's cache)


def default_path(model, policy: str | None = None) -> Path:
    """Where ``kvevict calibrate`` writes a model's plan and ``memory=`` looks for it:
    ``$KVEVICT_PLANS`` or ``~/.cache/kvevict/plans``, one file per model signature for the default
    streaming policy (``policy`` None), and one per model and policy for any other, so a plan for a
    prompt-scoring policy sits beside the streaming one instead of replacing it."""
    return plans_folder() / f"{signature_id(signature(model))}{'' if policy is None else '-' + policy}.json"


def plans_folder() -> Path:
    """The folder of a user's calibrated plans and probes: ``$KVEVICT_PLANS``, else plans/ in kvevict's cache."""
    import os

    return Path(os.environ[PLANS_ENV]) if os.environ.get(PLANS_ENV) else cache_dir("plans")


def load(path, model) -> dict:
    """A plan file for ``model``: a ValueError saying what to do when it is missing, not a plan, or another model's."""
    path = Path(path)
    hint = f"run `kvevict calibrate --model ...` for this model (it writes {default_path(model)})"
    if not path.exists():
        raise ValueError(f"no plan file at {path}: {hint}, or drop plan= to use the built-in rule.")
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"{path} is not a kvevict plan file ({err}): {hint}.") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("choices"), list):
        raise ValueError(f"{path} is not a kvevict plan file (format {FORMAT}): {hint}.")
    if data.get("signature") != signature(model):
        raise ValueError(
            f"{path} was calibrated for another model ({signature_id(data.get('signature') or {})}, "
            f"this one is {signature_id(signature(model))}): {hint}."
        )
    return data


def same_model(a: dict, b: dict) -> bool:
    """Two signatures of one architecture and shapes, whatever the dtype the weights were loaded in
    (storage quality follows the keys' shape, and budgets count 16-bit bytes either way)."""
    return {k: v for k, v in a.items() if k != "dtype"} == {k: v for k, v in b.items() if k != "dtype"}


@functools.cache
def _shipped_plans() -> tuple:
    """The package's plan files, read once per process (``make_cache`` asks on every call)."""
    return tuple(json.loads(path.read_text()) for path in sorted(SHIPPED.glob("*.json")))


def shipped(model, policy: str) -> dict | None:
    """The plan kvevict ships for this model and policy (``SHIPPED``), None where it ships none."""
    sig = signature(model)
    for data in _shipped_plans():
        if data.get("policy") == policy and same_model(data.get("signature") or {}, sig):
            return data
    return None


def kind_for(model, share: float, policy: str, own: str | None, plan_file=None) -> str | None:
    """The kind of storage a plan gives a memory ``share`` under ``policy``: the file ``plan_file``,
    or (None) the model's own in ``default_path(model, own)``, else the one kvevict ships for it;
    None where no plan for this policy applies (the built-in rule decides)."""
    path = default_path(model, own) if plan_file is None else plan_file
    data = shipped(model, policy) if plan_file is None and not path.exists() else load(path, model)
    if data is None or data["policy"] != policy:
        return None
    return nearest(data, share)["storage"]


def nearest(plan: dict, memory: float) -> dict:
    """The plan's entry for the memory share nearest ``memory`` (in ratio)."""
    return min(plan["choices"], key=lambda c: abs(math.log(c["memory"] / memory)))


def save(plan: dict, path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(plan, indent=1) + "\n")
    return path
