"""Greedy answers of a bfloat16 SmolLM2 against the float32 model's, with the
rounded logits' ties at the top broken by the exact logits (the shipped
engine), by the lowest token id (what the argmax did before), and
`transformers`' own bfloat16 model beside them.

A bf16 lm_head rounds its float32 sums to 8 significant bits: at SmolLM2's
logit magnitudes (8-32) a rounded logit stands for a span of 1/16-1/8, and
the two likeliest tokens of a step often round to one value.  The argmax
then took the lower id whatever the model computed; the README's own
example ("What is the capital of France?") began "L'Étoile, la Marseillaise,
la femme, la femme, ..." on an AMX CPU in the shipped configuration, where
the float32 model's first token wins by 0.08.  Now a tie at the top goes to
the larger exact logit (`engine.logits_cpu`).

Chat prompts (five short questions, then the first ShareGPT human turns of
at most 256 tokens), `max_tokens` greedy tokens each, every variant in its
own process; one thread.

    python -m studies.engine_cpu.greedy_ties --prompts 64 --tokens 32 \\
        --out studies/engine_cpu/greedy_ties.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.report import machine_meta, write_report

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.",
             "What is 12 times 7?", "Name three primary colors.",
             "Who wrote Romeo and Juliet?"]
# name -> what it runs
VARIANTS = {
    "float32": "our engine, float32 (the reference)",
    "bf16": "our engine, bfloat16, ties broken by the exact logits (shipped)",
    "bf16_lowest_id": "our engine, bfloat16, ties to the lowest token id (before)",
    "bf16_float32_head": "our engine, bfloat16, the lm_head computed in float32",
    "hf_bf16": "transformers, bfloat16 (SDPA)",
}


def _prompts(tok: Any, n: int) -> list[list[int]]:
    from workloads.sharegpt import first_exchanges, load_sharegpt

    texts = QUESTIONS + [e[1] for e in first_exchanges(load_sharegpt()) if e is not None]
    out: list[list[int]] = []
    for text in texts:
        ids = tok.apply_chat_template([{"role": "user", "content": text}],
                                      add_generation_prompt=True)
        ids = ids if isinstance(ids, list) else ids["input_ids"]
        if len(ids) <= 256:
            out.append(ids)
        if len(out) == n:
            break
    return out


def run_variant(variant: str, n: int, tokens: int) -> dict[str, list[int]]:
    """Each prompt's greedy tokens under `variant` (in this process)."""
    import torch
    from transformers import AutoTokenizer

    from engine.model_source import resolve_model

    torch.set_num_threads(1)
    path = resolve_model("embedded:smollm2")
    prompts = _prompts(AutoTokenizer.from_pretrained(str(path)), n)
    if variant == "hf_bf16":
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16)
        out = {}
        for i, ids in enumerate(prompts):
            with torch.no_grad():
                seq = model.generate(torch.tensor([ids]), max_new_tokens=tokens,
                                     min_new_tokens=tokens, do_sample=False)
            out[str(i)] = seq[0, len(ids):].tolist()
        return out
    from engine.models.base import CausalLM
    from engine.runner import ModelRunner
    from engine.sampling_params import SamplingParams
    from tests.engine.helpers import drive

    if variant == "bf16_lowest_id":
        CausalLM.exact_source = lambda self, hidden, logits: None  # type: ignore[method-assign]
    if variant == "bf16_float32_head":
        CausalLM.vocab_logits = (  # type: ignore[method-assign]
            lambda self, hidden, head: hidden.float() @ head.float().T)
    dtype = torch.float32 if variant == "float32" else torch.bfloat16
    runner = ModelRunner(model_path=str(path), dtype=dtype, device="cpu", num_blocks=1200,
                         block_size=16, max_model_len=512, num_threads=1)
    got = drive(runner, {str(i): ids for i, ids in enumerate(prompts)},
                SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True),
                block_size=16, max_model_len=512, num_blocks=1200, max_batch_tokens=2048,
                max_batch_size=64)
    return got.tokens


def compare(ref: dict[str, list[int]], got: dict[str, list[int]]) -> dict[str, float]:
    keys = sorted(ref, key=int)
    same_until = [next((i for i, (x, y) in enumerate(zip(got[k], ref[k])) if x != y),
                       len(ref[k])) for k in keys]
    return {
        "first_token_as_float32": sum(got[k][:1] == ref[k][:1] for k in keys) / len(keys),
        "all_tokens_as_float32": sum(got[k] == ref[k] for k in keys) / len(keys),
        "mean_tokens_before_divergence": sum(same_until) / len(keys),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--one", help=argparse.SUPPRESS)  # run one variant, print its tokens
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(run_variant(args.one, args.prompts, args.tokens)))
        return
    tokens: dict[str, dict[str, list[int]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for v in ["float32", *[v for v in args.variants.split(",") if v != "float32"]]:
            log = Path(tmp) / f"{v}.log"
            with open(log, "w") as err:
                res = subprocess.run(
                    [sys.executable, "-m", "studies.engine_cpu.greedy_ties", "--one", v,
                     "--prompts", str(args.prompts), "--tokens", str(args.tokens),
                     "--out", "-"], stdout=subprocess.PIPE, stderr=err, text=True)
            if res.returncode != 0:
                raise SystemExit(f"{v} failed:\n{log.read_text()[-2000:]}")
            tokens[v] = json.loads(res.stdout.strip().splitlines()[-1])
            print(v, "done", flush=True)
    from transformers import AutoTokenizer

    from engine.model_source import resolve_model

    tok = AutoTokenizer.from_pretrained(str(resolve_model("embedded:smollm2")))
    rows = []
    for v, got in tokens.items():
        rows.append({"variant": v, "what": VARIANTS[v], **compare(tokens["float32"], got),
                     "capital_of_france": tok.decode(got["0"][:12])})
        r = rows[-1]
        print(f"{v:18s} first {r['first_token_as_float32']:.3f}  all "
              f"{r['all_tokens_as_float32']:.3f}  until {r['mean_tokens_before_divergence']:5.1f}"
              f"  {r['capital_of_france']!r}")
    write_report({"machine": machine_meta(), "prompts": args.prompts, "tokens": args.tokens,
                  "results": rows}, args.out)


if __name__ == "__main__":
    main()
