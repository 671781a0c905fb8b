"""The serving-loop runs of a GPU script in one file, a line each to read.

    python -m studies.engine_gpu.loops_summary <out folder> <run json>...

Writes `<out folder>/loops.json` ({run name: its `engine_loop` record}) from
the records that exist and prints each run's throughput, iterations, whether
every request finished and every block came back, its collections where
recorded, and its TTFT quantiles.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

_KEYS = ("output_tokens_per_s", "wall_s", "iterations", "all_finished", "free_blocks_after",
         "num_blocks", "gc_thresholds", "gc")


def main(argv: list[str]) -> None:
    out, runs = Path(argv[0]), [Path(p) for p in argv[1:]]
    rows = {p.stem: json.loads(p.read_text()) for p in runs if p.exists()}
    (out / "loops.json").write_text(json.dumps(rows, indent=1))
    for name, d in rows.items():
        shown = {k: round(d[k], 2) if isinstance(d[k], float) else d[k] for k in _KEYS if k in d}
        print(name, shown, "ttft", {k: round(v, 2) for k, v in d["ttft_s"].items()})


if __name__ == "__main__":
    main(sys.argv[1:])
