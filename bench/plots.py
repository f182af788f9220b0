"""What the benchmarks' TTFT figures share: the p1–p99 box beside the CDF, and saving the figure."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def box_and_save(fig: Any, ax: Any, samples_ms: list[list[float]], labels: list[str], title: str,
                 path: Path, fontsize: int) -> None:
    """One horizontal box per series (p25–p75, whiskers p1–p99, the mean marked) on ``ax`` on a log
    scale, then the title, and the figure written to ``path`` and closed."""
    import matplotlib.pyplot as plt

    ax.boxplot(samples_ms, orientation="horizontal", whis=(1, 99), showfliers=False, showmeans=True)
    ax.set_yticks(range(1, len(labels) + 1), labels, fontsize=fontsize)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (ms): box p25–p75, whiskers p1–p99, ▲ mean")
    ax.invert_yaxis()
    ax.grid(True, axis="x", which="both", alpha=0.3)
    fig.suptitle(title, fontsize=fontsize + 2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
