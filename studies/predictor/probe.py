"""Layer probe: where in the frozen backbone the response-length signal sits.

A LoRA run costs tens of minutes on a CPU; a head on frozen features costs
seconds once the features exist.  The probe runs the whole backbone once per
prompt format ("raw" prompt or framed in the chat template), keeps the mean
and the last-token state of chosen decoder layers, and trains one bins head
(the shipped head, `predictor.model.LengthHead`) per feature set.  It is how
the shipped adapter's `prompt_format`, `pool_layers` and `pooling` were
chosen; `python -m studies.predictor probe` reproduces the table.

Early stopping uses a validation slice of the training pairs, taken by prompt
(a repeated prompt never sits on both sides); the test pairs are scored once,
with the epoch the validation slice picked.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict
from tqdm import tqdm

from predictor.config import ModelConfig
from predictor.dataset import LengthPair, encode_pairs, is_validation_prompt, load_tokenizer
from predictor.evaluate import baseline_metrics
from predictor.metrics import evaluate_predictions
from predictor.model import (
    LengthHead,
    captured_layers,
    collate,
    decode,
    load_backbone,
    member_loss,
    pad_id_of,
    pool,
)
from predictor.prompt_format import chat_frame

# "Perception in advance" (Zheng et al. 2023, "Response Length Perception and
# Sequence Scheduling", the source of the Acc-50/100 targets): the prompt is
# followed by an instruction to state the answer's length instead of answering.
# Their Vicuna-7B follows it; the "perception" format measures whether a small
# backbone's state there carries more of the length (it does not, so the
# format stays out of `ModelConfig`).
PERCEPTION_INSTRUCTION = (
    "\n\nDon't output the response for the above instruction. Instead, you need to predict "
    "the number of tokens in your response. Output only one number."
)


def perception_frame(tokenizer: Any) -> tuple[list[int], list[int]]:
    """`chat_frame` with the perception instruction closing the user message."""
    before, after = chat_frame(tokenizer)
    instruction = tokenizer(PERCEPTION_INSTRUCTION, add_special_tokens=False)["input_ids"]
    return before, list(instruction) + after


class ProbeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    backbone: str = "embedded:smollm2"
    # "raw" prompt, "chat" template, or "perception": the chat template with an
    # instruction to state the answer's length (`perception_frame`).
    formats: tuple[Literal["raw", "chat", "perception"], ...] = ("raw", "chat")
    layers: tuple[int, ...] = (4, 8, 16, 24, 30)
    # Sets of layers whose mean and last states are concatenated.
    combos: tuple[tuple[int, ...], ...] = ((16, 24), (8, 16, 24, 30))
    prompt_head: int = 96
    prompt_tail: int = 32
    epochs: int = 40
    patience: int = 8
    val_fraction: float = 0.15
    head_hidden: int = 256
    head_dropout: float = 0.3
    lr: float = 1e-3
    weight_decay: float = 1e-2
    batch_size: int = 64
    seed: int = 0


@torch.no_grad()
def features(
    backbone: torch.nn.Module, ids: Sequence[Sequence[int]], pad_id: int, layers: Sequence[int],
    batch_size: int = 16, desc: str = "features",
) -> dict[tuple[int, str], torch.Tensor]:
    """{(layer, "mean" | "last"): (N, hidden)} for every prompt, in input order."""
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    out: dict[tuple[int, str], torch.Tensor] = {}
    for s in tqdm(range(0, len(order), batch_size), desc=desc):
        idx = order[s : s + batch_size]
        input_ids, mask = collate([ids[i] for i in idx], pad_id)
        with captured_layers(backbone, layers) as got:
            backbone(input_ids=input_ids, attention_mask=mask, use_cache=False)
        for n in layers:
            for how in ("mean", "last"):
                key = (n, how)
                if key not in out:
                    out[key] = torch.zeros(len(ids), got[n].shape[-1])
                out[key][torch.tensor(idx)] = pool(got[n], mask, how).float()
    return out


def fit_head(
    x: torch.Tensor, pt: torch.Tensor, y: torch.Tensor, train: torch.Tensor, val: torch.Tensor,
    cfg: ProbeConfig,
) -> tuple[LengthHead, ModelConfig, int]:
    """A bins head on fixed features; the epoch with the best validation MAE."""
    torch.manual_seed(cfg.seed)
    mcfg = ModelConfig(head="bins", decode="median", head_hidden=cfg.head_hidden,
                       head_dropout=cfg.head_dropout)
    head = LengthHead(x.shape[1], mcfg)
    head.init_prior(y[train].tolist(), mcfg)
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    gen = torch.Generator().manual_seed(cfg.seed)
    best_mae, best_state, best_epoch = float("inf"), head.state_dict(), -1
    for epoch in range(cfg.epochs):
        head.train()
        perm = train[torch.randperm(len(train), generator=gen)]
        for s in range(0, len(perm), cfg.batch_size):
            b = perm[s : s + cfg.batch_size]
            loss = member_loss(head.members(x[b], pt[b]), y[b], mcfg)
            opt.zero_grad()
            loss.backward()
            opt.step()
        head.eval()
        with torch.no_grad():
            err = (decode(head(x[val], pt[val]), mcfg) - y[val].float()).abs().mean().item()
        if err < best_mae:
            best_mae, best_epoch = err, epoch
            best_state = {k: v.clone() for k, v in head.state_dict().items()}
        elif epoch - best_epoch >= cfg.patience:
            break
    head.load_state_dict(best_state)
    return head.eval(), mcfg, best_epoch + 1


def run_probe(
    cfg: ProbeConfig, train_pairs: Sequence[LengthPair], test_pairs: Sequence[LengthPair]
) -> dict[str, Any]:
    pairs = list(train_pairs) + list(test_pairs)
    n_train = len(train_pairs)
    y = torch.tensor([p.response_len for p in pairs])
    pt = torch.tensor([p.prompt_tokens for p in pairs])
    is_val = torch.tensor([is_validation_prompt(p.prompt, cfg.val_fraction, cfg.seed) for p in train_pairs])
    train = torch.nonzero(~is_val).squeeze(1)
    val = torch.nonzero(is_val).squeeze(1)
    test = torch.arange(n_train, len(pairs))
    tok = load_tokenizer(cfg.backbone)
    backbone = load_backbone(ModelConfig(backbone=cfg.backbone)).eval()
    wanted = sorted(set(cfg.layers) | {n for c in cfg.combos for n in c})
    rows: list[dict[str, Any]] = []
    seconds: dict[str, float] = {}
    for fmt in cfg.formats:
        enc = encode_pairs(tok, pairs, cfg.prompt_head, cfg.prompt_tail, chat=fmt == "chat")
        if fmt == "perception":
            before, after = perception_frame(tok)
            enc.ids = [before + x + after for x in enc.ids]
        t0 = time.perf_counter()
        feats = features(backbone, enc.ids, pad_id_of(tok), wanted, desc=f"features ({fmt})")
        seconds[fmt] = time.perf_counter() - t0
        sets: list[tuple[str, list[tuple[int, str]]]] = [
            (f"L{n} {how}", [(n, how)]) for n in cfg.layers for how in ("mean", "last")
        ]
        sets += [
            ("L" + "+".join(map(str, c)) + " mean+last", [(n, h) for n in c for h in ("mean", "last")])
            for c in cfg.combos
        ]
        for name, keys in sets:
            x = torch.cat([feats[k] for k in keys], dim=1)
            head, mcfg, epochs = fit_head(x, pt, y, train, val, cfg)
            with torch.no_grad():
                pred = decode(head(x[test], pt[test]), mcfg).tolist()
            m = evaluate_predictions(pred, y[test].tolist(), ratios=())
            rows.append({"format": fmt, "features": name, "epochs": epochs,
                         "mae": m.mae, "acc50": m.acc50, "acc100": m.acc100})
            tqdm.write(f"{fmt:5s} {name:28s} MAE {m.mae:6.1f}  Acc-50 {m.acc50:.3f}  Acc-100 {m.acc100:.3f}")
    fit = [p for i, p in enumerate(train_pairs) if not bool(is_val[i])]
    base = {
        name: {"mae": m.mae, "acc50": m.acc50, "acc100": m.acc100}
        for name, m in baseline_metrics(fit, test_pairs).items()
    }
    return {
        "config": cfg.model_dump(),
        "n_fit": len(train), "n_val": len(val), "n_test": len(test),
        "feature_seconds": seconds, "rows": rows, "baselines": base,
    }


def render_probe(report: dict[str, Any], command: str) -> str:
    c = report["config"]
    lines = [
        "# Layer probe: the length signal in the frozen backbone",
        "",
        f"One bins head ({c['head_hidden']} hidden, dropout {c['head_dropout']}) per feature set on the "
        f"frozen `{c['backbone']}` (all layers, no LoRA), prompt = first {c['prompt_head']} + last "
        f"{c['prompt_tail']} tokens; 'chat' frames it in the chat template up to the assistant turn, "
        f"'perception' also closes the user message with an instruction to state the answer's length. "
        f"Fit on {report['n_fit']} training pairs, early-stopped on {report['n_val']} held out by prompt, "
        f"scored once on {report['n_test']} test pairs. Reproduce:",
        "",
        "```bash",
        command,
        "```",
        "",
        "| format | features | epochs | MAE | Acc-50 | Acc-100 |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in report["rows"]:
        lines.append(f"| {r['format']} | {r['features']} | {r['epochs']} | {r['mae']:.1f} | "
                     f"{100 * r['acc50']:.1f}% | {100 * r['acc100']:.1f}% |")
    for name, m in report["baselines"].items():
        lines.append(f"| baseline | {name.replace('_', ' ')} | | {m['mae']:.1f} | "
                     f"{100 * m['acc50']:.1f}% | {100 * m['acc100']:.1f}% |")
    secs = ", ".join(f"{k} {v / 60:.1f} min" for k, v in report["feature_seconds"].items())
    lines += ["", f"Feature extraction (forward passes): {secs}.", ""]
    return "\n".join(lines)
