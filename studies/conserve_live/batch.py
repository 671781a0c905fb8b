"""Helpers of the live co-serving run whose batch work is a batch file
submitted through Ray Jobs (studies/conserve_live/batch.sh).

    python -m studies.conserve_live.batch make-file OUT.jsonl [N [PRIORITY]]
        the offline stream of run.sh (N ShareGPT requests, prompt + answer
        <= 320 tokens, seed 0) as an OpenAI Batch file of completions, each
        at PRIORITY (default 0; vllm++'s runs give their offline work 1)
    python -m studies.conserve_live.batch sample OUT.json
        every 0.5 s until stopped (SIGTERM), each engine replica's tokens
        by job class, with wall-clock times
    python -m studies.conserve_live.batch summarize FOLDER
        the run against online-only and vllm++ (run.sh's results in FOLDER):
        online P99 TTFT / TPOT, offline tokens/s over the online span
"""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable

SPAN_FROM = "online-only"


def make_file(out: Path, n: int, priority: int = 0) -> None:
    from bench.__main__ import build_parser
    from bench.cli_workload import _PoolCache, _workload_spec

    # The workload of run.sh's co-served runs, of which the offline stream.
    a = build_parser().parse_args([
        "run", "--dataset", "sharegpt", "--max-total-len", "320", "--seed", "0", "-n", "60",
        "--rate", "0.35", "--offline-num-requests", str(n)])
    wl = _PoolCache(a.tokenizer, need_text=True).build(_workload_spec(a))
    offline = [r for r in wl.requests if r.job_class == "offline"]
    with out.open("w", encoding="utf-8") as f:
        for r in offline:
            body = {"prompt": r.prompt, "max_tokens": r.output_tokens, "min_tokens": r.output_tokens,
                    "temperature": 0.0, "ignore_eos": True}
            if priority:
                body["priority"] = priority
            f.write(json.dumps({"custom_id": r.request_id, "method": "POST",
                                "url": "/v1/completions", "body": body}) + "\n")
    print(f"wrote {len(offline)} lines to {out}")


def sample(out: Path, app: str = "llm") -> None:
    import ray
    from ray import serve

    ray.init(address="auto", log_to_driver=False, logging_level="ERROR")
    engine = serve.get_deployment_handle("Engine", app_name=app)
    samples: list[dict[str, Any]] = []
    stop = False

    def on_term(*_: Any) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    while not stop:
        try:
            s = engine.stats.remote().result(timeout_s=5)
            samples.append({"t": time.time(), "tokens_by_class": s["tokens_by_class"]})
        except Exception as e:  # the server going away at the end
            samples.append({"t": time.time(), "error": repr(e)})
        out.write_text(json.dumps(samples))
        time.sleep(0.5)


def wait_for_offline(read: Callable[[], list[dict[str, Any]]], what: str,
                     timeout_s: float = 300.0) -> None:
    """Until `read()` (samples with a `tokens_by_class` each) shows the
    first offline tokens (a batch job's driver has started), then 5 s more."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(x.get("tokens_by_class", {}).get("offline", 0) > 0 for x in read()):
            time.sleep(5.0)
            return
        time.sleep(0.5)
    raise SystemExit(f"no offline tokens within {timeout_s:g} s ({what})")


def _tokens_at(samples: list[dict[str, Any]], t: float) -> float:
    """Offline tokens at wall time `t`, linearly between samples."""
    pts = [(s["t"], s["tokens_by_class"].get("offline", 0)) for s in samples
           if "tokens_by_class" in s]
    before = [p for p in pts if p[0] <= t]
    after = [p for p in pts if p[0] >= t]
    if not before:
        return 0.0
    if not after:
        return float(before[-1][1])
    (t0, v0), (t1, v1) = before[-1], after[0]
    return float(v0) if t1 == t0 else v0 + (v1 - v0) * (t - t0) / (t1 - t0)


def summarize(folder: Path) -> None:
    from bench.metrics import summarize as summarize_records
    from bench.results import load_result
    from studies.conserve_live.summary import add_ratios

    span = max(r.send_time for r in load_result(folder / f"{SPAN_FROM}.json").records)
    run = load_result(folder / "conserve-batch.json")
    online = [r for r in run.records if r.job_class == "online"]
    s = summarize_records(online)
    later = summarize_records([r for r in online if r.send_time > 10.0])
    start = float((folder / "conserve-batch.start").read_text())
    samples = json.loads((folder / "conserve-batch.samples.json").read_text())
    tokens = _tokens_at(samples, start + span) - _tokens_at(samples, start)
    prior = json.loads((folder / "summary.json").read_text())["systems"]
    row: dict[str, Any] = {
        "completed": s.num_completed, "ttft_p50": s.ttft.median, "ttft_p99": s.ttft.p99,
        "ttft_p99_after_burst": later.ttft.p99, "tpot_p50": s.tpot.median,
        "tpot_p99": s.tpot.p99, "offline_tokens_per_s": tokens / span, "offline_window_s": span,
    }
    add_ratios(row, prior)
    outputs = [json.loads(x) for x in (folder / "conserve-batch.output.jsonl").read_text()
               .splitlines() if x.strip()]
    row["batch_lines_answered"] = sum(1 for o in outputs
                                      if o["response"] and o["response"]["status_code"] == 200)
    row["batch_completion_tokens"] = sum(o["response"]["body"]["usage"]["completion_tokens"]
                                         for o in outputs if o["response"])
    (folder / "conserve-batch.summary.json").write_text(json.dumps(row, indent=1))
    print(json.dumps(row, indent=1))


def main(argv: list[str]) -> None:
    cmd, path = argv[0], Path(argv[1])
    if cmd == "make-file":
        make_file(path, int(argv[2]) if len(argv) > 2 else 40,
                  int(argv[3]) if len(argv) > 3 else 0)
    elif cmd == "sample":
        sample(path)
    elif cmd == "summarize":
        summarize(path)
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
