"""Block tables staged into a host buffer, and staged again only where
they changed.

The decode graphs (engine/cuda_graphs.py) and the mixed-step graphs
(engine/cuda_graphs_mixed.py) read every sequence's block table from a
pinned `[rows, width]` host buffer that stays as the last step left it.  A
table the scheduler hands out never changes afterwards: a job whose blocks
change gets a new list (`Job.table_copy`, tests/scheduler/test_chunk_tables.py).
So a row whose span brings the very list written there before, needing no
more of its ids than were written, already holds them.  In a steady decode a
sequence takes a new block once in `block_size` steps, so a step rewrites a
few rows instead of every id of every row (at 128 sequences of 32 blocks,
4,096 Python ints a step, 200-330 µs of a host's time before each few-ms
step on a GPU).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain

import numpy as np

from engine.attention import SeqSpan


def fill_block_tables(tables: np.ndarray, spans: Sequence[SeqSpan], need: np.ndarray) -> None:
    """Row i of `tables` begins with the first `need[i]` block ids of span
    i (the rest of the row is left as it is): one pass over the ids and one
    masked store, where a store per row cost a GPU host ~2 µs a span at
    every decode step (the serving loop's profile, `studies/engine_gpu`)."""
    counts = need.tolist()
    flat = np.fromiter(chain.from_iterable(s.block_table[:k] for s, k in zip(spans, counts)),
                       np.int32, sum(counts))
    tables[: len(spans)][np.arange(tables.shape[1]) < need[:, None]] = flat


class TableRows:
    def __init__(self, rows: int) -> None:
        # Per row: the list last written there (held, so that its id is never
        # reused while it is remembered) and how many of its ids.
        self._source: list[Sequence[int] | None] = [None] * rows
        self._written = [0] * rows

    def fill(self, tables: np.ndarray, spans: Sequence[SeqSpan], need: np.ndarray) -> int:
        """Row i of `tables` begins with the first `need[i]` block ids of span
        i (the rest of the row left as it is); returns how many rows were
        written."""
        counts = need.tolist()
        source, written = self._source, self._written
        stale = [i for i, (span, k) in enumerate(zip(spans, counts))
                 if source[i] is not span.block_table or written[i] < k]
        if not stale:
            return 0
        rows = np.asarray(stale)
        block = tables[rows]
        fill_block_tables(block, [spans[i] for i in stale], need[rows])
        tables[rows] = block
        for i in stale:
            source[i] = spans[i].block_table
            written[i] = counts[i]
        return len(stale)
