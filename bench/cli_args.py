"""Argument groups of `python -m bench`, shared by its subcommands."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from workloads.sharegpt import DEFAULT_TOKENIZER

def _json_object(text: str) -> dict[str, Any]:
    try:
        obj = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise argparse.ArgumentTypeError("a JSON object is needed")
    return obj


def _add_workload_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--dataset", choices=["sharegpt", "fixed"], default="sharegpt")
    g.add_argument("--num-requests", "-n", type=int, default=1000)
    g.add_argument("--input-len", type=int, default=512, help="fixed: prompt tokens")
    g.add_argument("--output-len", type=int, default=128, help="fixed: output tokens")
    g.add_argument("--io-ratio", type=float, default=None,
                   help="sharegpt: rescale input/output ratio keeping each total length "
                        "(FastServe Fig. 14)")
    g.add_argument("--rate", type=float, default=1.0, help="req/s of the (online) stream; inf = all at t=0")
    g.add_argument("--cv", type=float, default=1.0,
                   help="coefficient of variation of inter-arrival times (1 = Poisson; else Gamma)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--min-len", type=int, default=4, help="vLLM filter: min prompt/output tokens")
    g.add_argument("--max-prompt-len", type=int, default=1024, help="vLLM filter")
    g.add_argument("--max-total-len", type=int, default=2048, help="vLLM filter")
    g.add_argument("--shared-prefix", type=int, default=0,
                   help="tokens of a system prompt every (online) prompt begins with")
    g.add_argument("--offline-num-requests", type=int, default=0,
                   help="add an offline stream of this many requests (co-serving mix)")
    g.add_argument("--offline-dataset", choices=["sharegpt", "fixed"], default="sharegpt")
    g.add_argument("--offline-input-len", type=int, default=512)
    g.add_argument("--offline-output-len", type=int, default=512)
    g.add_argument("--offline-rate", type=float, default=math.inf)
    g.add_argument("--offline-priority", type=int, default=0,
                   help="the offline requests' priority (lower runs first; online ones have 0)")
    g.add_argument("--workload-spec", type=Path, default=None,
                   help="a WorkloadSpec JSON file, or a result JSON whose workload to replay "
                        "(overrides the options above)")
    g.add_argument("--tokenizer", default=DEFAULT_TOKENIZER,
                   help="tokenizer for ShareGPT lengths (embedded:<name> or an HF folder)")


def _add_slo_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("SLO (seconds)")
    g.add_argument("--slo-ttft", type=float, default=None)
    g.add_argument("--slo-tpot", type=float, default=None)
    g.add_argument("--slo-e2e", type=float, default=None)
    g.add_argument("--slo-normalized", type=float, default=None,
                   help="normalized latency SLO, s/token (FastServe: 0.3 for OPT-13B)")


def _add_output_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, default=None, help="result JSON path")
    p.add_argument("--save-records", action="store_true", help="keep per-request records in the JSON")
    p.add_argument("--system", default=None, help="label of the system under test")


def _add_sweep_args(p: argparse.ArgumentParser, loads: bool) -> None:
    p.add_argument("--rates", type=float, nargs="+", default=None, help="arrival rates (req/s)")
    if loads:
        p.add_argument("--loads", type=float, nargs="+", default=None,
                       help="loads: rates as fractions of the measured capacity")
        p.add_argument("--bisect", action="store_true",
                       help="refine the max rate meeting --criterion by bisection")
    p.add_argument("--criterion", default=None,
                   help="e.g. 'normalized_latency.mean<=0.3' or 'slo_attainment>=0.95'")
    p.add_argument("--plot-dir", type=Path, default=None, help="also write the plots here")


def _add_sim_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("cost model")
    g.add_argument("--cost-model", default="opt-13b",
                   help="opt-13b | opt-66b | opt-175b | llama-2-7b (analytic A100) "
                        "or a cost table JSON (profile)")
    g.add_argument("--gpu", choices=["a100-80gb", "a100-40gb"], default="a100-80gb")
    g.add_argument("--tp", type=int, default=None, help="tensor parallel degree (preset default)")
    g.add_argument("--pp", type=int, default=None, help="pipeline parallel degree (preset default)")
    g.add_argument("--compute-efficiency", type=float, default=None)
    g.add_argument("--memory-efficiency", type=float, default=None)
    g.add_argument("--iteration-overhead", type=float, default=None,
                   help="seconds added to each iteration (analytic default 1 ms; table 0)")
    g = p.add_argument_group("scheduler")
    g.add_argument("--policy", default="fcfs",
                   help="fcfs, mlfq, mlfq-naive, fixed-priority, conserve, econoserve; in the "
                        "simulator also the clairvoyant bounds oracle-srpt and oracle-sjf "
                        "(bench/oracle.py)")
    g.add_argument("--num-blocks", type=int, default=None,
                   help="KV blocks (default: what the analytic model's GPU memory holds)")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--max-batch-size", type=int, default=256)
    g.add_argument("--max-batch-tokens", type=int, default=2048)
    g.add_argument("--max-model-len", type=int, default=2048)
    g.add_argument("--sched-opt", action="append", default=[], metavar="KEY=JSON",
                   help="any other SchedulerConfig field, e.g. swap_mode=\"proactive\"")
    g.add_argument("--overlap-swap", action="store_true",
                   help="KV copies overlap compute (proactive swapping, FastServe §4.2)")
    g = p.add_argument_group("replicas (bench/cluster_sim.py)")
    g.add_argument("--replicas", type=int, default=1,
                   help="engine replicas at t = 0, placed by load (all of them without "
                        "--max-replicas)")
    g.add_argument("--max-replicas", type=int, default=None,
                   help="autoscale between --replicas and this on the replicas' load reports "
                        "(scheduler/autoscale.py)")
    g.add_argument("--autoscale-opt", action="append", default=[], metavar="KEY=JSON",
                   help="any other `autoscaling` setting, e.g. upscale_delay_s=10")
    g.add_argument("--offline-pool-opt", action="append", default=[], metavar="KEY=JSON",
                   help="an `offline_pool` setting (policy conserve), e.g. move_queued=false")
    g.add_argument("--startup-s", type=float, default=None,
                   help="seconds from asking for a replica to its first load report "
                        "(default 30, bench/cluster_sim.py's ClusterOptions)")
    g.add_argument("--ttft-slo-s", type=float, default=None,
                   help="the TTFT objective of the replicas' load estimate (default 2)")
    g = p.add_argument_group("capacity")
    g.add_argument("--capacity-basis", choices=["saturated", "mean-fixed"], default="saturated",
                   help="what load 1.0 means: the workload's own saturated throughput, or that "
                        "of fixed-length jobs of the workload's mean lengths")


# ----------------------------------------------------------------- helpers


def _add_live_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    g.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    g.add_argument("--model", default=None, help="default: the first of GET /models")
    g.add_argument("--api-key", default=None)
    g.add_argument("--no-ignore-eos", action="store_true", help="for servers without ignore_eos")
    g.add_argument("--no-min-tokens", action="store_true", help="for servers without min_tokens")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--extra-body", type=_json_object, default={}, metavar="JSON",
                   help='fields added to every request, e.g. \'{"top_p": 0.95}\'')
    g.add_argument("--max-tokens", type=int, default=None,
                   help="every request's max_tokens, answers ending by themselves (no "
                        "ignore_eos / min_tokens); default: the workload's lengths, forced")
    g.add_argument("--max-concurrency", type=int, default=None)
    g.add_argument("--request-timeout", type=float, default=600.0)
    g.add_argument("--max-duration", type=float, default=None, help="seconds; stop sending and cut off")
    g.add_argument("--metrics-url", default=None,
                   help="Prometheus endpoint scraped before and after (server-wide counters)")
