"""Served-completion records produced offline with the served model itself.

The retraining path (EconoServe §3.3.2: the predictor "undergoes continual
retraining in the system") consumes what our server recorded: one JSONL line
per finished request, {"prompt", "output_len", "finish_reason"}.  Until a
server log exists, this module produces the same records by running the served
model (greedy, Hugging Face `generate`) on serving-split prompts, which are
never used for ShareGPT fine-tuning.  The length counts the answer's tokens
before the end-of-turn token, the same definition as the ShareGPT RL.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
from tqdm import tqdm

from predictor.dataset import LengthPair


def collect_completions(
    model_spec: str,
    pairs: Sequence[LengthPair],
    out_path: Path,
    max_new_tokens: int = 256,
    batch_size: int = 16,
) -> int:
    """Generate answers for `pairs`' prompts, appending records to `out_path`.

    Resumable: prompts whose id is already in `out_path` are skipped.
    Returns the number of records written in this call.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.model_source import resolve_model
    from engine.tokenizer import render_chat

    path = resolve_model(model_spec)
    tok = AutoTokenizer.from_pretrained(str(path))
    tok.padding_side = "left"  # generation continues from the right edge
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    done: set[str] = set()
    out_path.parent.mkdir(parents=True, exist_ok=True)
    if out_path.is_file():
        done = {json.loads(line)["id"] for line in out_path.open() if line.strip()}
    todo = [p for p in pairs if p.id not in done]
    todo.sort(key=lambda p: p.prompt_tokens)  # similar lengths batch with less padding
    stop_ids = {tok.eos_token_id}
    written = 0
    with out_path.open("a", encoding="utf-8") as f, tqdm(total=len(todo), desc="generate") as bar:
        for i in range(0, len(todo), batch_size):
            chunk = todo[i : i + batch_size]
            texts = [render_chat(tok, [{"role": "user", "content": p.prompt}]) for p in chunk]
            enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
            with torch.inference_mode():
                out = model.generate(
                    **enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id
                )
            gen = out[:, enc["input_ids"].shape[1] :].tolist()
            for p, g in zip(chunk, gen):
                n = next((j for j, t in enumerate(g) if t in stop_ids), None)
                rec = {
                    "id": p.id,
                    "prompt": p.prompt,
                    "prompt_tokens": p.prompt_tokens,
                    "output_len": n if n is not None else len(g),
                    "finish_reason": "stop" if n is not None else "length",
                }
                f.write(json.dumps(rec) + "\n")
                written += 1
            f.flush()
            bar.update(len(chunk))
    return written
