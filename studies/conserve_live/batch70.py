"""Helpers of studies/conserve_live/batch70.sh (co-serving near 70 % load,
the offline work a batch job through Ray Jobs).

    python -m studies.conserve_live.batch70 wait-offline SAMPLES.json
        until the sampler has seen the engine's first offline tokens (the
        batch job's driver has started), then 5 s more
    python -m studies.conserve_live.batch70 span FOLDER
        the online-only run's last send time (s): the window offline
        throughput is measured over
    python -m studies.conserve_live.batch70 summarize FOLDER
        every run against online-only (latency), vllm++-batch and
        offline-only-batch (offline tokens/s): summary.{json,md}
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from studies.conserve_live.batch import _tokens_at, wait_for_offline

SYSTEMS = ["online-only", "offline-only-batch", "vllm++-batch", "conserve-batch"]
SWEPT = "conserve-batch-tpot"


def wait_offline(samples: Path) -> None:
    def read() -> list[dict[str, Any]]:
        try:
            return list(json.loads(samples.read_text()))
        except (OSError, ValueError):  # not written yet, or mid-write
            return []

    wait_for_offline(read, str(samples))


def span(folder: Path) -> float:
    from bench.results import load_result

    return max(r.send_time for r in load_result(folder / "online-only.json").records)


def _row(folder: Path, name: str, window: float) -> dict[str, Any]:
    from bench.metrics import summarize as summarize_records
    from bench.results import load_result

    row: dict[str, Any] = {}
    if (folder / f"{name}.json").exists():
        online = [r for r in load_result(folder / f"{name}.json").records
                  if r.job_class == "online"]
        s = summarize_records(online)
        row.update(completed=s.num_completed, sent=len(online), ttft_p50=s.ttft.median,
                   ttft_p99=s.ttft.p99, tpot_p50=s.tpot.median, tpot_p99=s.tpot.p99)
    if (folder / f"{name}.samples.json").exists():
        start = float((folder / f"{name}.start").read_text())
        samples = json.loads((folder / f"{name}.samples.json").read_text())
        row["offline_tokens_per_s"] = (_tokens_at(samples, start + window)
                                       - _tokens_at(samples, start)) / window
        # No offline token in the window's last 10 s: the batch file ran
        # out, and the rate understates what the system could do.
        row["ran_dry"] = (_tokens_at(samples, start + window)
                          == _tokens_at(samples, start + window - 10.0))
        end = folder / f"{name}.end"
        if end.exists():  # not while the run goes on
            row["online_span_s"] = float(end.read_text()) - start
    return row


def summarize(folder: Path) -> None:
    window = span(folder)
    names = [*SYSTEMS, *sorted(p.stem for p in folder.glob(f"{SWEPT}*.json")
                               if not p.stem.endswith((".engine", ".samples")))]
    rows = {n: _row(folder, n, window) for n in names
            if (folder / f"{n}.json").exists() or (folder / f"{n}.end").exists()}
    base = rows.get("online-only", {})
    ref = rows.get("vllm++-batch", {}).get("offline_tokens_per_s")
    alone = rows.get("offline-only-batch", {}).get("offline_tokens_per_s")
    for row in rows.values():
        if "ttft_p99" in row and "ttft_p99" in base:
            row["ttft_p99_vs_online_only"] = row["ttft_p99"] / base["ttft_p99"]
            row["tpot_p99_vs_online_only"] = row["tpot_p99"] / base["tpot_p99"]
        if "offline_tokens_per_s" in row:
            if ref:
                row["offline_vs_vllmpp"] = row["offline_tokens_per_s"] / ref
            if alone:
                row["offline_vs_offline_only"] = row["offline_tokens_per_s"] / alone
    out = {"window_s": window, "systems": rows}
    (folder / "summary.json").write_text(json.dumps(out, indent=1) + "\n")
    lines = ["| system | completed | TTFT P50 / P99 (s) | TPOT P50 / P99 (s) | TTFT P99 vs online-only "
             "| offline tokens/s | vs vllm++-batch | vs offline-only |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]

    def f(row: dict[str, Any], key: str, fmt: str) -> str:
        return format(row[key], fmt) if key in row else "-"

    for name, row in rows.items():
        lines.append(
            f"| {name} | {row.get('completed', '-')}/{row.get('sent', '-')} "
            f"| {f(row, 'ttft_p50', '.3f')} / {f(row, 'ttft_p99', '.3f')} "
            f"| {f(row, 'tpot_p50', '.3f')} / {f(row, 'tpot_p99', '.3f')} "
            f"| {f(row, 'ttft_p99_vs_online_only', '.2f')} "
            f"| {f(row, 'offline_tokens_per_s', '.1f')}{' (ran dry)' if row.get('ran_dry') else ''} "
            f"| {f(row, 'offline_vs_vllmpp', '.0%')} "
            f"| {f(row, 'offline_vs_offline_only', '.0%')} |")
    (folder / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _print_span(folder: Path) -> None:
    print(f"{span(folder):.1f}")


COMMANDS = {"wait-offline": wait_offline, "span": _print_span, "summarize": summarize}


def main(argv: list[str]) -> None:
    if len(argv) != 2 or argv[0] not in COMMANDS:
        raise SystemExit(__doc__)
    COMMANDS[argv[0]](Path(argv[1]))


if __name__ == "__main__":
    main(sys.argv[1:])
