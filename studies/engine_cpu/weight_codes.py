"""SmolLM2's projections multiplied from its GGUF codes against the same
kernel on float32 weights, and against `transformers` eager, in one process.

Three engines side by side, step by step in turn: ours with `weight_codes`
(every projection from its Q4_1 codes, the lm_head from the embedding's Q8_0
ones: engine/csrc/gemm_f32_codes.cpp), ours with float32 weights on the same
GEMM ("values" in the JSON), and HF eager with a `DynamicCache`.  Decode steps at each batch size
over 128-token contexts (`--context`), each sequence on its own copy of the context's K/V
(as `bench.engine_bench --distinct-kv`), then prefill of one prompt; medians.
The greedy tokens of the two engines are compared step by step (the products
are the same bits, so the tokens must be the same).

    taskset -c 1 python -m studies.engine_cpu.weight_codes \
        --out studies/engine_cpu/weight_codes.json

In bfloat16 on a CPU with AMX, the projections from their codes on the
tiles at up to 64 rows, from their bf16 values beyond
(engine/csrc/gemm_bf16_codes.cpp), against the bf16 weights alone:

    taskset -c 0 python -m studies.engine_cpu.weight_codes --dtype bfloat16 \
        --pack bf16_dot --batches 1,8,32,64,96 --context 256 \
        --out studies/engine_cpu/weight_codes_bf16_amx.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from bench.engine_bench import HFBench, OursBench, parse_args as bench_args


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="float32")
    p.add_argument("--pack", default="f32_fma", help="pack_projections of both engines")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3, help="rounds of every measurement")
    p.add_argument("--prefill", type=int, default=512)
    p.add_argument("--context", type=int, default=128, help="decode context per sequence")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    batches = [int(b) for b in a.batches.split(",")]
    common = ["--decode-batches", a.batches, "--decode-steps", str(a.steps), "--warmup", "1",
              "--decode-context", str(a.context),
              "--prefill-lens", str(a.prefill), "--distinct-kv", "--threads", "1",
              "--pack-projections", a.pack]
    codes = OursBench(bench_args(common), a.dtype)
    plain = OursBench(bench_args([*common, "--no-weight-codes"]), a.dtype)
    hf = HFBench(codes.runner.model_path, codes.runner.dtype)
    assert codes.runner.model.weight_codes() and not plain.runner.model.weight_codes()
    gen = torch.Generator().manual_seed(0)
    vocab = min(codes.runner.vocab_size, len(codes.runner.tokenizer))
    rows: list[dict[str, Any]] = []
    for b in batches:
        times: dict[str, list[float]] = {"codes": [], "values": [], "hf": []}
        for _ in range(a.rounds):
            prompt = torch.randint(100, vocab, (codes.ctx,), generator=gen).tolist()
            steps = {"codes": codes.start_decode(prompt, b),
                     "values": plain.start_decode(prompt, b), "hf": hf.start_decode(prompt, b)}
            for i in range(1 + a.steps):
                for name, step in steps.items():
                    t = step()
                    if i:
                        times[name].append(t)
            assert codes.runner._requests.keys() and all(
                codes.runner._requests[j].output_token_ids
                == plain.runner._requests[k].output_token_ids
                for j, k in zip(codes._decode_jobs, plain._decode_jobs)), "tokens differ"
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        rows.append({"kind": "decode", "batch": b, "ms": med,
                     "tok_s": {k: b / v * 1e3 for k, v in med.items()},
                     "codes_over_values": med["values"] / med["codes"],
                     "codes_over_hf": med["hf"] / med["codes"],
                     "values_over_hf": med["hf"] / med["values"]})
        print(json.dumps(rows[-1]))
    prompt = torch.randint(100, vocab, (a.prefill,), generator=gen).tolist()
    ptimes: dict[str, list[float]] = {"codes": [], "values": [], "hf": []}
    for _ in range(a.rounds):
        for name, fn in (("codes", lambda: codes.prefill(prompt)),
                         ("values", lambda: plain.prefill(prompt)),
                         ("hf", lambda: hf.prefill(prompt))):
            t = time.perf_counter()
            fn()
            ptimes[name].append(time.perf_counter() - t)
    med = {k: statistics.median(v) * 1e3 for k, v in ptimes.items()}
    rows.append({"kind": "prefill", "tokens": a.prefill, "ms": med,
                 "codes_over_values": med["values"] / med["codes"],
                 "codes_over_hf": med["hf"] / med["codes"]})
    print(json.dumps(rows[-1]))
    report = {"meta": {"dtype": a.dtype, "pack": a.pack, "steps": a.steps, "rounds": a.rounds,
                       "weight_codes": codes.runner.model.weight_codes(), "context": codes.ctx,
                       "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                       "torch": torch.__version__, "statistic": "median"},
              "results": rows}
    if a.out is not None:
        a.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
