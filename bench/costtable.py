"""The table cost model: iteration times measured on our engine.

`python -m bench profile` (the engine alone) and `python -m bench
profile-live` (a running server's own iterations) write a `CostTable`;
`TableCostModel` turns it into iteration and swap times for the simulator.
Decode iterations are interpolated in the measured (batch, context) grid,
prefill work on top of them is a non-negative linear fit, swaps are linear in
blocks (see `CostTable.decode_grid` for why decodes are not linear).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from bench.costmodel import TABLE_FEATURES, BatchShape


def fit_nonnegative(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with coefficients >= 0 (drop the most negative, refit)."""
    active = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        if (sol >= 0).all():
            coef[:] = 0.0
            coef[active] = sol
            return coef
        active.pop(int(np.argmin(sol)))
    return coef


# The batch features a measurement keeps (a subset of `BatchShape`).
_SHAPE_FIELDS = ("prefill_tokens", "prefill_attn", "prefill_chunks", "decode_tokens",
                 "decode_context")


class Measurement(BaseModel):
    """One profiled iteration: its batch features and measured seconds."""

    model_config = ConfigDict(extra="forbid")

    prefill_tokens: int = 0
    prefill_attn: int = 0
    prefill_chunks: int = 0
    decode_tokens: int = 0
    decode_context: int = 0
    time: float
    # Time the engine reported for its forward pass (StepResult).
    engine_time: float | None = None

    @classmethod
    def of(cls, s: BatchShape, time: float, engine_time: float | None = None) -> "Measurement":
        return cls(**{f: getattr(s, f) for f in _SHAPE_FIELDS}, time=time,
                   engine_time=engine_time)

    def shape(self) -> BatchShape:
        return BatchShape(**{f: getattr(self, f) for f in _SHAPE_FIELDS})


class SwapMeasurement(BaseModel):
    model_config = ConfigDict(extra="forbid")

    blocks: int
    time: float


