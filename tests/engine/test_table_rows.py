"""The decode graphs' block-table rows are rewritten only where a step
brings another table (engine/table_rows.py), and always hold what a full
fill would write."""

from __future__ import annotations

import random

import numpy as np

from engine.attention import SeqSpan
from engine.table_rows import TableRows, fill_block_tables

BS, WIDTH = 4, 8


def _spans(tables: list[list[int]], positions: list[int]) -> list[SeqSpan]:
    return [SeqSpan(p, 1, t) for t, p in zip(tables, positions)]


def _need(spans: list[SeqSpan]) -> np.ndarray:
    return np.array([s.start_pos // BS + 1 for s in spans])


def _check(buffer: np.ndarray, spans: list[SeqSpan]) -> None:
    """Each row's needed ids equal a full fill's."""
    need = _need(spans)
    full = np.full_like(buffer, -1)
    fill_block_tables(full, spans, need)
    for i, k in enumerate(need.tolist()):
        assert buffer[i, :k].tolist() == full[i, :k].tolist() == list(spans[i].block_table[:k])


def test_only_rows_with_another_table_are_written():
    rows = TableRows(4)
    buffer = np.full((4, WIDTH), -1, np.int32)
    tables = [[0, 1], [2, 3, 4], [5], [6, 7]]
    spans = _spans(tables, [5, 9, 2, 6])
    assert rows.fill(buffer, spans, _need(spans)) == 4
    _check(buffer, spans)
    # The next decode step: same lists, one position further, none needs a new block.
    spans = _spans(tables, [6, 10, 3, 7])
    assert rows.fill(buffer, spans, _need(spans)) == 0
    _check(buffer, spans)
    # Sequence 2 took a block: the scheduler hands out a new list.
    tables[2] = [5, 9]
    spans = _spans(tables, [7, 11, 4, 7])
    assert rows.fill(buffer, spans, _need(spans)) == 1
    _check(buffer, spans)


def test_a_list_grown_in_place_or_moved_to_another_row_is_rewritten():
    rows = TableRows(3)
    buffer = np.full((3, WIDTH), -1, np.int32)
    a, b, c = [0, 1], [2, 3], [4, 5]
    spans = _spans([a, b, c], [5, 5, 5])
    rows.fill(buffer, spans, _need(spans))
    a.append(8)  # the same object, needing an id it did not have
    spans = _spans([a, b, c], [8, 5, 5])
    assert rows.fill(buffer, spans, _need(spans)) == 1
    _check(buffer, spans)
    # A sequence ended: the others move up a row.
    spans = _spans([b, c], [6, 6])
    assert rows.fill(buffer, spans, _need(spans)) == 2
    _check(buffer, spans)


def test_a_steady_decode_matches_a_full_fill_every_step():
    rng = random.Random(0)
    n, free = 6, list(range(200))
    rng.shuffle(free)
    tables = [[free.pop()] for _ in range(n)]
    positions = [rng.randrange(BS) for _ in range(n)]
    rows = TableRows(n)
    buffer = np.full((n, WIDTH), -1, np.int32)
    written = 0
    for _ in range(3 * BS * 2):
        for i in range(n):
            positions[i] += 1
            if positions[i] // BS + 1 > len(tables[i]):
                tables[i] = [*tables[i], free.pop()]  # as `Job.table_copy` hands out
            if positions[i] >= BS * WIDTH - 1:  # finished: a new sequence takes the row
                tables[i], positions[i] = [free.pop()], 0
        spans = _spans(tables, positions)
        written += rows.fill(buffer, spans, _need(spans))
        _check(buffer, spans)
    # One row in BS steps on average, not every row every step.
    assert written < n * 3 * BS * 2 / 2
