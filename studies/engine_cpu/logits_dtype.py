"""A bf16 model's logits kept in bf16 on CPU against a float32 copy of every
row (what the lm_head's output went through before), alternated step by step
on one runner.

A batch-96 SmolLM2 step's lm_head writes 96 x 49,152 logits; widening them
to float32 wrote 19 MB more and read 9 MB, only for the greedy argmax to read
the copy again.  Now the model hands the sampler its logits in the model's
dtype (`CausalLM.vocab_logits`) and the argmax operator reads bf16 rows
(`engine/csrc/logits.cpp`); the sampler widens them only where it needs
float32 (temperature, penalties, logprobs).  The decode batch is
`amx_decode_step.spread_batch`'s: each sequence's K/V in its own blocks at
random places, read from memory as in a served step.  Each step also
checks that the other mode would have sampled the same tokens from the same
lm_head output.  One thread, pinned
where the caller pins it.

    taskset -c 0 python -m studies.engine_cpu.logits_dtype --batch 32,96 \\
        --out studies/engine_cpu/logits_dtype.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from bench.engine_bench import _ints
from bench.report import machine_meta, write_report
from engine.models.base import CausalLM
from scheduler.plan import Plan, ScheduledChunk
from studies.engine_cpu.amx_decode_step import spread_batch


def _alternate(batch: int, context: int, steps: int, bs: int, seed: int) -> dict[str, object]:
    runner, jobs, tables, first = spread_batch(batch, context, steps, bs, seed)
    real = CausalLM.vocab_logits
    raw: list[torch.Tensor] = []  # the lm_head's own output, each pass

    def kept(self: CausalLM, hidden: torch.Tensor, head: torch.Tensor) -> torch.Tensor | None:
        out = real(self, hidden, head)
        if out is not None:
            raw.append(out)
        return out

    def widened(self: CausalLM, hidden: torch.Tensor, head: torch.Tensor) -> torch.Tensor | None:
        out = kept(self, hidden, head)
        return None if out is None else out.float()

    last = [first] * batch
    times: dict[str, list[float]] = {"bf16": [], "float32": []}
    same = True
    try:
        for step in range(steps):
            mode = "bf16" if step % 2 == 0 else "float32"
            CausalLM.vocab_logits = kept if mode == "bf16" else widened  # type: ignore[method-assign]
            chunks = [ScheduledChunk(job, [tok], context + step, table, True, step + 1)
                      for job, tok, table in zip(jobs, last, tables)]
            raw.clear()
            t0 = time.perf_counter()
            res = runner.execute(Plan(step, chunks))
            times[mode].append(time.perf_counter() - t0)
            last = [o.token_id for o in res.outputs]  # type: ignore[misc]
            # The token the other mode would have sampled from the same
            # logits: the argmax of the float32 copy, or of the bf16 rows.
            assert len(raw) == 1 and raw[0].dtype is torch.bfloat16
            other = (raw[0].float() if mode == "bf16" else raw[0]).argmax(dim=-1).tolist()
            same = same and other == last
    finally:
        CausalLM.vocab_logits = real  # type: ignore[method-assign]
    # The first step of each mode warms it up.
    b16, f32 = statistics.median(times["bf16"][1:]), statistics.median(times["float32"][1:])
    row = {"batch": batch, "context": context, "steps_each": steps // 2 - 1,
           "bf16_logits_ms": round(b16 * 1e3, 2), "float32_logits_ms": round(f32 * 1e3, 2),
           "speedup": round(f32 / b16, 4), "same_tokens": same}
    print(row, flush=True)
    return row


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m studies.engine_cpu.logits_dtype",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=_ints, default=[32, 96])
    ap.add_argument("--context", type=int, default=320)
    ap.add_argument("--steps", type=int, default=30, help="decode steps, alternating modes")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows = [_alternate(b, a.context, a.steps, a.block_size, seed=b) for b in a.batch]
    meta = {"context": a.context, "steps": a.steps, "block_size": a.block_size, "threads": 1,
            "dtype": "bfloat16", **machine_meta()}
    write_report({"meta": meta, "rows": rows}, a.out)


if __name__ == "__main__":
    main()
