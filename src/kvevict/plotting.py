"""matplotlib set up once for every figure kvevict writes (Agg backend: no display needed)."""

from __future__ import annotations


def available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def pyplot():
    """matplotlib.pyplot on the Agg backend; a clear error naming the extra when it is missing."""
    try:
        import matplotlib
    except ImportError:
        raise ValueError("plots need matplotlib: pip install 'kvevict[bench]'.") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
