"""Give the freed heap back to the operating system when the server goes idle.

glibc's malloc keeps memory that was freed (the K/V pages of rows that left, a long prompt's
activations) for reuse instead of returning it, and grows its threshold for handing large blocks
back, so a server's resident memory ratchets up to the largest load it has seen. ``malloc_trim(0)``
returns the free pages at once (``madvise``); called only when nothing runs or waits, it costs no
request anything. Elsewhere than glibc (macOS, musl) it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _malloc_trim():
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # no libc by that name, or not glibc
        return None


def trim() -> bool:
    """Return the heap's free pages to the OS; whether there was a glibc to ask."""
    fn = _malloc_trim()
    if fn is None:
        return False
    fn(0)
    return True
