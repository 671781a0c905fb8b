"""Tensor and pipeline parallelism on CPU: iteration times of one model
whole on one core, whole with two intra-op threads, split over two
tensor-parallel shards of one thread each, and split into two pipeline
stages of one thread each (gloo between the two processes), side by side in
one run.

    python -m studies.tensor_parallel.cpu_step [--dtype float32] [--batch 32]

A random Llama of ~200M parameters (hidden 1024, 16 heads of 64, 4 key/value
heads, MLP 2816, 12 layers, vocabulary 32,000; SmolLM2's tokenizer): big
enough that a decode step reads its weights from memory, small enough to
load in seconds.  Each configuration prefills `--batch` prompts of 128
tokens, then decodes 16 steps; reported: the median decode step and the
prefill step, both from the runner's own `iteration_time`; for the two
shards also the median time of the first shard's all-reduces and logits
gathers (waiting for the other shard included) and their count per decode
step.  Writes studies/tensor_parallel/cpu_step.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from engine.runner import ModelRunner
from engine.sampling_params import SamplingParams
from scheduler.config import SchedulerConfig
from scheduler.core import SchedulerCore
from scheduler.job import Job

OUT = Path(__file__).with_name("cpu_step.json")
PROMPT, DECODES, BLOCK = 128, 16, 16


def random_llama(folder: Path) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from engine.model_source import resolve_model

    config = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                         num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=4,
                         max_position_embeddings=1024, tie_word_embeddings=False,
                         bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder, safe_serialization=True)
    AutoTokenizer.from_pretrained(str(resolve_model("embedded:smollm2"))).save_pretrained(folder)
    return folder


def measure(runner: ModelRunner, batch: int) -> dict[str, float]:
    clock = itertools.count()
    blocks = batch * ((PROMPT + DECODES) // BLOCK + 2)
    core = SchedulerCore(SchedulerConfig(policy="fcfs", block_size=BLOCK, num_blocks=blocks,
                                         max_batch_size=batch, max_batch_tokens=batch * PROMPT,
                                         max_model_len=512), lambda: float(next(clock)))
    params = SamplingParams(temperature=0.0, max_tokens=DECODES + 1, ignore_eos=True)
    gen = torch.Generator().manual_seed(1)
    for i in range(batch):
        prompt = torch.randint(3, 32000, (PROMPT,), generator=gen).tolist()
        core.add(Job(f"j{i}", prompt, DECODES + 1, arrival_time=0.0))
        runner.add_request(f"j{i}", params, prompt)
    prefill: list[float] = []
    decode: list[float] = []
    while core.has_work:
        plan = core.schedule()
        result = runner.execute(plan)
        (decode if all(c.num_tokens == 1 for c in plan.chunks) else prefill).append(
            result.iteration_time)
        for ev in core.complete(plan, result):
            if ev.finished:
                runner.remove_request(ev.job_id)
    return {"prefill_step_s": sum(prefill), "decode_step_s": statistics.median(decode[2:])}


def timed_collectives() -> dict[str, list[float]]:
    """Wrap torch.distributed's all_reduce and gather with timers."""
    import torch.distributed as dist

    times: dict[str, list[float]] = {"all_reduce": [], "gather": []}
    for name in times:
        real = getattr(dist, name)

        def wrapper(*a: Any, _real: Any = real, _log: list[float] = times[name],
                    **k: Any) -> Any:
            t = time.perf_counter()
            out = _real(*a, **k)
            _log.append(time.perf_counter() - t)
            return out

        setattr(dist, name, wrapper)
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch", type=int, default=32)
    args = ap.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    from deployments.shard_workers import RayShardGroup

    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        path = str(random_llama(Path(tmp)))
        kwargs: dict[str, Any] = dict(model_path=path, dtype=args.dtype, device="cpu",
                                      num_blocks=args.batch * 12, block_size=BLOCK,
                                      max_model_len=512)
        for threads in (1, 2):
            runner = ModelRunner(**kwargs, num_threads=threads)
            results.append({"config": f"whole, {threads} thread(s)",
                            **measure(runner, args.batch)})
            del runner
        torch.set_num_threads(1)
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        group = RayShardGroup(2, {**kwargs, "num_threads": 1})
        tp, _ = group.join()
        runner = ModelRunner(**kwargs, num_threads=1, tensor_parallel=tp)
        group.wait_ready()
        runner.attach_shards(group)
        times = timed_collectives()
        row: dict[str, Any] = {"config": "two shards, 1 thread each",
                               **measure(runner, args.batch)}
        steps = len(times["gather"])
        for name, log in times.items():
            row[f"{name}_median_s"] = statistics.median(log)
            row[f"{name}_per_step"] = len(log) / steps
        results.append(row)
        group.close()
        group = RayShardGroup(1, {**kwargs, "num_threads": 1}, stages=2)
        tp, pp = group.join()
        runner = ModelRunner(**kwargs, num_threads=1, tensor_parallel=tp, pipeline=pp)
        group.wait_ready()
        runner.attach_shards(group)
        results.append({"config": "two stages, 1 thread each", **measure(runner, args.batch)})
        group.close()
        ray.shutdown()
    for r in results:
        print(f"{r['config']:>28}: decode {r['decode_step_s'] * 1e3:7.1f} ms/step, "
              f"prefill {r['prefill_step_s']:6.2f} s")
    tp = results[2]
    print(f"all-reduce {tp['all_reduce_median_s'] * 1e3:.2f} ms x {tp['all_reduce_per_step']:.1f}"
          f"/step, gather {tp['gather_median_s'] * 1e3:.2f} ms")
    OUT.write_text(json.dumps({
        "command": "python -m studies.tensor_parallel.cpu_step "
                   f"--dtype {args.dtype} --batch {args.batch}",
        "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
        "dtype": args.dtype, "batch": args.batch, "prompt": PROMPT,
        "date": time.strftime("%Y-%m-%d"), "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
