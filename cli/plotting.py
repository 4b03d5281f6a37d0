"""Exponent histograms as a PNG for `unweight inspect --plot` (matplotlib, an optional extra)."""

from __future__ import annotations

import os

import numpy as np

from unweight.errors import UnweightError
from unweight.report import CLASS_ORDER


def plot_exponents(stats: list, path: str | os.PathLike) -> None:
    """One panel per dtype: the exponent histogram of each tensor class, as a share of weights."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UnweightError("--plot needs matplotlib: pip install 'unweight[plot]'") from None
    by_dtype: dict[str, dict[str, np.ndarray]] = {}
    for s in stats:
        if s.exponent_histogram is None:
            continue
        cls = by_dtype.setdefault(s.dtype, {})
        h = s.exponent_histogram
        key = s.tensor_class
        cls[key] = cls.get(key, np.zeros_like(h)) + h
    if not by_dtype:
        raise UnweightError("no floating-point tensors to plot")
    fig, axes = plt.subplots(len(by_dtype), 1, figsize=(9, 3.2 * len(by_dtype)), squeeze=False)
    for ax, (dtype, classes) in zip(axes[:, 0], sorted(by_dtype.items())):
        for cls in CLASS_ORDER:
            if cls in classes:
                h = classes[cls]
                nz = np.flatnonzero(h)
                lo, hi = nz[0], nz[-1] + 1
                ax.plot(np.arange(lo, hi), h[lo:hi] / h.sum(), marker=".", label=f"{cls} ({h.sum():,} weights)")
        ax.set_title(f"{dtype} exponent histogram")
        ax.set_xlabel("biased exponent")
        ax.set_ylabel("share of weights")
        ax.set_yscale("log")
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(os.fspath(path), dpi=110)
    plt.close(fig)
