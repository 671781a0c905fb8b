"""One row per run of `bench run` results in a folder (`*.json.gz`, as
studies/latency_vs_vllm/run.sh writes them): output tokens/s, TTFT median
and P99, mean TPOT, mean E2E, refused requests.

    python -m studies.serve_path.load_table studies/serve_path/dispatch_ahead/load
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path


def row(path: Path) -> str:
    s = json.loads(gzip.decompress(path.read_bytes()))["summary"]
    ttft, tpot, e2e = s["ttft"], s["tpot"], s["e2e"]
    return (f"| {path.name.removesuffix('.json.gz')} | {s['output_token_throughput']:.1f} | "
            f"{1e3 * ttft['median']:.0f} / {1e3 * ttft['p99']:.0f} | {1e3 * tpot['mean']:.1f} | "
            f"{e2e['mean']:.2f} | {s['num_rejected']} of {s['num_requests']} |")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m studies.serve_path.load_table",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path)
    a = ap.parse_args(argv)
    print("| run | output tok/s | TTFT median / P99 (ms) | mean TPOT (ms) | mean E2E (s) | "
          "refused |")
    print("| --- | --- | --- | --- | --- | --- |")
    for path in sorted(a.folder.glob("*.json.gz")):
        print(row(path))


if __name__ == "__main__":
    main()
