"""Sampler cost per step: our sampler against the textbook methods it
replaced, in one run.

For a batch of random logits (`--scale` sets how peaked they are), times
`Sampler.sample` with temperature alone (also on bfloat16 logits), with
top-p, with top-k and with a seed; beside it the same step without the C++
sampling operator (`engine/csrc/sample_rows.cpp`, which takes every random
row no bias, ban, penalty or grammar changes where it is built: ATen's
softmax, top-k candidates and float64 running sum instead), and done the
textbook way: the exponential race over the whole vocabulary
(`argmax(probs / Exp(1))`) for the draw, and a full sort of every row for
top-k / top-p.

    python -m bench.sampling_bench --batch 32,96 --out studies/engine_cpu/sampling.json

With `--device cuda` the logits are on the GPU, each time waits for the
device, and the "torch path" column is the candidate cut of a CPU
(`apply_top_k_top_p`, which reads back which rows need a sort) in place of
the GPU's cut chosen on the host (`top_k_top_p_without_waiting`); the rows
with top-p also time that cut alone, by the threshold search
(`cut_ms`, `engine/top_k_top_p_triton.py`) and by a sort (`cut_sorted_ms`, the
default while `SEARCH_ON_CUDA` is off).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch

from bench.report import machine_meta, write_report
import engine.sampling
from engine import attention_cpp
from engine.sampling import SampleRequest, Sampler, SamplingParams
import engine.top_k_top_p
from engine.top_k_top_p import (
    _top_k_top_p_sorted,
    apply_top_k_top_p,
    top_k_top_p_without_waiting,
)

_CASES: dict[str, dict[str, Any]] = {
    "temperature": dict(temperature=0.8),
    "temperature_bf16": dict(temperature=0.8),
    "top_p": dict(temperature=0.8, top_p=0.9),
    "top_k": dict(temperature=0.8, top_k=50),
    "top_k_top_p": dict(temperature=0.8, top_k=50, top_p=0.9),
    "seeded": dict(temperature=0.8, seed=1),
}


def _textbook(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator) -> torch.Tensor:
    x = logits / params.temperature
    vocab = x.shape[-1]
    if params.top_k_enabled or params.top_p < 1.0:
        rows = x.shape[0]
        k = torch.full((rows,), params.top_k if params.top_k_enabled else vocab,
                       device=x.device)
        p = torch.full((rows,), params.top_p, device=x.device) if params.top_p < 1.0 else None
        x = _top_k_top_p_sorted(x, k if params.top_k_enabled else None, p)
    probs = x.softmax(dim=-1)
    noise = torch.empty_like(probs).exponential_(generator=gen)
    return (probs / noise.clamp_(min=torch.finfo(noise.dtype).tiny)).argmax(dim=-1)


def _median_ms(fn: Callable[[], object], reps: int, device: torch.device) -> float:
    def run() -> None:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    run()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        run()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1000


def _without_operator(fn: Callable[[], object]) -> Callable[[], object]:
    def run() -> object:
        loaded = attention_cpp.loaded
        attention_cpp.loaded = lambda: False  # type: ignore[assignment]
        try:
            return fn()
        finally:
            attention_cpp.loaded = loaded  # type: ignore[assignment]
    return run


def _candidate_cut(
    logits: torch.Tensor, top_k: list[int] | None, top_p: list[float] | None,
) -> torch.Tensor:
    dev = logits.device
    return apply_top_k_top_p(logits, None if top_k is None else torch.tensor(top_k, device=dev),
                             None if top_p is None else torch.tensor(top_p, device=dev))


def _with_candidate_cut(fn: Callable[[], object]) -> Callable[[], object]:
    """`fn` with a GPU's rows cut as a CPU's are."""
    def run() -> object:
        cut = engine.sampling.top_k_top_p_without_waiting
        engine.sampling.top_k_top_p_without_waiting = _candidate_cut  # type: ignore[assignment]
        try:
            return fn()
        finally:
            engine.sampling.top_k_top_p_without_waiting = cut  # type: ignore[assignment]
    return run


def _cut_times(logits: torch.Tensor, params: SamplingParams, reps: int) -> dict[str, float]:
    """The GPU's top-k / top-p cut of every row alone: searched, then sorted."""
    rows, vocab = logits.shape
    ks = [params.top_k if params.top_k_enabled else vocab] * rows
    ps = [params.top_p] * rows
    x = logits.float() / params.temperature
    chosen = engine.top_k_top_p._searched_or_sorted
    times = {}
    for name, search in (("cut_ms", True), ("cut_sorted_ms", False)):
        engine.top_k_top_p._searched_or_sorted = (  # type: ignore[assignment]
            lambda lg, k, p, s=search: chosen(lg, k, p, search=s))
        try:
            times[name] = round(_median_ms(lambda: top_k_top_p_without_waiting(x, ks, ps),
                                           reps, x.device), 3)
        finally:
            engine.top_k_top_p._searched_or_sorted = chosen  # type: ignore[assignment]
    return times


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.sampling_bench", description=__doc__.split("\n")[0])
    ap.add_argument("--batch", default="32", help="comma-separated batch sizes")
    ap.add_argument("--vocab", type=int, default=49152, help="SmolLM2's vocabulary")
    ap.add_argument("--scales", type=float, nargs="+", default=[3.0, 8.0],
                    help="logits = randn * scale (larger: more peaked)")
    ap.add_argument("--reps", type=int, default=11)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu", help="cpu, or cuda: see the module's text")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    dev = torch.device(a.device)
    try:
        attention_cpp.load_kernel()
    except RuntimeError as e:
        print(f"no C++ operators ({e}): ours is the torch path", flush=True)
    other = _with_candidate_cut if dev.type == "cuda" else _without_operator
    results = []
    for batch in (int(b) for b in a.batch.split(",") if b):
        for scale in a.scales:
            logits = torch.randn(batch, a.vocab,
                                 generator=torch.Generator().manual_seed(0)).to(dev) * scale
            for name, kw in _CASES.items():
                params = SamplingParams(**kw)
                reqs = [SampleRequest(params, 5)] * batch
                rows = logits.bfloat16() if name.endswith("bf16") else logits
                sampler = Sampler(seed=0, device=dev)
                gen = torch.Generator(device=dev).manual_seed(0)
                ours = _median_ms(lambda: sampler.sample_tensor(rows, reqs), a.reps, dev)
                torch_path = _median_ms(other(lambda: sampler.sample_tensor(rows, reqs)),
                                        a.reps, dev)
                ref = _median_ms(lambda: _textbook(rows.float(), params, gen), a.reps, dev)
                row = {"batch": batch, "scale": scale, "case": name,
                       "ours_ms": round(ours, 2), "torch_path_ms": round(torch_path, 2),
                       "textbook_ms": round(ref, 2), "speedup": round(ref / ours, 2)}
                if dev.type == "cuda" and params.top_p < 1.0:  # top-k alone takes `topk`
                    row |= _cut_times(rows, params, a.reps)
                results.append(row)
                cuts = (f"   cut {row['cut_ms']:.3f} / sorted {row['cut_sorted_ms']:.3f} ms"
                        if "cut_ms" in row else "")
                print(f"batch {batch:>3} scale {scale:>4}: {name:<16} ours {ours:7.2f} ms   "
                      f"torch path {torch_path:7.2f} ms   textbook {ref:7.1f} ms{cuts}",
                      flush=True)
    meta = {"vocab": a.vocab, "threads": a.threads, "device": str(dev),
            "operator": attention_cpp.loaded(),
            **machine_meta()}
    write_report({"meta": meta, "results": results}, a.out)


if __name__ == "__main__":
    main()
