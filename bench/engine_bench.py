"""Engine micro-benchmark: our paged-KV engine against the `transformers` reference.

Measures, in one process and interleaved configuration by configuration (so
that a neighbour process slows both sides alike):

- prefill tokens/s of one prompt of 128 / 512 / 1024 tokens (batch 1);
- decode tokens/s at batch 1 / 8 / 32 with a context of ~128 tokens each;

for our `ModelRunner` (driven through its public `execute(Plan)` API) and for
Hugging Face's eager forward with a `DynamicCache`, in each requested dtype.
Both sample greedily, so both pay for the lm_head and an argmax.

Decode contexts are built once and shared: one prompt is prefilled, then our
batch's block tables all point at its (full) blocks, and the reference's
cache is repeated along the batch.  Decode cost does not depend on the KV
values, and this keeps a bf16 run on a CPU without native bf16 inside the
time budget.

    python -m bench.engine_bench --out studies/engine_cpu/engine.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch

from engine.attention import default_backend_name
from engine.runner import ModelRunner
from engine.sampling_params import SamplingParams
from scheduler.plan import Plan, ScheduledChunk

GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.engine_bench",
        description="Prefill and decode throughput of our engine vs HF eager + DynamicCache.",
    )
    p.add_argument("--model", default="embedded:smollm2",
                   help="embedded:<name> or a local HF folder")
    p.add_argument("--dtypes", default="bfloat16,float32",
                   help="comma-separated, e.g. bfloat16,float32")
    p.add_argument("--prefill-lens", type=_ints, default=[128, 512, 1024])
    p.add_argument("--decode-batches", type=_ints, default=[1, 8, 32])
    p.add_argument("--decode-context", type=int, default=128,
                   help="context per sequence (rounded down to a multiple of --block-size)")
    p.add_argument("--decode-steps", type=int, default=8, help="timed decode steps per batch size")
    p.add_argument("--reps", type=int, default=2, help="timed prefill runs per length")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs before measuring")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--attention", default=None,
                   help="our attention backend (torch | compiled | cpp); default: the engine's")
    p.add_argument("--deterministic", action="store_true",
                   help="run our engine in deterministic (batch-invariant) mode")
    p.add_argument("--pack-projections", default="auto",
                   choices=["auto", "always", "bf16_dot", "f32_fma", "never"],
                   help="projection weights packed for oneDNN (always) or our bf16 / f32 "
                   "kernel (bf16_dot / f32_fma); default: the engine's auto")
    p.add_argument("--no-weight-codes", action="store_true",
                   help="keep float32 weights where `f32_fma` would multiply a GGUF weight "
                   "from its codes (engine/models/packed_f32.py)")
    p.add_argument("--distinct-kv", action="store_true",
                   help="each decode sequence reads its own copy of the context's KV blocks (as "
                   "HF's cache holds one per row, and as distinct requests do); default: the "
                   "batch shares the prompt's blocks")
    p.add_argument("--no-hf", action="store_true", help="skip the transformers reference")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    return p.parse_args(argv)


def _time_once(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


# Our engine --------------------------------------------------------------


class OursBench:
    def __init__(self, args: argparse.Namespace, dtype: str) -> None:
        bs = args.block_size
        self.bs = bs
        self.ctx = max(bs, args.decode_context // bs * bs)
        steps = args.warmup + args.decode_steps
        max_len = max(max(args.prefill_lens), self.ctx + steps + 1)
        self.private_blocks = -(-(steps + 1) // bs)
        self.distinct = args.distinct_kv
        per_seq = self.private_blocks + (self.ctx // bs if self.distinct else 0)
        need = max(
            -(-max(args.prefill_lens) // bs),
            self.ctx // bs + max(args.decode_batches) * per_seq,
        )
        self.runner = ModelRunner(
            args.model, dtype=dtype, device="cpu", num_blocks=need, block_size=bs,
            max_model_len=max_len, num_threads=args.threads, attention_backend=args.attention,
            deterministic=args.deterministic, pack_projections=args.pack_projections,
            weight_codes=not args.no_weight_codes,
        )
        self._n = 0
        self._decode_jobs: list[str] = []

    def _job(self) -> str:
        self._n += 1
        return f"b{self._n}"

    def prefill(self, prompt: list[int]) -> int:
        job = self._job()
        self.runner.add_request(job, GREEDY, prompt)
        table = list(range(-(-len(prompt) // self.bs)))
        res = self.runner.execute(Plan(0, [ScheduledChunk(job, prompt, 0, table, True, 0)]))
        self.runner.remove_request(job)
        token = res.outputs[0].token_id
        assert token is not None
        return token

    def start_decode(self, prompt: list[int], batch: int) -> Callable[[], float]:
        """Set up `batch` sequences sharing `prompt`'s context; returns a
        function that runs one timed decode step."""
        prompt = prompt[: self.ctx]
        shared = list(range(self.ctx // self.bs))
        first = self.prefill(prompt)
        for job in self._decode_jobs:
            self.runner.remove_request(job)
        jobs = self._decode_jobs = [self._job() for _ in range(batch)]
        base = len(shared)
        own = self.private_blocks + (len(shared) if self.distinct else 0)
        tables = [list(range(base + i * own, base + (i + 1) * own)) for i in range(batch)]
        if self.distinct:
            # The prompt's blocks copied into each sequence's own (all layers).
            kv = self.runner.kv_cache
            copy = kv.read_blocks(shared)
            for table in tables:
                kv.write_blocks(table[: len(shared)], copy)
        else:
            tables = [shared + table for table in tables]
        for job in jobs:
            # The shared prefill already produced output 0 for every job.
            self.runner.add_request(job, GREEDY, prompt, output_token_ids=[first])
        last = [first] * batch
        step = 0

        def one_step() -> float:
            nonlocal last, step
            chunks = [
                ScheduledChunk(job, [tok], self.ctx + step, table, True, step + 1)
                for job, tok, table in zip(jobs, last, tables)
            ]
            t = time.perf_counter()
            res = self.runner.execute(Plan(step, chunks))
            elapsed = time.perf_counter() - t
            last = [o.token_id for o in res.outputs]  # type: ignore[misc]
            step += 1
            return elapsed

        return one_step


# The transformers reference ------------------------------------------------


class HFBench:
    def __init__(self, model_path: Path, dtype: torch.dtype) -> None:
        from transformers import AutoModelForCausalLM, DynamicCache

        self._cache_cls = DynamicCache
        self.model = AutoModelForCausalLM.from_pretrained(
            str(model_path), dtype=dtype, attn_implementation="eager", local_files_only=True
        ).eval()

    def _cache(self) -> Any:
        return self._cache_cls(config=self.model.config)

    @torch.inference_mode()
    def prefill(self, prompt: list[int]) -> tuple[int, Any]:
        cache = self._cache()
        out = self.model(
            input_ids=torch.tensor([prompt]), past_key_values=cache, use_cache=True,
            logits_to_keep=1,
        )
        return int(out.logits[0, -1].argmax()), cache

    def start_decode(self, prompt: list[int], batch: int) -> Callable[[], float]:
        first, cache = self.prefill(prompt)
        cache.batch_repeat_interleave(batch)
        nxt = torch.full((batch, 1), first, dtype=torch.long)

        @torch.inference_mode()
        def one_step() -> float:
            nonlocal nxt
            t = time.perf_counter()
            out = self.model(input_ids=nxt, past_key_values=cache, use_cache=True)
            nxt = out.logits[:, -1].argmax(dim=-1, keepdim=True)
            return time.perf_counter() - t

        return one_step


# Driver ------------------------------------------------------------------


def _row(dtype: str, kind: str, size: int, tokens: int,
         ours: list[float], hf: list[float] | None) -> dict[str, Any]:
    ours_tps = tokens / statistics.median(ours)
    row: dict[str, Any] = {
        "dtype": dtype, "kind": kind, "size": size,
        "ours_tok_s": round(ours_tps, 2), "ours_times_s": [round(t, 5) for t in ours],
    }
    if hf is not None:
        hf_tps = tokens / statistics.median(hf)
        row.update(hf_tok_s=round(hf_tps, 2), hf_times_s=[round(t, 5) for t in hf],
                   ratio=round(ours_tps / hf_tps, 3))
    return row


def _print_row(row: dict[str, Any]) -> None:
    label = f"{row['kind']} {'len' if row['kind'] == 'prefill' else 'batch'} {row['size']}"
    hf = f"{row['hf_tok_s']:10.1f}" if "hf_tok_s" in row else f"{'-':>10}"
    ratio = f"{row['ratio']:6.2f}x" if "ratio" in row else f"{'-':>7}"
    print(f"{row['dtype']:>9} {label:<20} {row['ours_tok_s']:10.1f} {hf} {ratio}", flush=True)


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(args.seed)
    rows: list[dict[str, Any]] = []
    started = time.perf_counter()
    # Other processes on the machine skew absolute figures (not the
    # interleaved ratios much): record how busy it was.
    load_before = os.getloadavg()
    print(f"{'dtype':>9} {'measurement':<20} {'ours tok/s':>10} {'HF tok/s':>10} {'ours/HF':>7}")
    for dtype in [d for d in args.dtypes.split(",") if d]:
        ours = OursBench(args, dtype)
        hf = None if args.no_hf else HFBench(ours.runner.model_path, ours.runner.dtype)
        vocab = min(ours.runner.vocab_size, len(ours.runner.tokenizer))
        gen = torch.Generator().manual_seed(args.seed)

        def prompt(n: int) -> list[int]:
            # Ordinary token ids (skip the first 100: special and control tokens).
            return torch.randint(100, vocab, (n,), generator=gen).tolist()

        warm = prompt(min(args.prefill_lens))
        for _ in range(args.warmup):
            ours.prefill(warm)
            if hf is not None:
                hf.prefill(warm)

        # Ours and the reference alternate run by run (and step by step),
        # so that load from other processes hits both alike.
        for n in args.prefill_lens:
            p = prompt(n)
            t_ours: list[float] = []
            t_hf: list[float] | None = None if hf is None else []
            for _ in range(args.reps):
                t_ours.append(_time_once(lambda: ours.prefill(p)))
                if hf is not None and t_hf is not None:
                    t_hf.append(_time_once(lambda: hf.prefill(p)))
            rows.append(_row(dtype, "prefill", n, n, t_ours, t_hf))
            _print_row(rows[-1])

        for b in args.decode_batches:
            p = prompt(ours.ctx)
            step_ours = ours.start_decode(p, b)
            step_hf = None if hf is None else hf.start_decode(p, b)
            t_ours, t_hf = [], None if hf is None else []
            for i in range(args.warmup + args.decode_steps):
                a = step_ours()
                c = None if step_hf is None else step_hf()
                if i >= args.warmup:
                    t_ours.append(a)
                    if t_hf is not None and c is not None:
                        t_hf.append(c)
            del step_hf
            rows.append(_row(dtype, "decode", b, b, t_ours, t_hf))
            _print_row(rows[-1])
        del ours, hf

    return {
        "meta": {
            "model": args.model,
            "threads": args.threads,
            "attention_backend": args.attention or default_backend_name(torch.device("cpu")),
            "deterministic": args.deterministic,
            "weight_codes": not args.no_weight_codes,
            "decode_context": args.decode_context // args.block_size * args.block_size,
            "decode_kv": "distinct" if args.distinct_kv else "shared",
            "decode_steps": args.decode_steps,
            "prefill_reps": args.reps,
            "warmup": args.warmup,
            "block_size": args.block_size,
            "statistic": "median of timed runs",
            "torch": torch.__version__,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "machine": platform.machine(),
            # False: bf16 matmuls are emulated (the engine then computes its
            # projections in float32, see engine/models/linear.py).
            "cpu_native_bf16_matmul": bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
            "loadavg_1m_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
            "wall_s": round(time.perf_counter() - started, 1),
        },
        "results": rows,
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    report = run(args)
    print(f"total {report['meta']['wall_s']} s")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
