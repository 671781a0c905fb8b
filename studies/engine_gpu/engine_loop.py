"""The engine replica's serving layer on a GPU, without Ray.

`serve run` wraps, in each Engine replica, an `EngineLoop` (the iteration
thread: inbox, scheduler core, iteration driver, delivery) around a
`ModelRunner`.  Where Ray cannot be installed (the lent GPU machines), this
builds the same stack as `deployments/engine.py` does in a replica, minus
Ray: a `ModelRunner` on `--device` (Triton attention, CUDA graphs for
decode-only and mixed steps), the cost model measured from it
(`engine.profiler.estimate_cost`), `SchedulerCore` under `--policy`, and
`EngineLoop`, with a host KV tier in this process's memory for swapping
(the replica's is Ray's object store); then submits `--requests` requests at once (prompt and answer
lengths uniform in their ranges, `ignore_eos`, greedy) and waits for every
one to finish.

It reports what a replica would serve: output tokens/s, TTFT and
end-to-end latency percentiles, iterations, how many of them replayed a
graph, preemptions, and that every KV block came back free.  The model is
a random-weight Llama shape (default Llama-3.2-1B's) written to a
temporary folder with SmolLM2's tokenizer (`--tokenizer`): no weights are
downloaded.

    python -m studies.engine_gpu.engine_loop --out studies/engine_gpu/engine_loop.json

With `--null-pass` the model's pass and sampling are taken out once the cost model is
measured (`null_pass.py`): what is left is the loop's host path, which runs the same on a CPU
(`host_path.sh`).  `--device-cost` then gives every pass a device's time back from a cost model
(`null_pass.emulate_device`; say, the one an H200 run of this study measured and recorded as
`cost_model`), which the scheduler is given too.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from api.protocol import GenerateRequest
from deployments.delivery import Delivery
from deployments.engine_loop import EngineLoop
from engine.gc_heap import SERVING_THRESHOLDS, freeze_startup_heap
from engine.length_head import LengthHead
from engine.profiler import estimate_cost
from engine.runner import ModelRunner
from engine.sampling_params import SamplingParams
from engine.swapper import BlockSwapper
from kvstore.tier import LocalHostTier
from scheduler.config import SchedulerConfig
from scheduler.core import SchedulerCore
from scheduler.cost import LinearCost
from studies.engine_gpu.gc_census import GcCensus
from studies.engine_gpu.null_pass import emulate_device, strip_pass
from studies.engine_gpu.sync_sites import SyncSites

BLOCK_SIZE = 16


def _range(text: str) -> tuple[int, int]:
    lo, hi = (int(x) for x in text.split(","))
    return lo, hi


def _cost(text: str) -> LinearCost:
    base, per_token, per_seq, decode_base = (float(v) for v in text.split(","))
    return LinearCost(base, per_token, per_seq, decode_base)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=8192)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--tokenizer", type=Path,
                   default=os.environ.get("PREEMPT_SERVE_TEST_TOKENIZER"),
                   help="a folder with SmolLM2's tokenizer files (default: the embedded model's)")
    p.add_argument("--policy", default="mlfq")
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--prompt-len", type=_range, default=(16, 1024))
    p.add_argument("--output-len", type=_range, default=(16, 512))
    p.add_argument("--kv-tokens", type=int, default=1 << 18)
    p.add_argument("--swap-mode", default="proactive",
                   choices=["recompute", "reactive", "proactive"])
    p.add_argument("--host-kv-tokens", type=int, default=1 << 18)
    p.add_argument("--max-batch-size", type=int, default=128)
    p.add_argument("--max-batch-tokens", type=int, default=4096)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--no-graphs", action="store_true")
    p.add_argument("--no-mixed-graphs", action="store_true",
                   help="replay decode-only steps only; mixed steps run op by op")
    p.add_argument("--pageable-swaps", action="store_true",
                   help="swap copies on the compute stream through pageable memory")
    p.add_argument("--no-overlap", action="store_true",
                   help="decode and deliver each iteration's tokens right after it, not "
                        "while the next pass runs")
    p.add_argument("--ahead", action="store_true",
                   help="plan and launch each iteration while the previous pass is in "
                        "flight (async_scheduling, scheduler/ahead.py)")
    p.add_argument("--length-head", action="store_true",
                   help="estimate each answer's length at its first token with a random "
                        "length head (engine/length_head.py) of the model's hidden size")
    p.add_argument("--no-gc-freeze", action="store_true",
                   help="leave the start-up heap to the garbage collector's scans (the "
                        "replica freezes it: engine/gc_heap.py)")
    p.add_argument("--gc-young", type=int, default=SERVING_THRESHOLDS[0],
                   help="net allocations between young collections while serving (the "
                        "replica's: engine/gc_heap.py; Python's default 700)")
    p.add_argument("--gc-census", type=int, default=0, metavar="N",
                   help="count the young generation's objects by kind at every N-th young "
                        "collection (gc_census.py; slows those collections)")
    p.add_argument("--null-pass", action="store_true",
                   help="once the cost model is measured, take the model's pass and sampling "
                        "out (studies/engine_gpu/null_pass.py): the host path alone")
    p.add_argument("--device-cost", type=_cost, default=None,
                   metavar="BASE,PREFILL_PER_TOKEN,DECODE_PER_SEQ,DECODE_BASE",
                   help="with --null-pass: each pass holds an emulated device for this cost "
                        "model's time (seconds), which the scheduler uses too")
    p.add_argument("--sync-sites", action="store_true",
                   help="count where the host waits for the GPU (sync_sites.py; slows the loop)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=300.0)
    args = p.parse_args(argv)
    if args.device_cost is not None and not args.null_pass:
        p.error("--device-cost emulates the device of a stripped pass: give --null-pass too")
    return args


def random_model(args: argparse.Namespace, folder: Path) -> Path:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    if args.tokenizer is None:
        from engine.model_source import resolve_model

        args.tokenizer = resolve_model("embedded:smollm2")
    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, max_position_embeddings=args.max_model_len,
        rope_theta=500000.0, tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(config).to(getattr(torch, args.dtype))
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    return folder


class Sink:
    """The replica's delivery callback: first-token and finish times per job."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.first: dict[str, float] = {}
        self.done: dict[str, float] = {}
        self.tokens = 0
        self.errors: list[str] = []
        self.cv = threading.Condition()

    def __call__(self, items: list[Delivery]) -> None:
        now = time.monotonic()
        with self.cv:
            for d in items:
                ev = d.event
                if d.error is not None:
                    self.errors.append(f"{ev.job_id}: {d.error}")
                if ev.token_id is not None:
                    self.tokens += 1
                    self.first.setdefault(ev.job_id, now)
                if ev.finished:
                    self.done[ev.job_id] = now
            self.cv.notify_all()

    def wait(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self.cv:
            while len(self.done) < self.total:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.cv.wait(left)
        return True


def _pcts(xs: list[float]) -> dict[str, float]:
    q = statistics.quantiles(xs, n=100) if len(xs) > 1 else xs * 99
    return {"p50": statistics.median(xs), "p90": q[89], "p99": q[98]}


class GcTimes:
    """Times the garbage collector's collections until `stop`."""

    def __init__(self) -> None:
        self.count = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self.collected = [0, 0, 0]  # unreachable objects freed
        self.longest = 0.0
        self.over_10ms = 0  # collections that paused their thread 10 ms or more
        # The longest collection's generation and the thread that ran it.
        self.longest_in: tuple[int, str] = (0, "")
        self._began = 0.0
        gc.callbacks.append(self._on)

    def _on(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._began = time.perf_counter()
            return
        took, gen = time.perf_counter() - self._began, info["generation"]
        self.count[gen] += 1
        self.seconds[gen] += took
        self.collected[gen] += info["collected"]
        self.over_10ms += took >= 0.010
        if took > self.longest:
            self.longest = took
            self.longest_in = (gen, threading.current_thread().name)

    def stop(self) -> None:
        gc.callbacks.remove(self._on)

    def summary(self) -> dict[str, Any]:
        return {"count": self.count, "seconds": [round(s, 4) for s in self.seconds],
                "longest_s": round(self.longest, 4), "longest_generation": self.longest_in[0],
                "longest_thread": self.longest_in[1], "over_10ms": self.over_10ms,
                "collected": self.collected}


def _replays(runner: ModelRunner) -> int:
    return sum(g.num_runs for g in (runner.graphs, runner.mixed_graphs) if g is not None)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    dev = torch.device(args.device)
    with tempfile.TemporaryDirectory() as tmp:
        path = random_model(args, Path(tmp))
        num_blocks = args.kv_tokens // BLOCK_SIZE
        head = None
        if args.length_head:
            g = torch.Generator().manual_seed(args.seed)
            head = Path(tmp) / "length_head.pt"
            LengthHead(torch.zeros(args.hidden), torch.ones(args.hidden),
                       0.02 * torch.randn(args.hidden, generator=g), 0.3, 5.0,
                       args.max_model_len).save(head)
        t0 = time.perf_counter()
        runner = ModelRunner(
            path, args.dtype, args.device, num_blocks=num_blocks, block_size=BLOCK_SIZE,
            max_model_len=args.max_model_len, length_head=head,
            cuda_graph_max_batch=0 if args.no_graphs or dev.type != "cuda"
            else args.max_batch_size,
            cuda_graph_max_tokens=0 if args.no_mixed_graphs else args.max_batch_tokens)
        start_s = time.perf_counter() - t0
    host_blocks = 0 if args.swap_mode == "recompute" else args.host_kv_tokens // BLOCK_SIZE
    if host_blocks:
        runner.set_kv_tier(LocalHostTier(host_blocks * runner.kv_cache.bytes_per_block))
        if args.pageable_swaps:
            runner.swapper = BlockSwapper(runner.kv_cache, runner.swapper.tier,
                                          side_stream=False)
    cost = estimate_cost(runner, BLOCK_SIZE)
    busy: list[float] = []
    if args.null_pass:
        strip_pass(runner, args.seed)
        if args.device_cost is not None:
            cost = args.device_cost
            busy = emulate_device(runner, cost)
    core = SchedulerCore(
        SchedulerConfig(policy=args.policy, block_size=BLOCK_SIZE, num_blocks=num_blocks,
                        max_batch_size=args.max_batch_size,
                        max_batch_tokens=args.max_batch_tokens,
                        max_model_len=args.max_model_len, swap_mode=args.swap_mode,
                        host_kv_blocks=host_blocks),
        time.monotonic, cost=None if args.policy == "fcfs" else cost)
    replays_before = _replays(runner)
    sink = Sink(args.requests)
    loop = EngineLoop(
        runner, core,
        lambda req, i: SamplingParams(temperature=0.0, max_tokens=req.max_tokens,
                                      ignore_eos=True),
        sink, cost=cost, ahead=args.ahead)
    if args.no_overlap:
        runner.on_launch = None
        runner.defer_text = False
    frozen = 0 if args.no_gc_freeze else freeze_startup_heap()
    gc.set_threshold(args.gc_young, *SERVING_THRESHOLDS[1:])
    collections = GcTimes()
    census = GcCensus(args.gc_census) if args.gc_census else None
    sites = SyncSites(Path(__file__).resolve().parents[2])
    if args.sync_sites:
        sites.start()
    loop.start()
    rng = random.Random(args.seed)
    vocab = runner.config.vocab_size
    arrival: dict[str, float] = {}
    for i in range(args.requests):
        p = rng.randint(*args.prompt_len)
        o = min(rng.randint(*args.output_len), args.max_model_len - p - 1)
        rid = f"r{i}"
        arrival[rid] = time.monotonic()
        loop.submit(GenerateRequest(
            request_id=rid, prompt_token_ids=[rng.randrange(3, vocab) for _ in range(p)],
            max_tokens=o, temperature=0.0, top_p=1.0, top_k=-1, seed=None, stop=[],
            stop_token_ids=[], ignore_eos=True, min_tokens=0, arrival_time=arrival[rid]))
    t_submit = min(arrival.values())
    finished = sink.wait(args.timeout)
    wall = max(sink.done.values(), default=time.monotonic()) - t_submit
    free_after, host_free_after = core.blocks.num_free, core.swap.host_free
    loop.stop()
    sites.stop()
    collections.stop()
    if census is not None:
        census.stop()
    stats = loop.stats
    result: dict[str, Any] = {
        "command": "python -m studies.engine_gpu.engine_loop "
                   + " ".join(sys.argv[1:] if argv is None else argv),
        "device": (torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"),
        "dtype": args.dtype, "policy": args.policy, "swap_mode": args.swap_mode,
        "pageable_swaps": args.pageable_swaps, "overlap": not args.no_overlap,
        "ahead": args.ahead, "null_pass": args.null_pass, "length_head": args.length_head,
        "gc_freeze": not args.no_gc_freeze, "gc_thresholds": gc.get_threshold(),
        "launched_ahead": getattr(loop.driver, "num_ahead", 0),
        "kv_tokens": args.kv_tokens, "host_kv_tokens": host_blocks * BLOCK_SIZE,
        "shape": {k: getattr(args, k) for k in ("layers", "hidden", "intermediate", "heads",
                                                "kv_heads")},
        "requests": args.requests, "finished": len(sink.done), "all_finished": finished,
        "errors": sink.errors[:10],
        "runner_start_s": start_s, "cost_model": repr(cost),
        "emulated_device": args.device_cost is not None,
        # The emulated device's time over the wall time (with --device-cost).
        "device_busy_s": sum(busy), "device_utilization": sum(busy) / wall,
        "wall_s": wall, "output_tokens": sink.tokens, "output_tokens_per_s": sink.tokens / wall,
        "ttft_s": _pcts([sink.first[r] - arrival[r] for r in sink.first]),
        "latency_s": _pcts([sink.done[r] - arrival[r] for r in sink.done]),
        "iterations": stats.iterations,
        "graph_replays": runner.graphs.num_runs if runner.graphs is not None else 0,
        "mixed_graph_replays": (runner.mixed_graphs.num_runs
                                if runner.mixed_graphs is not None else 0),
        # The serving iterations' passes not replayed from a graph (the cost
        # model's profiling passes before them not counted).
        "gc_frozen_objects": frozen,
        # Garbage collections while the loop served, per generation: their
        # number and seconds, and the longest.
        "gc": collections.summary(),
        **({"gc_census": census.summary()} if census is not None else {}),
        "passes_op_by_op": stats.iterations - (_replays(runner) - replays_before),
        "forward_s": stats.forward_time,
        # The iteration thread's busy time (inbox to delivery); of what is
        # not the pass, the scheduler's planning and completion.
        "loop_s": stats.loop_time, "plan_s": stats.plan_time,
        "complete_s": stats.complete_time,
        "preemptions": core.num_preemptions,
        "swap_outs": core.swap.num_swap_out, "swap_ins": core.swap.num_swap_in,
        "recompute_fallbacks": core.swap.num_recompute_fallbacks,
        "host_free_blocks_after": host_free_after, "host_blocks": host_blocks,
        "free_blocks_after": free_after, "num_blocks": num_blocks,
    }
    if args.sync_sites:
        result["sync_sites"] = sites.summary()
        result["syncs_per_iteration"] = result["sync_sites"]["total"] / max(1, stats.iterations)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k != "command"}, indent=1))


if __name__ == "__main__":
    main()
