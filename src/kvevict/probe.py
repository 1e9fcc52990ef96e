"""A per-model linear probe of KVzip's scores, read off the keys and values a prefill already holds,
in the manner of KVzap (NVIDIA kvpress, 2026: a small model fitted to the hidden states predicts
KVzip's scores, so the reconstruction pass is not run). Here the probe reads what a cache holds, no
hidden state: per token and layer, the values of every KV head and the norms of each key's rotary
pairs, which rotary embeddings leave unchanged (a pair (k_j, k_{j + d/2}) is turned by an angle of
its position, so ``|k_j|^2 + |k_{j + d/2}|^2`` does not depend on the position):

    x_i = [v_i^(1..H), rho_i^(1..H), e_i],   rho_{i,j} = sqrt(k_{i,j}^2 + k_{i,j+d/2}^2)
    log s_i^(h) ~ w_h . x_i + b_h          (ridge regression on KVzip's log scores)

``e_i`` (a probe fitted with ``edges``) says where the key sits: one indicator per band of its
distance from the prompt's end, d_i = n - 1 - i in [edges_j, edges_{j+1}), and one for the first
``SINKS`` positions. A sliding layer's KVzip scores are mostly where its key sits (a reconstruction
query sees the keys of its own window only), which no value or key norm tells (docs/results/probe.md).

and ``kvzip-probe`` ranks a prompt's keys by ``exp(w_h . x_i + b_h)`` as ``kvzip-pool`` ranks them by
KVzip's own scores. ``kvevict calibrate --probe`` fits a model's probe
(``kvevict.eval.probe_fit``); kvevict ships those it fitted for known models (``SHIPPED``)."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from .plans import plans_folder, same_model, signature, signature_id

FORMAT = "kvevict-probe/1"  # ``edges`` is optional in it: a probe without them reads no position
# the bands of a key's distance from the prompt's end that a probe fitted now reads (``features``)
EDGES = (0, 8, 32, 64, 128, 256, 384, 448, 512)  # the last band open-ended
SINKS = 4  # the first positions, where every model parks attention, one indicator of their own
EPS = 1e-6  # the floor under a KVzip score before its log (scores are attention probabilities)
SHIPPED = Path(__file__).with_name("shipped_probes")  # probes fitted for known models (package data)


def features(keys: torch.Tensor, values: torch.Tensor, edges: tuple = (), total: int | None = None) -> torch.Tensor:
    """(b, hkv, n, d) keys and values -> (b, n, hkv x 3d/2 [+ len(edges) + 1]): each token's values and
    the norms of its keys' rotary pairs (the module's ``x_i``), every KV head of the layer side by
    side, then, with ``edges``, its position's indicators (``e_i``). The n keys are the last of a
    prompt of ``total`` tokens (default n: all of it; fewer where a sliding layer holds its window)."""
    d = keys.shape[-1]
    k = keys.float()
    pairs = (k[..., : d // 2].square() + k[..., d // 2 :].square()).sqrt()
    x = torch.cat([values.float(), pairs], dim=-1).transpose(1, 2).flatten(2)
    if not edges:
        return x
    n = keys.shape[2]
    total = total or n
    pos = torch.arange(total - n, total, device=keys.device)
    return torch.cat([x, position_features(pos, total, edges).expand(x.shape[0], -1, -1)], dim=-1)


def position_features(pos: torch.Tensor, total: int, edges: tuple) -> torch.Tensor:
    """(n, len(edges) + 1) floats: for each position of a ``total``-token prompt, which band of
    ``edges`` its distance from the end falls in (the last band open-ended), and whether it is one of
    the first ``SINKS``."""
    dist = (total - 1 - pos)[:, None]
    lo = torch.tensor(edges, device=pos.device)
    hi = torch.tensor(edges[1:] + (total + 1,), device=pos.device)
    bands = (dist >= lo) & (dist < hi)
    return torch.cat([bands, (pos < SINKS)[:, None]], dim=1).float()


@dataclass(frozen=True)
class Probe:
    """A fitted probe: per layer, ``weights`` (F + 1, hkv), the last row the bias, on ``features``."""

    weights: list
    signature: dict
    fitted_on: str = ""  # what it was fitted on, for the record
    edges: tuple = ()  # the position bands it reads (``features``); () for a probe fitted before them

    def scores(self, layer: int, keys: torch.Tensor, values: torch.Tensor, total: int | None = None) -> torch.Tensor:
        """Layer ``layer``'s predicted KVzip scores (b, hkv, n) of its keys and values (b, hkv, n, d),
        the last n of a prompt of ``total`` tokens (default: n)."""
        w = self.weights[layer]
        x = features(keys, values, self.edges, total)
        if x.shape[-1] + 1 != w.shape[0] or keys.shape[1] != w.shape[1]:
            raise ValueError(
                f"the probe of layer {layer} reads {w.shape[0] - 1} features of {w.shape[1]} KV heads, the "
                f"cache holds {x.shape[-1]} of {keys.shape[1]}: it was fitted for another model."
            )
        w = w.to(x.device)
        return (x @ w[:-1] + w[-1]).exp().transpose(1, 2)

    def to_json(self) -> dict:
        return {
            "format": FORMAT,
            "signature": self.signature,
            "fitted_on": self.fitted_on,
            "edges": list(self.edges),
            "weights": [[[float(f"{v:.6g}") for v in row] for row in w.tolist()] for w in self.weights],
        }


def fit(xs: list, ys: list, ridge: float = 1.0) -> list:
    """Per layer, the ridge solution of ``ys[l]`` (N, hkv) KVzip log scores on ``xs[l]`` (N, F)
    features, on standardized features, returned on the raw ones: (F + 1, hkv), the bias last."""
    out = []
    for x, y in zip(xs, ys):
        x, y = x.double(), y.double()
        mu, sd = x.mean(0), x.std(0).clamp_min(1e-6)
        z = torch.cat([(x - mu) / sd, torch.ones(len(x), 1, dtype=x.dtype)], dim=1)
        a = z.T @ z + ridge * torch.eye(z.shape[1], dtype=x.dtype)
        a[-1, -1] -= ridge  # the bias is not shrunk
        w = torch.linalg.solve(a, z.T @ y)
        raw = w[:-1] / sd[:, None]
        out.append(torch.cat([raw, (w[-1] - mu @ raw)[None]]).float())
    return out


def load(path, model) -> Probe:
    """The probe in ``path``: a ValueError that says what to do when it is not one, or another model's."""
    path = Path(path)
    hint = f"run `kvevict calibrate --probe --model ...` for this model (it writes {probe_path(model)})"
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"{path} is not a kvevict probe file ({err}): {hint}.") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("weights"), list):
        raise ValueError(f"{path} is not a kvevict probe file (format {FORMAT}): {hint}.")
    edges = data.get("edges") or []
    if (
        not isinstance(edges, list)
        or not all(isinstance(e, int) and e >= 0 for e in edges)
        or edges != sorted(set(edges))
    ):
        raise ValueError(f"{path}: its edges must be increasing token distances (>= 0), got {edges!r}: {hint}.")
    if not same_model(data.get("signature") or {}, signature(model)):
        raise ValueError(f"{path} was fitted for another model ({signature_id(data.get('signature') or {})}): {hint}.")
    return _from_json(data)


def _from_json(data: dict) -> Probe:
    edges = tuple(int(e) for e in data.get("edges") or ())
    return Probe([torch.tensor(w) for w in data["weights"]], data["signature"], data.get("fitted_on", ""), edges)


def probe_path(model) -> Path:
    """Where ``kvevict calibrate --probe`` writes a model's probe: beside its plans
    (``$KVEVICT_PLANS`` or ``~/.cache/kvevict/plans``), one file per model signature."""
    return plans_folder() / f"{signature_id(signature(model))}.probe.json"


@functools.cache
def _shipped() -> tuple:
    """The package's probes, read and built once per process (the default policy asks on every call)."""
    return tuple(_from_json(json.loads(p.read_text())) for p in sorted(SHIPPED.glob("*.json")))


def find(model) -> Probe | None:
    """The model's probe: its own (``probe_path``), else the one kvevict ships for it, else None."""
    own = probe_path(model)
    if own.exists():
        return load(own, model)
    sig = signature(model)
    return next((p for p in _shipped() if same_model(p.signature, sig)), None)


def save(probe: Probe, path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(probe.to_json()) + "\n")
    return path
