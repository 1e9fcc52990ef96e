"""How a cache stores what it keeps.

- ``config``: ``Storage``, what a user chooses (bits of the kept and the evicted tokens, group,
  key basis) and its spelling ("int4+int2").
- ``interface``: what a tier asks of a store (``SlotStore``) and of a bookkeeping field (``SlotField``).
- ``rect``: one rectangle per layer; ``paged``: each row its own pages of shared pools (``Pools``).
- ``codes``: the packed integer codes (quantize, pack, dequantize) and the bytes a slot takes.
"""

from ..stats import stat_bytes, stat_dtype
from .codes import BITS, check_bits, check_group, slot_bytes
from .config import DEFAULT_GROUP, KEY_BASES, LOW_BITS, POS_BYTES, Storage
from .interface import Piece, SlotField, SlotStore
from .paged import PAGE, Pools, page_slots

__all__ = [
    "BITS",
    "DEFAULT_GROUP",
    "KEY_BASES",
    "LOW_BITS",
    "PAGE",
    "POS_BYTES",
    "Piece",
    "Pools",
    "SlotField",
    "SlotStore",
    "Storage",
    "check_bits",
    "check_group",
    "page_slots",
    "slot_bytes",
    "stat_bytes",
    "stat_dtype",
]
