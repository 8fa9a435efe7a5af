"""``specdraft eval``'s files: its result as JSON and two plots of the speculative counts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from specdraft.core.io import atomic_path, atomic_write_text

if TYPE_CHECKING:  # pragma: no cover
    from specdraft.measuring.evaluate import EvalResult


def write_eval_report(res: EvalResult, out_dir: str | Path, title: str = "specdraft eval") -> dict[str, Path]:
    """``specdraft eval``'s files: ``report.json`` (:meth:`~specdraft.measuring.evaluate.EvalResult.to_dict`) and two PNG plots
    of the speculative counts (α per draft position, accepted-length histogram), each written atomically.

    Returns:
        ``{"report", "alpha_plot", "hist_plot"}`` → the paths written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"report": out / "report.json", "alpha_plot": out / "alpha_per_position.png",
             "hist_plot": out / "accepted_length_hist.png"}
    atomic_write_text(paths["report"], json.dumps(res.to_dict(), indent=2, default=str))
    c = res.spec_counts
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.bar(range(1, c.gamma + 1), c.alpha_per_position, color="#4C72B0")
    ax.set(xlabel="draft position", ylabel="P(accept | reached)", ylim=(0, 1.05), title=f"{title}: α per position")
    fig.tight_layout()
    with atomic_path(paths["alpha_plot"]) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.bar(range(c.gamma + 1), c.accepted_hist, color="#55A868")
    ax.set(xlabel="drafts accepted per round", ylabel="rounds", title=f"{title}: accepted length")
    fig.tight_layout()
    with atomic_path(paths["hist_plot"]) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)
    return paths
