"""Two configurations of our engine timed alternately, run by run, so that
a neighbour process on the shared host slows both alike: two engines
(`engines`, `alternate`), or one engine's switch thrown between runs
(`switched`)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from bench.engine_bench import OursBench
from bench.engine_bench import parse_args as engine_args


def engines(model: str, variants: dict[str, list[str]], prefill_lens: list[int],
            batches: list[int], reps: int, dtype: str = "float32") -> dict[str, OursBench]:
    """One `OursBench` per variant, built from engine_bench flags."""
    out = {}
    for name, flags in variants.items():
        args = engine_args(["--model", model, "--dtypes", dtype, "--decode-context", "256",
                            "--decode-steps", str(reps), "--warmup", "1",
                            "--prefill-lens", ",".join(map(str, prefill_lens)),
                            "--decode-batches", ",".join(map(str, batches)), *flags])
        out[name] = OursBench(args, dtype)
    return out


def alternate(benches: dict[str, OursBench], prefill_lens: list[int], batches: list[int],
              reps: int) -> list[dict[str, Any]]:
    """Prefill (one prompt) and decode (256-token contexts) tokens/s of each
    engine, medians of `reps`, the engines taking turns."""
    names = list(benches)
    first = benches[names[0]].runner
    vocab = min(first.vocab_size, len(first.tokenizer))
    gen = torch.Generator().manual_seed(0)
    rows = []
    for n in prefill_lens:
        p = torch.randint(100, vocab, (n,), generator=gen).tolist()
        times: dict[str, list[float]] = {k: [] for k in names}
        for k in names:
            benches[k].prefill(p)  # warm-up
        for _ in range(reps):
            for k in names:
                t = time.perf_counter()
                benches[k].prefill(p)
                times[k].append(time.perf_counter() - t)
        rows.append(_row("prefill", n, n, times))
    for b in batches:
        p = torch.randint(100, vocab, (256,), generator=gen).tolist()
        steps = {k: benches[k].start_decode(p, b) for k in names}
        times = {k: [] for k in names}
        for i in range(reps + 1):
            for k in names:
                dt = steps[k]()
                if i:
                    times[k].append(dt)
        rows.append(_row("decode", b, b, times))
    return rows


def _row(kind: str, size: int, tokens: int, times: dict[str, list[float]]) -> dict[str, Any]:
    names = list(times)
    tps = {k: tokens / statistics.median(v) for k, v in times.items()}
    row: dict[str, Any] = {"kind": kind, "size": size}
    for k in names:
        row[f"{k}_tok_s"] = round(tps[k], 1)
        row[f"{k}_times_s"] = [round(t, 4) for t in times[k]]
    row["ratio"] = round(tps[names[1]] / tps[names[0]], 3)
    print(f"{kind} {size}: " + ", ".join(f"{k} {tps[k]:.1f} tok/s" for k in names)
          + f" ({row['ratio']:.2f}x)", flush=True)
    return row


def switched(ways: Sequence[tuple[str, bool]], switch: Callable[[bool], object],
             run: Callable[[], float], rounds: int, warmup: int = 0,
             digits: int = 3) -> dict[str, float]:
    """`run` (returning ms) under each of two ways, `switch(on)` before
    each; the ways swap places every round so that neither always runs
    first; the first `warmup` rounds untimed.  The medians (`<way>_ms`) and
    the first way's over the second's (`speedup`)."""
    times: dict[str, list[float]] = {w: [] for w, _ in ways}
    for r in range(warmup + rounds):
        for way, on in (ways if r % 2 == 0 else ways[::-1]):
            switch(on)
            elapsed = run()
            if r >= warmup:
                times[way].append(elapsed)
    row = {f"{w}_ms": round(statistics.median(ts), digits) for w, ts in times.items()}
    first, second = (w for w, _ in ways)
    row["speedup"] = round(row[f"{first}_ms"] / row[f"{second}_ms"], 3)
    return row


def switched_prefills(bench: OursBench, lens: Sequence[int], ways: Sequence[tuple[str, bool]],
                      switch: Callable[[bool], object], rounds: int) -> list[dict[str, Any]]:
    """`switched` on one prefill step of `bench` for a prompt of each of
    `lens` tokens (one round of warm-up), a row each, printed."""
    rows = []
    for n in lens:
        prompt = [(7 * i + 100) % 40000 + 100 for i in range(n)]

        def prefill() -> float:
            t = time.perf_counter()
            bench.prefill(prompt)
            return (time.perf_counter() - t) * 1e3

        rows.append({"kind": "prefill", "tokens": n,
                     **switched(ways, switch, prefill, rounds, warmup=1, digits=2)})
        print(rows[-1], flush=True)
    return rows


def switched_steps(lens: Sequence[int], batches: Sequence[int],
                   ways: Sequence[tuple[str, bool]], switch: Callable[[bool], object],
                   rounds: int) -> list[dict[str, Any]]:
    """`switched` on whole bf16 steps of one engine in deterministic mode,
    the server's on CPU (greedy, lm_head and sampling included): a prefill
    of each of `lens` tokens, then decode steps at each of `batches`
    sequences of 128-token contexts, each its own (a round's figure the
    median of 4 steps)."""
    ea = engine_args(["--prefill-lens", ",".join(map(str, lens)),
                      "--decode-batches", ",".join(map(str, batches)),
                      "--decode-context", "128", "--decode-steps", str(8 * (rounds + 1)),
                      "--warmup", "0", "--threads", "1", "--no-hf", "--distinct-kv",
                      "--deterministic"])
    bench = OursBench(ea, "bfloat16")
    rows = switched_prefills(bench, lens, ways, switch, rounds)
    for b in batches:
        step = bench.start_decode([(5 * i + 300) % 40000 + 100 for i in range(128)], b)
        rows.append({"kind": "decode", "batch": b, **switched(
            ways, switch, lambda: statistics.median(step() for _ in range(4)) * 1e3, rounds,
            warmup=1, digits=2)})
        print(rows[-1], flush=True)
    return rows
