"""matplotlib for the benchmarks' PNG plots: optional (the ``bench`` extra), headless."""
from __future__ import annotations


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend, or None (with one line saying so) when absent."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install cula-serve[bench])")
        return None
    return plt
