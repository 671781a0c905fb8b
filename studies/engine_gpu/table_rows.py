"""The decode graphs' block-table staging on the host: every id of every row
each step (`fill_block_tables`) against only the rows whose table changed
(`engine/table_rows.TableRows`), over a steady decode of `--batch` sequences
whose contexts start spread over `--context` tokens, each taking a new block
(a new list, as the scheduler hands one out) when it crosses a block's end, and
a new sequence taking the row of one that reaches twice `--context`.
Both are timed at every step, on the same steps, and their rows compared.

    python -m studies.engine_gpu.table_rows --out studies/engine_gpu/step_inputs/table_rows.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from engine.attention import SeqSpan
from engine.table_rows import TableRows, fill_block_tables


def main(argv: list[str] | None = None) -> dict[str, object]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--out", type=Path)
    a = p.parse_args(argv)
    bs, width = a.block_size, 2 * a.context // a.block_size
    rng = random.Random(0)
    free = list(range(a.batch * width * 4))
    rng.shuffle(free)
    positions = [rng.randrange(a.context // 2, a.context) for _ in range(a.batch)]
    tables = [[free.pop() for _ in range(pos // bs + 1)] for pos in positions]
    full_buf = np.zeros((a.batch, width), np.int32)
    rows_buf = np.zeros((a.batch, width), np.int32)
    rows = TableRows(a.batch)
    times: dict[str, list[float]] = {"every_row": [], "changed_rows": []}
    written = 0
    for _ in range(a.steps):
        for i in range(a.batch):
            positions[i] += 1
            if positions[i] // bs + 1 > width:  # ended: a new sequence takes the row
                free.extend(tables[i])
                positions[i] = rng.randrange(a.context // 2, a.context)
                tables[i] = [free.pop(0) for _ in range(positions[i] // bs + 1)]
            elif positions[i] // bs + 1 > len(tables[i]):
                tables[i] = [*tables[i], free.pop()]
        spans = [SeqSpan(pos, 1, t) for pos, t in zip(positions, tables)]
        need = np.array([pos // bs + 1 for pos in positions])
        t0 = time.perf_counter()
        fill_block_tables(full_buf, spans, need)
        t1 = time.perf_counter()
        written += rows.fill(rows_buf, spans, need)
        t2 = time.perf_counter()
        times["every_row"].append(t1 - t0)
        times["changed_rows"].append(t2 - t1)
        mask = np.arange(width) < need[:, None]
        assert np.array_equal(full_buf[mask], rows_buf[mask])
    doc: dict[str, object] = {
        "command": "python -m studies.engine_gpu.table_rows " + " ".join(
            sys.argv[1:] if argv is None else argv),
        "batch": a.batch, "context": a.context, "block_size": bs, "steps": a.steps,
        "median_us": {k: round(1e6 * statistics.median(v), 1) for k, v in times.items()},
        "rows_written_per_step": round(written / a.steps, 2)}
    print(json.dumps(doc))
    if a.out is not None:
        a.out.write_text(json.dumps(doc, indent=2) + "\n")
    return doc


if __name__ == "__main__":
    main()
