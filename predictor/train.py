"""LoRA fine-tuning loop: seeded, resumable, with a learning curve.

EconoServe §2.3 fine-tunes with LoRA for three epochs.  Here the trainable
weights are the LoRA matrices of the top layers and the head; the frozen
bottom layers run once per prompt through `PrefixCache`.

A checkpoint (`<out>/checkpoint/`) holds the adapter, the head, the optimizer
and scheduler states, the step and the RNG state; `resume=True` continues from
it.  The batch order of an epoch is a function of (seed, epoch), so a resumed
run sees the same batches as an uninterrupted one.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from predictor.config import ModelConfig, TrainConfig, cache_dir
from predictor.dataset import Encoded, LengthPair, encode_pairs_for, load_tokenizer, split_validation
from predictor.ensemble import Predictor
from predictor.evaluate import head_outputs
from predictor.metrics import evaluate_predictions
from predictor.model import (
    ADAPTER_SUBDIR,
    HEAD_FILE,
    LengthPredictor,
    build_predictor,
    collate,
    decode,
    frozen_prefix,
    load_predictor,
    n_layers,
    pad_id_of,
    save_predictor,
)
from predictor.prefix_cache import PrefixCache, cache_path, injected

CHECKPOINT_SUBDIR = "checkpoint"
STATE_FILE = "train_state.pt"
CURVE_FILE = "curve.jsonl"


def read_curve(run_dir: Path) -> list[dict[str, Any]]:
    """The learning-curve points a run wrote (none if it wrote no curve yet)."""
    path = Path(run_dir) / CURVE_FILE
    if not path.is_file():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def epoch_batches(lengths: Sequence[int], batch_size: int, seed: int, epoch: int) -> list[list[int]]:
    """Shuffled batches of similar-length prompts (less padding), fixed by (seed, epoch)."""
    g = random.Random(seed * 1_000_003 + epoch)
    idx = list(range(len(lengths)))
    g.shuffle(idx)
    window = batch_size * 32
    batches: list[list[int]] = []
    for s in range(0, len(idx), window):
        chunk = sorted(idx[s : s + window], key=lambda i: lengths[i])
        batches += [chunk[k : k + batch_size] for k in range(0, len(chunk), batch_size)]
    g.shuffle(batches)
    return batches


def _lr_lambda(warmup: int, total: int) -> Any:
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / max(1, warmup)
        frac = (step - warmup) / max(1, total - warmup)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, frac)))

    return f


def prefix_cache_for(
    model: Predictor, encs: Sequence[Encoded], pad_id: int, use: bool
) -> PrefixCache | None:
    k = frozen_prefix(model.cfg, n_layers(model.cfg, model.backbone))
    if not use or k == 0:
        return None
    from engine.model_source import resolve_model

    cfg = model.cfg
    ident = json.dumps(
        [str(resolve_model(cfg.backbone)), cfg.depth, cfg.prompt_head, cfg.prompt_tail, cfg.dtype]
        + ([cfg.prompt_format] if cfg.prompt_format != "raw" else [])
    )
    ids = [x for e in encs for x in e.ids]
    return PrefixCache.build(model.backbone, k, ids, pad_id, cache_path(cache_dir(), ident, k))


def _save_checkpoint(
    model: LengthPredictor,
    opt: torch.optim.Optimizer,
    sched: torch.optim.lr_scheduler.LRScheduler,
    step: int,
    ckpt: Path,
) -> None:
    tmp = ckpt.with_name(ckpt.name + ".tmp")
    save_predictor(model, tmp, {"step": step})
    torch.save(
        {
            "step": step,
            "optimizer": opt.state_dict(),
            "scheduler": sched.state_dict(),
            "torch_rng": torch.get_rng_state(),
        },
        tmp / STATE_FILE,
    )
    if ckpt.exists():
        import shutil

        shutil.rmtree(ckpt)
    tmp.rename(ckpt)


def _load_checkpoint(
    model: LengthPredictor,
    opt: torch.optim.Optimizer,
    sched: torch.optim.lr_scheduler.LRScheduler,
    ckpt: Path,
) -> int:
    from safetensors.torch import load_file

    lora = ckpt / ADAPTER_SUBDIR / "adapter_model.safetensors"
    if lora.is_file():
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(model.backbone, load_file(str(lora)))
    model.head.load_state_dict(load_file(str(ckpt / HEAD_FILE)))
    state = torch.load(ckpt / STATE_FILE, weights_only=False)
    opt.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["torch_rng"])
    return int(state["step"])


def quick_eval(
    model: LengthPredictor, enc: Encoded, pad_id: int, cache: PrefixCache | None
) -> dict[str, float]:
    out = head_outputs(model, enc, pad_id, cache, progress=False)
    m = evaluate_predictions(decode(out, model.cfg).tolist(), enc.lengths, ratios=())
    return {"mae": m.mae, "acc50": m.acc50, "acc100": m.acc100}


def train(
    model_cfg: ModelConfig,
    train_cfg: TrainConfig,
    train_pairs: Sequence[LengthPair],
    eval_pairs: Sequence[LengthPair],
    out_dir: Path,
    resume: bool = False,
    init_from: Path | None = None,
    progress: bool = True,
    checkpoint_dir: Path | None = None,
    stop_at: int | None = None,
) -> dict[str, Any]:
    """Fine-tune and save the predictor to `out_dir`; returns a summary.

    Checkpoints go to `checkpoint_dir` (default `<out_dir>/checkpoint`): keep
    them outside the repository when `out_dir` is a shipped adapter folder.
    `stop_at` checkpoints and returns at that step without changing the
    schedule (a time-boxed or interrupted run, continued with `resume`).
    """
    seed_everything(train_cfg.seed)
    if init_from is not None:
        # Online retraining continues from a trained adapter (same config).
        model = load_predictor(init_from, trainable=True)
        model_cfg = model.cfg
    else:
        model = build_predictor(model_cfg)
    pairs = list(train_pairs)
    if train_cfg.val_fraction > 0:
        # The validation slice stands in for `eval_pairs`, which then stay
        # unseen. It does not depend on the training seed, so runs of other
        # seeds are scored on the same pairs.
        pairs, eval_pairs = split_validation(pairs, train_cfg.val_fraction, seed=0)
    if init_from is None:
        model.head.init_prior([p.response_len for p in pairs], model_cfg)
    if train_cfg.max_train_samples is not None:
        pairs = pairs[: train_cfg.max_train_samples]
    dev = torch.device(train_cfg.device)
    model.to(dev)
    tok = load_tokenizer(model_cfg.backbone)
    pad_id = pad_id_of(tok)
    eval_subset = list(eval_pairs)[: train_cfg.eval_samples]
    enc = encode_pairs_for(tok, pairs, model_cfg)
    enc_eval = encode_pairs_for(tok, eval_subset, model_cfg)
    t_cache = time.perf_counter()
    cache = prefix_cache_for(model, [enc, enc_eval], pad_id, train_cfg.use_prefix_cache)
    t_cache = time.perf_counter() - t_cache

    params = [p for n, p in model.backbone.named_parameters() if p.requires_grad]
    opt = torch.optim.AdamW(
        [
            {"params": params, "lr": train_cfg.lr},
            {"params": list(model.head.parameters()), "lr": train_cfg.head_lr},
        ],
        weight_decay=train_cfg.weight_decay,
    )
    steps_per_epoch = max(1, math.ceil(len(pairs) / train_cfg.batch_size))
    total = train_cfg.max_steps or max(1, math.ceil(train_cfg.epochs * steps_per_epoch))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda(train_cfg.warmup_steps, total))

    out_dir.mkdir(parents=True, exist_ok=True)
    ckpt = checkpoint_dir or out_dir / CHECKPOINT_SUBDIR
    ckpt.parent.mkdir(parents=True, exist_ok=True)
    step = 0
    if resume and (ckpt / STATE_FILE).is_file():
        step = _load_checkpoint(model, opt, sched, ckpt)
    start_step = step
    curve_path = out_dir / CURVE_FILE
    # Points past the checkpoint are recomputed by the resumed run.
    kept = [p for p in read_curve(out_dir) if p["step"] <= step]
    if curve_path.exists():
        curve_path.write_text("".join(json.dumps(p) + "\n" for p in kept))

    model.train()
    t0 = time.perf_counter()
    tokens = 0
    ema: float | None = None
    losses: list[float] = []
    batches: list[list[int]] = []
    cur_epoch = -1
    # A run resumed at its last step still reports the point it scored there.
    final: dict[str, Any] = kept[-1] if step and kept and kept[-1]["step"] == step else {}
    bar = tqdm(total=total, initial=step, desc="train", disable=not progress)
    end = min(total, stop_at) if stop_at is not None else total
    while step < end:
        epoch = step // steps_per_epoch
        if epoch != cur_epoch:
            batches = epoch_batches([len(x) for x in enc.ids], train_cfg.batch_size, train_cfg.seed, epoch)
            cur_epoch = epoch
        idx = batches[step % steps_per_epoch]
        ids = [enc.ids[i] for i in idx]
        input_ids, mask = (t.to(dev) for t in collate(ids, pad_id))
        pt = torch.tensor([enc.prompt_tokens[i] for i in idx], device=dev)
        y = torch.tensor([enc.lengths[i] for i in idx], device=dev)
        if cache is not None:
            with injected(model.backbone, cache.k, cache.batch(ids, dev)):
                loss = model.loss(model(input_ids, mask, pt, return_members=True), y)
        else:
            loss = model.loss(model(input_ids, mask, pt, return_members=True), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.trainable_parameters(), 1.0)
        opt.step()
        sched.step()
        step += 1
        tokens += int(mask.sum())
        lv = float(loss.detach())
        losses.append(lv)
        ema = lv if ema is None else 0.95 * ema + 0.05 * lv
        bar.update(1)
        bar.set_postfix(loss=f"{ema:.4f}", epoch=epoch)
        last = step == end
        if (train_cfg.eval_every and step % train_cfg.eval_every == 0) or last:
            if enc_eval.ids:
                point = {
                    "step": step,
                    "samples_seen": step * train_cfg.batch_size,
                    "loss_ema": ema,
                    **quick_eval(model, enc_eval, pad_id, cache),
                }
                final = point
                with curve_path.open("a") as f:
                    f.write(json.dumps(point) + "\n")
                bar.write(json.dumps(point))
                model.train()
        if (train_cfg.checkpoint_every and step % train_cfg.checkpoint_every == 0) or last:
            _save_checkpoint(model, opt, sched, step, ckpt)
    bar.close()
    elapsed = time.perf_counter() - t0
    save_predictor(model, out_dir, {"step": step, "train_config": train_cfg.model_dump()})
    summary = {
        "steps": step,
        "n_train": len(pairs),
        "device": str(dev),
        # What the curve and `final` score: a validation slice of the training
        # split (prompt-disjoint), or the first test pairs.
        "eval_on": "validation" if train_cfg.val_fraction > 0 else "test",
        "n_eval": len(eval_subset),
        "final": {k: final[k] for k in ("mae", "acc50", "acc100")} if final else None,
        # A resumed run times only its own segment, from `start_step`.
        "start_step": start_step,
        "train_seconds": elapsed,
        "prefix_cache_seconds": t_cache,
        "tokens_per_second": tokens / elapsed if elapsed > 0 else 0.0,
        "first_loss": losses[0] if losses else None,
        "last_loss_ema": ema,
        "losses": losses,
    }
    (out_dir / "train_summary.json").write_text(
        json.dumps({k: v for k, v in summary.items() if k != "losses"}, indent=2) + "\n"
    )
    return summary
