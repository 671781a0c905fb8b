"""Command line of the predictor studies: `python -m studies.predictor --help`, from the repository root.

Subcommands: probe, scaling, capacity, ceiling, make-ensemble,
collect-completions, collect-live.  Each writes its report where README.md lists it; the
trainings they run are the product's `python -m predictor train / evaluate`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path
from typing import Any

from predictor.cli_args import command_line, common_args, dataset_args, splits
from predictor.config import ModelConfig, cache_dir
from predictor.dataset import LengthPair

PROG = "python -m studies.predictor"
# The reports sit beside this file, one folder per adapter they concern.
HERE = Path(__file__).resolve().parent
DEFAULT_REPORTS = HERE / "smollm2-sharegpt"
LONG_REPORTS = HERE / "smollm2-sharegpt-long"


def _command_line() -> str:
    return command_line(PROG)


def _dump(obj: Any) -> None:
    print(json.dumps(obj, indent=2))


def _serving_prompts(a: argparse.Namespace) -> list[LengthPair]:
    """The first `--n` serving-split prompts of at most `--max-prompt-tokens`,
    in prompt-id hash order: what collect-completions and collect-live send."""
    s = splits(a)
    # Serving-split prompts only: never trained on during ShareGPT fine-tuning.
    cand = [p for p in s.serve if p.prompt_tokens <= a.max_prompt_tokens]
    cand.sort(key=lambda p: hashlib.sha256(p.id.encode()).hexdigest())
    return cand[: a.n]


def cmd_collect(a: argparse.Namespace) -> None:
    from studies.predictor.collect import collect_completions

    out = Path(a.out) if a.out else cache_dir() / "served" / "smollm2-served.jsonl"
    n = collect_completions(a.model, _serving_prompts(a), out, a.max_new_tokens, a.batch_size)
    print(f"wrote {n} records to {out}")


def cmd_collect_live(a: argparse.Namespace) -> None:
    from studies.predictor.collect_live import LiveConfig, collect_live

    cfg = LiveConfig(
        base_url=a.base_url, model=a.model, api_key=a.api_key, concurrency=a.concurrency,
        max_tokens=a.max_tokens, margin=a.margin, temperature=a.temperature, top_p=a.top_p,
        seed=a.seed, request_timeout=a.request_timeout, max_duration_s=a.max_duration,
    )
    # Sent in hash order, not shortest first: a run cut by --max-duration is
    # still a sample of the serving prompts, not their shortest ones.
    out = Path(a.out) if a.out else cache_dir() / "served" / "live-client.jsonl"
    summary = {"command": _command_line(), "client_log": str(out),
               **collect_live(cfg, _serving_prompts(a), out)}
    _dump(summary)


def cmd_scaling(a: argparse.Namespace) -> None:
    from predictor.dataset import load_sharegpt_splits
    from predictor.evaluate import baseline_metrics
    from studies.predictor.scaling import VARIANTS, collect, render, run_variants, trends

    runs = Path(a.runs_dir) if a.runs_dir else cache_dir() / "runs" / "scaling"
    if not a.report_only:
        run_variants(runs, a.only, a.threads)
    s = load_sharegpt_splits()
    n_eval = 600
    base = {k: v.model_dump() for k, v in baseline_metrics(s.train, s.test[:n_eval]).items()}
    targets = {"mae": 0.8 * base["bucket_median"]["mae"], "acc50": 0.59, "acc100": 0.81}
    rows = collect(runs)
    report = {
        # The command that trains what is missing and reports (not `--report-only`).
        "command": _command_line().replace(" --report-only", ""), "eval_samples": n_eval,
        "baselines": base,
        "targets": targets, "variants": [v.name for v in VARIANTS],
        "runs": rows, "trends": trends(rows, targets),
    }
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "scaling.json").write_text(json.dumps(report, indent=2) + "\n")
    md = render(report)
    (out / "scaling.md").write_text(md)
    print(md)


def cmd_capacity(a: argparse.Namespace) -> None:
    from studies.predictor import capacity

    runs = Path(a.runs_dir) if a.runs_dir else cache_dir() / "runs" / "capacity"
    extra = ["--pairs", a.pairs] if a.pairs else []
    if not a.report_only:
        capacity.select(runs, a.device, a.parallel, extra)
    rows = capacity.selection_rows(runs)
    names = capacity.finalists(rows) if len(rows) == len(capacity.VARIANTS) else []
    if names and not a.report_only and not a.select_only:
        capacity.finish(runs, names, a.device, a.parallel, extra)
    device_name = None
    if a.device.startswith("cuda"):
        import torch

        device_name = torch.cuda.get_device_name(torch.device(a.device)) if torch.cuda.is_available() else None
    report = {
        "command": _command_line().replace(" --report-only", "").replace(" --select-only", ""),
        "device": a.device, "device_name": device_name, "val_fraction": capacity.VAL_FRACTION,
        "selection": rows, "winner": names[0] if names else None,
        "final": capacity.final_rows(runs, names),
    }
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "capacity.json").write_text(json.dumps(report, indent=2) + "\n")
    md = capacity.render(report)
    (out / "capacity.md").write_text(md)
    print(md)


def cmd_probe(a: argparse.Namespace) -> None:
    from predictor.dataset import load_sharegpt_splits
    from studies.predictor.probe import ProbeConfig, render_probe, run_probe

    cfg = ProbeConfig(
        backbone=a.backbone, formats=tuple(a.formats), layers=tuple(a.layers),
        combos=tuple(tuple(int(n) for n in c.split(",")) for c in a.combos),
        epochs=a.epochs, seed=a.seed,
    )
    s = load_sharegpt_splits()
    train = s.train[: a.train_samples] if a.train_samples else s.train
    test = s.test[: a.test_samples] if a.test_samples else s.test
    report = run_probe(cfg, train, test)
    report["command"] = _command_line()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "probe.json").write_text(json.dumps(report, indent=2) + "\n")
    md = render_probe(report, report["command"])
    (out / "probe.md").write_text(md)
    print(md)


def cmd_make_ensemble(a: argparse.Namespace) -> None:
    from predictor.ensemble import load_any, write_ensemble
    from studies.predictor.ensemble import gather_members

    out = Path(a.out)
    names = gather_members([Path(m) for m in a.members], out)
    write_ensemble(out, names, [_command_line()])
    load_any(out)  # members that cannot be averaged fail here, not in the server
    print(f"wrote {out}: members {names}")


def cmd_ceiling(a: argparse.Namespace) -> None:
    from studies.predictor.ceiling import same_prompt_ceiling

    s = splits(a)
    report = {"command": _command_line(),
              **same_prompt_ceiling(s.train + s.test + s.serve, a.min_words).model_dump()}
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=2) + "\n")
    _dump(report)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog=PROG,
        description="Studies of the response-length predictor: what chose the shipped recipe.",
    )
    common_args(ap, "capacity's trainings")
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser(
        "collect-completions",
        help="record (prompt, produced length) by running the served model on serving-split prompts",
    )
    dataset_args(p)
    p.add_argument("--model", default="embedded:smollm2")
    p.add_argument("--n", type=int, default=400)
    p.add_argument("--max-prompt-tokens", type=int, default=256)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--out", default=None, help="default <cache>/served/smollm2-served.jsonl")
    p.set_defaults(func=cmd_collect)

    p = sub.add_parser(
        "collect-live",
        help="send the same serving-split prompts to a running server (OpenAI chat endpoint), "
             "which records the completions itself with predictor.record_dir",
    )
    dataset_args(p)
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--model", default=None, help="default: the first model /v1/models lists")
    p.add_argument("--api-key", default=None)
    p.add_argument("--n", type=int, default=400)
    p.add_argument("--max-prompt-tokens", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=32, help="requests in flight")
    p.add_argument("--max-tokens", type=int, default=1024,
                   help="cap per request, lowered to max_model_len - prompt tokens - --margin")
    p.add_argument("--margin", type=int, default=64, help="tokens left for the chat template")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--seed", type=int, default=0, help="base of the per-prompt seeds")
    p.add_argument("--request-timeout", type=float, default=1800.0, help="seconds per request")
    p.add_argument("--max-duration", type=float, default=None,
                   help="stop sending new prompts after this many seconds")
    p.add_argument("--out", default=None,
                   help="client log (resumable), default <cache>/served/live-client.jsonl")
    p.set_defaults(func=cmd_collect_live)

    p = sub.add_parser(
        "scaling",
        help="train the scaling-study variants (depth, LoRA layers, prompt length, epochs) and report",
    )
    p.add_argument("--runs-dir", default=None, help="default <cache>/runs/scaling")
    p.add_argument("--only", nargs="+", default=None, help="variants to train (default all)")
    p.add_argument("--report-only", action="store_true", help="do not train, report what is there")
    p.add_argument("--out", default=str(DEFAULT_REPORTS))
    p.set_defaults(func=cmd_scaling)

    p = sub.add_parser(
        "capacity",
        help="the whole backbone, long prompts, more epochs (a GPU run): variants chosen on a "
             "validation slice, the winner tested",
    )
    p.add_argument("--runs-dir", default=None, help="default <cache>/runs/capacity")
    p.add_argument("--parallel", type=int, default=1, help="training processes at a time")
    p.add_argument("--pairs", default=None, help="splits JSONL passed on to train / evaluate")
    p.add_argument("--select-only", action="store_true", help="train the selection runs only")
    p.add_argument("--report-only", action="store_true", help="do not train, report what is there")
    p.add_argument("--out", default=str(LONG_REPORTS))
    p.set_defaults(func=cmd_capacity)

    p = sub.add_parser(
        "probe",
        help="heads on frozen backbone features: which layers, pooling and prompt format carry RL",
    )
    p.add_argument("--backbone", default=ModelConfig().backbone)
    p.add_argument("--formats", nargs="+", choices=["raw", "chat", "perception"], default=["raw", "chat"])
    p.add_argument("--layers", type=int, nargs="+", default=[4, 8, 16, 24, 30])
    p.add_argument("--combos", nargs="*", default=["16,24", "8,16,24,30"],
                   help="comma-separated layer sets pooled together (mean and last)")
    p.add_argument("--train-samples", type=int, default=None, help="default: the whole train split")
    p.add_argument("--test-samples", type=int, default=None, help="default: the whole test split")
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(DEFAULT_REPORTS))
    p.set_defaults(func=cmd_probe)

    p = sub.add_parser(
        "make-ensemble",
        help="average adapters trained with other seeds (shared frozen prefix) into one predictor",
    )
    p.add_argument("--out", required=True, help="ensemble folder; members are copied in as seed<N>/")
    p.add_argument("members", nargs="+", help="adapter folders written by `train`")
    p.set_defaults(func=cmd_make_ensemble)

    p = sub.add_parser(
        "ceiling",
        help="how well other answers to the identical prompt predict an answer's length (all splits)",
    )
    dataset_args(p)
    p.add_argument("--min-words", type=int, default=5, help="leave out shorter prompts (hi, continue)")
    p.add_argument("--out", default=None, help="write the figures as JSON")
    p.set_defaults(func=cmd_ceiling)

    a = ap.parse_args(argv)
    import torch

    torch.set_num_threads(a.threads)
    a.func(a)


if __name__ == "__main__":
    main()