class CostTable(BaseModel):
    """The profiler's output file (and the `TableCostModel`'s input)."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["cost_table"] = "cost_table"
    model: str
    device: str
    dtype: str
    num_threads: int | None = None
    block_size: int
    measurements: list[Measurement]
    swaps: list[SwapMeasurement] = Field(default_factory=list)
    # Fitted coefficients, seconds per unit of each of TABLE_FEATURES.
    coef: dict[str, float] = Field(default_factory=dict)
    # Decode-only iterations as measured, [batch, mean context, seconds]
    # (medians per profiled point).  Decode time on a CPU is far from
    # linear: one row is a matrix-vector product, a few rows a small GEMM
    # (51 / 95 / 109 / 219 ms at batch 1 / 4 / 8 / 32, context 64, one EPYC
    # thread), and the cost per context token grows with the batch once the
    # gathered KV leaves the caches (batch 32: 220 / 575 / 1,400 ms at
    # context 64 / 256 / 768).  So decodes are interpolated in this grid and
    # only prefill work is linear (`coef`).
    decode_grid: list[tuple[int, float, float]] = Field(default_factory=list)
    swap_per_block: float | None = None
    # Bytes of one KV block over the whole model (K and V, every layer), for
    # the simulator's swap traffic; None in tables profiled before it was kept.
    block_bytes: int | None = None
    swap_const: float = 0.0
    # Mean absolute relative error of the fit over the measurements.
    fit_error: float | None = None
    created: str | None = None

    def fitted(self) -> "CostTable":
        ms = self.measurements
        if not ms:
            raise ValueError("cost table has no measurements")
        x = np.asarray([m.shape().features() for m in ms])
        y = np.asarray([m.time for m in ms])
        # Relative least squares (rows scaled by 1/y): iteration times span
        # 40 ms decodes to 2 s prefills, and the simulator needs each one
        # right in proportion; a plain fit spends itself on the big ones
        # and drops the per-iteration constant.
        w = 1.0 / np.maximum(y, 1e-9)
        c = fit_nonnegative(x * w[:, None], y * w)
        upd: dict[str, Any] = {"coef": dict(zip(TABLE_FEATURES, map(float, c))),
                               "fit_error": float(np.mean(np.abs(x @ c - y) / np.maximum(y, 1e-9)))}
        grid = _decode_grid(ms)
        if grid:
            # Prefill work on top of the decodes it rides with.
            px = np.asarray([[0.0 if m.decode_tokens else 1.0, m.prefill_tokens, m.prefill_attn,
                              m.prefill_chunks] for m in ms if m.prefill_tokens])
            dec = DecodeGrid(grid)
            py = np.asarray([m.time - dec.time(m.decode_tokens, m.decode_context)
                             for m in ms if m.prefill_tokens])
            pw = 1.0 / np.asarray([m.time for m in ms if m.prefill_tokens])
            pc = fit_nonnegative(px * pw[:, None], py * pw) if len(py) else np.zeros(4)
            coef = dict.fromkeys(TABLE_FEATURES, 0.0)
            coef.update(const=float(pc[0]), prefill_tokens=float(pc[1]),
                        prefill_attn=float(pc[2]), prefill_chunks=float(pc[3]))
            upd.update(coef=coef, decode_grid=grid)
            model = TableCostModel(self.model_copy(update=upd))
            pred = np.asarray([model.iteration_time(m.shape()) for m in ms])
            upd["fit_error"] = float(np.mean(np.abs(pred - y) / np.maximum(y, 1e-9)))
        if self.swaps:
            sx = np.asarray([[1.0, s.blocks] for s in self.swaps])
            sy = np.asarray([s.time for s in self.swaps])
            sc = fit_nonnegative(sx, sy)
            upd["swap_const"], upd["swap_per_block"] = float(sc[0]), float(sc[1])
        return self.model_copy(update=upd)


def _context_level(ctx: float) -> int:
    # Points of one profiled context differ by a few tokens (the jobs grow
    # while it is measured): one level per power of two.
    return round(math.log2(max(ctx, 1.0)))


def _decode_grid(ms: list[Measurement]) -> list[tuple[int, float, float]]:
    groups: dict[tuple[int, int], list[Measurement]] = {}
    for m in ms:
        if m.prefill_tokens == 0 and m.decode_tokens > 0:
            level = _context_level(m.decode_context / m.decode_tokens)
            groups.setdefault((m.decode_tokens, level), []).append(m)
    return sorted(
        (b, float(np.median([m.decode_context / b for m in g])), float(np.median([m.time for m in g])))
        for (b, _), g in groups.items())


def _interp(x: float, xs: list[float], ys: list[float]) -> float:
    """Piecewise linear through the points; linear beyond the last two,
    flat below the first."""
    if len(xs) == 1 or x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
        return ys[-1] + slope * (x - xs[-1])
    return float(np.interp(x, xs, ys))


class DecodeGrid:
    """Decode part of an iteration from `CostTable.decode_grid`: in each
    profiled context level, by batch size; then between the levels by the
    mean context per job.  The levels are arranged once, not per call (the
    simulator asks once per iteration)."""

    def __init__(self, grid: list[tuple[int, float, float]]) -> None:
        rows: dict[int, list[tuple[int, float, float]]] = {}
        for b, c, t in grid:
            rows.setdefault(_context_level(c), []).append((b, c, t))
        # (mean context of the level, batch sizes, times), by context.
        self._levels = [
            ([float(b) for b, _, _ in row], [t for _, _, t in row])
            for row in (sorted(rows[lv]) for lv in sorted(rows))
        ]
        # Mean context of each level, in the same order.
        self._contexts = [float(np.mean([c for _, c, _ in rows[lv]])) for lv in sorted(rows)]

    def time(self, batch: int, context: int) -> float:
        if batch <= 0 or not self._levels:
            return 0.0
        times = [_interp(float(batch), bs, ts) for bs, ts in self._levels]
        return max(0.0, _interp(context / batch, self._contexts, times))


class TableCostModel:
    """Iteration time from a fitted `CostTable`."""

    def __init__(self, table: CostTable, iteration_overhead: float = 0.0) -> None:
        if not table.coef:
            table = table.fitted()
        self.table = table
        self._coef = np.asarray([table.coef.get(f, 0.0) for f in TABLE_FEATURES])
        self._decode = DecodeGrid(table.decode_grid) if table.decode_grid else None
        self.iteration_overhead = iteration_overhead
        self.name = f"table:{table.model}/{table.device}"

    @classmethod
    def load(cls, path: Path, iteration_overhead: float = 0.0) -> "TableCostModel":
        return cls(CostTable.model_validate_json(Path(path).read_text()), iteration_overhead)

    def iteration_time(self, shape: BatchShape) -> float:
        if shape.num_tokens == 0:
            return 0.0
        c = self._coef
        prefill = (c[1] * shape.prefill_tokens + c[2] * shape.prefill_attn
                   + c[3] * shape.prefill_chunks)
        if self._decode is not None and shape.decode_tokens:
            t = self._decode.time(shape.decode_tokens, shape.decode_context) + prefill
        else:
            t = c[0] + prefill + c[4] * shape.decode_tokens + c[5] * shape.decode_context
        return float(t) + self.iteration_overhead

    def swap_time(self, num_blocks: int) -> float:
        if num_blocks <= 0:
            return 0.0
        per = self.table.swap_per_block
        if per is None:
            raise ValueError("cost table has no swap measurements")
        return self.table.swap_const + per * num_blocks

    def describe(self) -> dict[str, Any]:
        return {
            "kind": "table",
            "name": self.name,
            "coef": self.table.coef,
            "swap_per_block": self.table.swap_per_block,
            "fit_error": self.table.fit_error,
            "iteration_overhead": self.iteration_overhead,
        }
