"""Which policy and budget each row of one cache layer evicts with, so that sequences with
different policies and budgets decode in one forward pass (continuous batching).

A layer's rows are described by a short list of distinct ``kinds`` (policy, budget in tokens) and a
(batch,) index ``kind`` into it. The index is a tensor mapped with the rest of the batch, so
reordering, selecting and appending rows need no bookkeeping of their own. For one decision the
priority of every candidate is computed per group of rows sharing a kind, each group by its own
policy at its own budget (so its recent window is the one it has alone):

    priority[r] = policy_k(r).priority(candidates[r], budget_k(r))

The layer's tiers are as wide as the largest budget; the slots past a row's own budget are marked
unavailable by the tier (see ``Tier.caps``), so the row keeps exactly the tokens it keeps alone.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from .policies import Candidates, Policy


def merged_params(policies: list[Policy]) -> dict | None:
    """The attention parameters every policy's statistics need at once, or None when two policies
    need the same parameter at different values (SnapKV's window against another's), or their
    ``hits_ema`` decays differ: then they cannot share one forward pass."""
    params: dict = {}
    decays = {p.decay() for p in policies if "hits_ema" in p.stats}
    if len(decays) > 1:
        return None
    for p in policies:
        for k, v in p.attention_params().items():
            if params.setdefault(k, v) != v:
                return None
    return params


def shareable(policies: list[Policy]) -> bool:
    """Whether rows with these policies can share one cache: no per-sequence recorded state
    (KVzip, the oracle: scores recorded for one batch of prompts), all adaptive (Ada-KV) or none,
    and compatible attention parameters."""
    if any(p.recorded for p in policies):  # built by recording a prompt
        return False
    if len({p.adaptive for p in policies}) > 1:  # one slot pool per layer, or per head
        return False
    return merged_params(policies) is not None


def rows_of(c: Candidates, rows: torch.Tensor, cols: torch.Tensor | None = None) -> Candidates:
    """The candidates of batch ``rows`` only (and of candidate columns ``cols``, if given)."""

    def take(t):
        if t is None:
            return None
        t = t.index_select(0, rows)
        return t if cols is None else t.index_select(2, cols)

    return replace(
        c,
        stats={n: take(t) for n, t in c.stats.items()},
        pos=take(c.pos),
        valid=take(c.valid),
        head=take(c.head),
        newest=c.newest.index_select(0, rows),
        prompt_len=None if c.prompt_len is None else c.prompt_len.index_select(0, rows),
    )


def stat_names(policies: list[Policy]) -> tuple[str, ...]:
    """Every statistic any of the policies reads, in first-seen order."""
    return tuple(dict.fromkeys(n for p in policies for n in p.stats))


class Rows:
    """Per-row (policy, budget) of one layer's batch; quacks like a ``Policy`` for the tier
    (``priority``, ``keeps_newest``, ``independent``), the candidates' ``budget`` being ignored
    in favour of each row's own."""

    def __init__(self, policy: Policy, budget: int, batch: int, device):
        self.kinds: list[tuple[Policy, int]] = [(policy, budget)]
        self.kind = torch.zeros(batch, dtype=torch.long, device=device)
        self._kinds_of = [0] * batch  # ``kind`` on the host
        self._groups: list = [(policy, budget, None)]  # None: every row
        self._sub_groups: dict = {}  # rows of a cap group -> their (policy, budget, index) groups

    @property
    def policies(self) -> list[Policy]:
        return _unique(p for p, _ in self.kinds)

    @property
    def stats(self) -> tuple[str, ...]:
        return stat_names(self.policies)

    def attention_params(self) -> dict:
        params = merged_params(self.policies)
        assert params is not None, "rows share a cache only when their policies can share a forward (shareable)"
        return params

    def decay(self) -> float:
        return next((p.decay() for p in self.policies if "hits_ema" in p.stats), 1.0)

    @property
    def independent(self) -> bool:
        return all(p.independent for p, _, _ in self._groups)

    def keeps_newest(self, _budget=None) -> bool:
        return all(p.keeps_newest(b) for p, b, _ in self._groups)

    def priority(self, c: Candidates, rows: list[int] | None = None) -> torch.Tensor:
        """Each candidate's priority by its row's policy at its row's budget; ``rows``: the batch
        rows ``c`` holds, in order (None: every row)."""
        groups = self._groups
        if rows is not None:
            sub = self._sub_groups.get(tuple(rows))
            if sub is None:  # built once per batch change and row subset, not per step
                kinds = [self._kinds_of[r] for r in rows]
                sub = self._sub_groups[tuple(rows)] = [
                    (p, b, torch.tensor([j for j, k in enumerate(kinds) if k == i], device=c.pos.device))
                    for i, (p, b) in enumerate(self.kinds)
                    if i in kinds
                ]
            groups = sub
        if len(groups) == 1:
            policy, budget, _ = groups[0]
            return policy.priority(replace(c, budget=budget))
        out = torch.empty(c.pos.shape, dtype=torch.float32, device=c.pos.device)
        for policy, budget, idx in groups:
            out[idx] = policy.priority(replace(rows_of(c, idx), budget=budget)).float()
        return out

    # -- the batch changes ------------------------------------------------------------------------
    def map_batch(self, fn) -> None:
        self.kind = fn(self.kind)
        self._regroup()

    def tensors(self) -> list:
        """The per-row tensors ``map_batch`` maps, in its order (rows joining concatenate them)."""
        return [self.kind]

    def nbytes(self) -> int:
        return self.kind.nbytes

    def adopt(self, other: "Rows") -> None:
        """Take ``other``'s kinds into this table and renumber ``other.kind`` into it (before the
        two batches' tensors are concatenated)."""
        renumber = []
        for pk in other.kinds:
            at = next((i for i, k in enumerate(self.kinds) if _same(k, pk)), None)
            if at is None:
                self.kinds.append(pk)
                at = len(self.kinds) - 1
            renumber.append(at)
        other.kind = torch.tensor(renumber, dtype=torch.long, device=other.kind.device)[other.kind]
        other.kinds = list(self.kinds)  # ``other.kind`` now indexes this table

    def _regroup(self) -> None:
        """Drop kinds no row uses, and index the rows of each kind (one host read per batch
        change, none per step)."""
        self._kinds_of = self.kind.tolist()
        used = sorted(set(self._kinds_of))
        if used != list(range(len(self.kinds))):
            table = torch.zeros(max(len(self.kinds), 1), dtype=torch.long, device=self.kind.device)
            table[used] = torch.arange(len(used), device=self.kind.device)
            self.kinds = [self.kinds[i] for i in used]
            self.kind = table[self.kind]
            self._kinds_of = self.kind.tolist()
        self._sub_groups = {}  # rows of a cap group -> their (policy, budget, index) groups
        if len(self.kinds) <= 1:
            self._groups = [(p, b, None) for p, b in self.kinds]
        else:
            self._groups = [(p, b, (self.kind == i).nonzero().squeeze(1)) for i, (p, b) in enumerate(self.kinds)]


def _same(a: tuple, b: tuple) -> bool:
    return a[1] == b[1] and (a[0] is b[0] or a[0] == b[0])


def _unique(items) -> list:
    out: list = []
    for x in items:
        if not any(x is y or x == y for y in out):
            out.append(x)
    return out
