"""PNG plots of the FastServe experiments (run.py writes the JSON)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {
    "fcfs-recompute": "tab:gray", "fcfs-reactive": "tab:blue", "mlfq-proactive": "tab:red",
    "mlfq-reactive": "tab:orange", "mlfq-recompute": "tab:purple",
    "mlfq-naive-proactive": "tab:green", "fixed-priority-proactive": "tab:brown",
}


def _curve(ax, pts: list[dict], label: str, color: str, short: str | None = None) -> None:
    ok = sorted((p for p in pts if not p["aborted"]), key=lambda p: p["rate"])
    ax.plot([p["rate"] for p in ok], [p["nl_mean"] for p in ok], "o-", color=color, label=label, ms=4)
    ab = [p for p in pts if p["aborted"]]
    if ab:
        ax.plot([p["rate"] for p in ab], [p["nl_mean_lower_bound"] for p in ab], "^", color=color,
                ms=7, mfc="none", label=f"{short or label}: stopped, mean NL ≥ marker")


def exp1(out: Path) -> None:
    for f in sorted(out.glob("exp1_*.json")):
        d = json.loads(f.read_text())
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for name, s in d["systems"].items():
            base = name.split("+")[0]
            _curve(ax, s["points"], f"{name} (max {s['max_rate']:g}/s)", COLORS.get(base, None) or "k", name)
        ax.axhline(d["slo_s_per_token"], ls="--", color="k", lw=1,
                   label=f"SLO 10× decode iter = {d['slo_s_per_token']:.3f} s/token")
        _finish_latency_vs_rate(fig, ax, f"OPT-13B, 1× {d['gpu'].upper()}, ShareGPT, n={d['n']} (sim)",
                                10, out / f"{f.stem}_latency_vs_rate.png")


def _finish_latency_vs_rate(fig: Any, ax: Any, title: str, title_size: int, path: Path) -> None:
    ax.set_yscale("log")
    ax.set_xlabel("job arrival rate (req/s)")
    ax.set_ylabel("mean normalized latency (s/token)")
    ax.set_title(title, fontsize=title_size)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def exp2(out: Path) -> None:
    for f in sorted(out.glob("exp2_*.json")):
        d = json.loads(f.read_text())
        ratios = sorted(d["ratios"], key=float)
        systems = ["fcfs-reactive", "fixed-priority-proactive", "mlfq-naive-proactive", "mlfq-proactive"]
        labels = {"fcfs-reactive": "FCFS", "fixed-priority-proactive": "Fixed priority",
                  "mlfq-naive-proactive": "Naive MLFQ", "mlfq-proactive": "SJ-MLFQ"}
        fig, ax = plt.subplots(figsize=(7.2, 3.8))
        w = 0.2
        for k, s in enumerate(systems):
            xs, ys, hatch = [], [], []
            for i, r in enumerate(ratios):
                pts = d["ratios"][r]["points"]
                vals = {n: (p["nl_mean_lower_bound"] if p["aborted"] else p["nl_mean"]) for n, p in pts.items()}
                top = max(vals.values())
                p = pts[s]
                xs.append(i + (k - 1.5) * w)
                ys.append(vals[s] / top)
                hatch.append(p["aborted"])
            bars = ax.bar(xs, ys, w, color=COLORS[s], label=labels[s])
            for b, h in zip(bars, hatch):
                if h:
                    b.set_hatch("//")
                    b.set_edgecolor("white")
        ax.set_xticks(range(len(ratios)))
        ax.set_xticklabels([f"{float(r):g}\n({d['ratios'][r]['rate']:.1f}/s)" for r in ratios], fontsize=8)
        ax.set_xlabel("input/output ratio (arrival rate = "
                      f"{d['load']:g} × FCFS saturated capacity at that ratio)")
        ax.set_ylabel("mean norm. latency / slowest")
        ax.set_title(f"Fig. 14 style, OPT-13B, 1× {d['gpu'].upper()} (sim); hatched: run stopped, "
                     "value is a lower bound", fontsize=9)
        ax.legend(fontsize=8, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.28))
        fig.tight_layout()
        fig.savefig(out / f"{f.stem}_io_ratio.png", dpi=110)
        plt.close(fig)


def exp3(out: Path) -> None:
    for f in sorted(out.glob("exp3_*.json")):
        d = json.loads(f.read_text())
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for name, pts in d["systems"].items():
            _curve(ax, list(pts.values()), name, COLORS.get(name, "k"))
        _finish_latency_vs_rate(
            fig, ax, f"Fig. 15a style: SJ-MLFQ KV management, OPT-13B, 1× {d['gpu'].upper()} (sim)",
            9, out / f"{f.stem}_swap_modes.png")

        pts = sorted((p for p in d["systems"]["mlfq-proactive"].values() if not p["aborted"]),
                     key=lambda p: p["rate"])
        fig, ax = plt.subplots(figsize=(6.0, 3.6))
        xs = [f"{p['rate']:g}" for p in pts]
        q = [100 * p["queueing_share"] for p in pts]
        s = [100 * p["swap_share"] for p in pts]
        e = [100 * p["execution_share"] for p in pts]
        ax.bar(xs, q, label="queueing", color="tab:gray")
        ax.bar(xs, s, bottom=q, label="swapping", color="tab:orange")
        ax.bar(xs, e, bottom=[a + b for a, b in zip(q, s)], label="execution", color="tab:blue")
        for i, v in enumerate(s):
            ax.text(i, 101, f"swap {v:.2f}%", ha="center", fontsize=7)
        ax.set_ylim(0, 110)
        ax.set_xlabel("job arrival rate (req/s)")
        ax.set_ylabel("share of E2E latency (%)")
        ax.set_title("Fig. 15b style: latency breakdown, SJ-MLFQ + proactive swapping", fontsize=9)
        ax.legend(fontsize=7, loc="lower left")
        fig.tight_layout()
        fig.savefig(out / f"{f.stem}_breakdown.png", dpi=110)
        plt.close(fig)


def main(out: Path) -> None:
    exp1(out)
    exp2(out)
    exp3(out)
    for p in sorted(out.glob("*.png")):
        print(f"wrote {p}")
