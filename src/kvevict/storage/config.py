"""How a cache stores what it keeps: bits per key/value channel for the kept tokens, and whether
evicted tokens are dropped or demoted into a low-bit tier of their own (mixed precision)."""

from __future__ import annotations

from dataclasses import dataclass

from ..budget import check_budget
from .codes import check_bits
from .layout import SlotLayout

# per-token groups of 32 channels: measured against 16 and 64 on SmolLM2 (docs/results/quality-per-byte.md)
DEFAULT_GROUP = 32
POS_BYTES = 2  # a slot's position, int16 while it fits (kvevict.storage.layout)

# keys stored in a rotated basis by default at these bits: a per-token group with one step cannot
# hold outlier channels as the model makes them (docs/results/families.md: Qwen2.5-Coder-1.5B)
LOW_BITS = (8, 4, 2)
KEY_BASES = (None, "rotated", "raw")


@dataclass(frozen=True)
class Storage:
    """kv_bits: None (the model's dtype), 16 (float16), 8, 4 or 2 (packed integer codes).
    group: channels per quantization group along the head dimension.
    evicted_bits: None (evicted tokens are dropped) or the bits of the tier they are demoted to.
    evicted_budget: that tier's slots per (sequence, KV head): an int, or a float fraction of the
    prompt (default: the rest of the prompt, prompt length - budget; later tokens evict by the policy).
    keys: "rotated" (keys stored centred and Hadamard-rotated, ``kvevict.keyspace``: exact, and what
    keeps outlier channels in 8 bits and under), "raw" (as the model makes them), or None (default):
    rotated when a tier stores packed codes (8, 4 or 2 bits), raw otherwise."""

    kv_bits: int | None = None
    group: int = DEFAULT_GROUP
    evicted_bits: int | None = None
    evicted_budget: int | float | None = None
    keys: str | None = None

    def __post_init__(self):
        check_bits(self.kv_bits)
        check_bits(self.evicted_bits, "evicted_bits")
        if isinstance(self.group, bool) or not isinstance(self.group, int) or self.group < 1:
            raise ValueError(f"group must be a positive number of channels (e.g. 32), got {self.group!r}.")
        if self.evicted_budget is not None:
            if self.evicted_bits is None:
                raise ValueError("evicted_budget sizes the low-bit tier of evicted tokens: give evicted_bits too.")
            check_budget(self.evicted_budget)
        if self.keys not in KEY_BASES:
            raise ValueError(f"keys must be one of {', '.join(map(repr, KEY_BASES))}, got {self.keys!r}.")

    @property
    def rotates_keys(self) -> bool:
        """Whether keys are stored centred and rotated (``kvevict.keyspace``)."""
        if self.keys is None:
            return any(b in LOW_BITS for b in (self.kv_bits, self.evicted_bits))
        return self.keys == "rotated"

    @property
    def label(self) -> str:
        """Short name: '' (model dtype), 'int4', 'int4+int2', ..."""
        parts = [] if self.kv_bits is None else ["fp16" if self.kv_bits == 16 else f"int{self.kv_bits}"]
        if self.evicted_bits is not None:
            parts.append(("+" if parts else "fp+") + ("fp16" if self.evicted_bits == 16 else f"int{self.evicted_bits}"))
        return "".join(parts)

    @classmethod
    def parse(cls, label: str) -> "Storage":
        """The inverse of ``label``: 'int4' -> kv_bits=4; 'int4+int2' -> kv_bits=4, evicted_bits=2;
        'fp+int2' -> model dtype, evicted_bits=2; 'fp16' -> kv_bits=16; '' -> model dtype."""

        def bits(part: str):
            if part == "fp":
                return None
            if part == "fp16":
                return 16
            if part.startswith("int") and part[3:].isdigit():
                return int(part[3:])
            raise ValueError(
                f"unknown storage {label!r}: write it as fp16, int8, int4, int2, or KEPT+EVICTED "
                "such as int4+int2 or fp+int2."
            )

        if not label:
            return cls()
        kept, _, evicted = label.partition("+")
        return cls(kv_bits=bits(kept), evicted_bits=bits(evicted) if evicted else None)

    def row_bytes(self, kv_heads: int, head_dim_k: int) -> int:
        """Bytes a layer holds per sequence besides its slots: the key centre (float16, one per KV
        head and channel, ``kvevict.keyspace``) when keys are rotated."""
        return kv_heads * head_dim_k * 2 if self.rotates_keys else 0

    def slot_bytes(self, head_dim_k: int, head_dim_v: int, dtype_bytes: int, stats_bytes: int) -> float:
        """Bytes one kept slot of one (sequence, KV head) takes at ``kv_bits``: key, value, position
        (int16, -1 for an empty slot; a sequence past ``storage.layout.POS16_MAX`` tokens widens it to int32,
        2 bytes more), the policy's statistics (``stats_bytes``: ``stat_bytes(policy.stats)``)."""
        layout = SlotLayout(head_dim_k, head_dim_v, self.kv_bits, self.group, dtype_bytes)
        return layout.slot_bytes() + stats_bytes
