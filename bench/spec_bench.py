"""Speculative decoding by prompt lookup (scheduler/speculation.py) on the
engine: tokens/s of requests (greedy, or seeded at `--temperature`) with
and without drafts, in one process and interleaved, on prompts whose
answers repeat their text (rewriting a passage of code; also with the code
as each request's prediction of its answer, OpenAI's Predicted Outputs)
and on chat prompts (ShareGPT), at batch 1 and 4; with the acceptance rate
(drafts accepted / proposed), tokens a step, and whether each answer is
the one without drafts.

The engine runs as the server runs it (`SchedulerCore` with FCFS, the
C++ attention on CPU), in `--threads` threads.

    python -m bench.spec_bench --out studies/speculative/spec.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import time
from pathlib import Path
from typing import Any

from engine.runner import ModelRunner
from engine.sampling_params import SamplingParams
from scheduler.config import SchedulerConfig, SpeculativeConfig
from scheduler.core import SchedulerCore
from scheduler.job import Job

CODE = '''def moving_average(values, window):
    if window <= 0:
        raise ValueError("window must be positive")
    result = []
    total = 0.0
    for index, value in enumerate(values):
        total += value
        if index >= window:
            total -= values[index - window]
        if index >= window - 1:
            result.append(total / window)
    return result
'''
EDITS = ["Rename the function to rolling_mean and keep everything else the same.",
         "Rename the variable total to running_sum and keep everything else the same.",
         "Add a docstring to the function and keep the code the same.",
         "Rename the parameter values to data and keep everything else the same."]


def rewrite_prompts(n: int) -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": f"{EDITS[i % len(EDITS)]}\n\n```python\n{CODE}```"}]
            for i in range(n)]


def chat_prompts(n: int) -> list[list[dict[str, str]]]:
    """The first `n` ShareGPT first turns of 20-1500 characters."""
    from workloads.sharegpt import first_exchanges, load_sharegpt

    out = []
    for ex in first_exchanges(load_sharegpt()):
        if ex is not None and 20 <= len(ex[1]) <= 1500:
            out.append([{"role": "user", "content": ex[1]}])
            if len(out) == n:
                break
    return out


def run(runner: ModelRunner, prompts: list[list[int]], max_tokens: int,
        spec: SpeculativeConfig, prediction: list[int] | None = None,
        temperature: float = 0.0) -> dict[str, Any]:
    """All `prompts` at once through the core and the runner; with
    `prediction`, each request predicts its answer so (Predicted Outputs)."""
    clock = time.monotonic
    core = SchedulerCore(SchedulerConfig(
        policy="fcfs", block_size=16, num_blocks=runner.kv_cache.num_blocks,
        max_batch_size=32, max_batch_tokens=2048, max_model_len=runner.max_model_len,
        speculative=spec), clock)
    ids = [f"r{next(_ids)}" for _ in prompts]
    # Seeded: a sampled request then yields the same tokens with drafts.
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens,
                            seed=None if temperature == 0.0 else 0)
    out: dict[str, list[int]] = {}
    for job_id, prompt in zip(ids, prompts):
        job = Job(job_id, prompt, max_tokens, arrival_time=clock(),
                  prediction=prediction if spec.num_tokens else None)
        job.speculate = bool(spec.num_tokens)
        core.add(job)
        runner.add_request(job_id, params, prompt)
        out[job_id] = []
    steps = decode_steps = drafted = accepted = 0
    t0 = time.perf_counter()
    decode_time = 0.0
    while core.has_work:
        plan = core.schedule()
        decoding = all(c.num_known_tokens == 1 for c in plan.chunks)
        t = time.perf_counter()
        result = runner.execute(plan)
        if decoding:
            decode_time += time.perf_counter() - t
            decode_steps += 1
        drafted += sum(c.draft for c in plan.chunks)
        for ev in core.complete(plan, result):
            got = [*(ev.accepted or ()), ev.token_id]
            accepted += len(got) - 1
            out[ev.job_id] += got
            if ev.finished:
                runner.remove_request(ev.job_id)
        steps += 1
    wall = time.perf_counter() - t0
    tokens = sum(len(v) for v in out.values())
    return {"tokens": tokens, "seconds": wall, "tokens_per_s": tokens / wall,
            "steps": steps, "decode_steps": decode_steps, "decode_seconds": decode_time,
            "drafted": drafted, "accepted": accepted,
            "acceptance": accepted / drafted if drafted else None,
            "answers": [out[j] for j in ids]}


_ids = itertools.count()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.spec_bench")
    ap.add_argument("--model", default="embedded:smollm2")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--num-tokens", type=int, default=4, help="drafts per step, at most")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--min-acceptance", default="0",
                    help="speculative.min_acceptance, or several comma-separated (0: always "
                    "--num-tokens drafts), each run beside the others and without drafts")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    runner = ModelRunner(args.model, args.dtype, "cpu", num_blocks=1024, block_size=16,
                         max_model_len=2048, num_threads=args.threads)
    tok = runner.tokenizer
    from engine.tokenizer import encode_chat

    batches = [int(b) for b in args.batches.split(",")]
    rewrite = rewrite_prompts(max(batches))
    # Predicted Outputs: the code as the answer would quote it.
    predicted = tok(f"```python\n{CODE}```", add_special_tokens=False)["input_ids"]
    workloads = {"rewrite": (rewrite, None), "rewrite_predicted": (rewrite, predicted),
                 "chat": (chat_prompts(max(batches)), None)}
    floors = [float(x) for x in args.min_acceptance.split(",")]
    specs = [("off", SpeculativeConfig())] + [
        (f"on@{f}", SpeculativeConfig(num_tokens=args.num_tokens, min_ngram=2, max_ngram=4,
                                      max_batch=max(batches), min_acceptance=f))
        for f in floors]
    rows = []
    for name, (convs, prediction) in workloads.items():
        prompts = [encode_chat(tok, c) for c in convs]
        for b in batches:
            best: dict[str, dict[str, Any]] = {}
            for _ in range(args.repeats):  # interleaved: a neighbour slows all alike
                for label, spec in specs:
                    r = run(runner, prompts[:b], args.max_tokens, spec, prediction,
                            args.temperature)
                    if label not in best or r["tokens_per_s"] > best[label]["tokens_per_s"]:
                        best[label] = r
            off = best["off"]
            for label, _ in specs[1:]:
                on = best[label]
                same = sum(a == b_ for a, b_ in zip(on["answers"], off["answers"]))
                row = {"workload": name, "batch": b,
                       "min_acceptance": float(label.split("@")[1]),
                       "off_tokens_per_s": round(off["tokens_per_s"], 1),
                       "on_tokens_per_s": round(on["tokens_per_s"], 1),
                       "speedup": round(on["tokens_per_s"] / off["tokens_per_s"], 2),
                       "acceptance": None if on["acceptance"] is None
                       else round(on["acceptance"], 3),
                       "drafted": on["drafted"],
                       "tokens_per_step_on": round(on["tokens"] / on["steps"], 2),
                       "tokens_per_step_off": round(off["tokens"] / off["steps"], 2),
                       "answers_equal": f"{same}/{b}", "tokens": on["tokens"]}
                rows.append(row)
                print(json.dumps(row), flush=True)
    doc = {"bench": "spec_bench", "command": "python -m bench.spec_bench " + " ".join(
        argv if argv is not None else __import__("sys").argv[1:]),
        "machine": platform.processor() or platform.machine(), "model": args.model,
        "dtype": args.dtype, "threads": args.threads, "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "num_tokens": args.num_tokens, "rows": rows}
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
