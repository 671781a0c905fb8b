"""A random PEFT LoRA adapter of the shipped SmolLM2 (all seven projections),
for the live LoRA study: `python -m studies.lora.make_adapter OUT [--rank R]`.
Its A and B are drawn at `--std` (a no-op B would measure nothing)."""

from __future__ import annotations

import argparse

import peft
import torch
from transformers import AutoModelForCausalLM

from engine.model_source import resolve_model

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--std", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_pretrained(resolve_model("embedded:smollm2"),
                                                 dtype=torch.float32, local_files_only=True)
    tuned = peft.get_peft_model(model, peft.LoraConfig(
        r=args.rank, lora_alpha=2 * args.rank, target_modules=TARGETS,
        init_lora_weights=False))
    with torch.no_grad():
        for name, p in tuned.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, args.std)
    tuned.save_pretrained(args.out)
    print(args.out)


if __name__ == "__main__":
    main()
