"""PNG plots of the overload and soak checks.

- `overload_plot`: requests per second sent, completed and refused (429)
  over the run, with the offered and measured-capacity rates as lines, and
  below it the server's RSS over the same time.
- `soak_plot`: the server's RSS over the run (warm-up shaded, the linear
  fit drawn), and below it KV blocks in use on the engines and blocks held
  in the host tier.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from bench.rss import RssSeries  # noqa: E402
from bench.server_stats import KVSnapshot  # noqa: E402
from bench.timeline import Timeline  # noqa: E402


def _rss_axis(ax: plt.Axes, rss: RssSeries) -> None:
    ax.plot([s.t for s in rss.samples], [s.rss_mb for s in rss.samples], color="#9467bd")
    ax.set_ylabel("server RSS (MB)")
    ax.set_xlabel("time (s)")
    ax.grid(alpha=0.3)


def overload_plot(tl: Timeline, rss: RssSeries, path: Path, *, offered: float,
                  capacity: float, title: str | None = None) -> Path:
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(6.5, 5.2), sharex=True,
                                      gridspec_kw={"height_ratios": [3, 2]})
    # One more edge than bins, so that the last bin is drawn to its end.
    edges = [*tl.t, tl.t[-1] + tl.bin_s] if tl.t else []
    series = [(tl.sent, "sent", "#7f7f7f"), (tl.completed, "completed", "#2ca02c"),
              (tl.rejected, "rejected (429)", "#d62728")]
    if any(tl.failed):
        series.append((tl.failed, "failed", "black"))
    for ys, label, color in series:
        if ys:
            top.step(edges, [*ys, ys[-1]], where="post", label=label, color=color)
    top.axhline(offered, color="#7f7f7f", linestyle="--", linewidth=1, label="offered rate")
    top.axhline(capacity, color="#2ca02c", linestyle=":", linewidth=1, label="capacity")
    top.set_ylabel("requests / s")
    top.set_ylim(bottom=0)
    top.grid(alpha=0.3)
    top.legend(fontsize=7, ncol=3)
    if title:
        top.set_title(title, fontsize=9)
    _rss_axis(bottom, rss)
    return _save(fig, path)


def soak_plot(rss: RssSeries, kv: Sequence[KVSnapshot], path: Path, *, warmup_s: float,
              slope_mb_per_hour: float | None, title: str | None = None) -> Path:
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(6.5, 5.2), sharex=True)
    _rss_axis(top, rss)
    top.axvspan(0, warmup_s, color="gray", alpha=0.15, label="warm-up")
    fit = rss.after(warmup_s)
    if slope_mb_per_hour is not None and len(fit) >= 3:
        t = np.array([s.t for s in fit])
        b, a = np.polyfit(t, [s.rss_mb for s in fit], 1)
        top.plot(t, a + b * t, color="black", linestyle="--", linewidth=1,
                 label=f"fit: {slope_mb_per_hour:+.1f} MB/h")
    top.legend(fontsize=7)
    top.set_xlabel("")
    if title:
        top.set_title(title, fontsize=9)
    t_kv = [s.t for s in kv]
    bottom.plot(t_kv, [s.used_blocks for s in kv], label="KV blocks in use (engines)",
                color="#1f77b4")
    host = [s.host_used_blocks for s in kv]
    if any(h is not None for h in host):
        bottom.plot(t_kv, [h or 0 for h in host], label="host-tier blocks", color="#ff7f0e")
    bottom.set_ylabel("KV blocks")
    bottom.set_xlabel("time (s)")
    bottom.set_ylim(bottom=0)
    bottom.grid(alpha=0.3)
    if kv:
        bottom.legend(fontsize=7)
    return _save(fig, path)


def _save(fig: plt.Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
