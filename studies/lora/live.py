"""Against a running server with the adapter `smol-lora` (run.sh starts it):
greedy parity with PEFT's model in float32, and tokens/s of concurrent
answers on the base model, on the adapter and half and half, in one run.
`python -m studies.lora.live ADAPTER_DIR OUT_JSON`."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

import peft
import torch
from openai import AsyncOpenAI, OpenAI
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine.model_source import resolve_model

URL = "http://127.0.0.1:8000/v1"
PROMPT = "The capital of France is"
TOKENS = 24


@torch.inference_mode()
def greedy(model: Any, ids: list[int], n: int) -> list[int]:
    out: list[int] = []
    x = torch.tensor([ids])
    for _ in range(n):
        token = int(model(input_ids=x).logits[0, -1].argmax())
        out.append(token)
        x = torch.cat([x, torch.tensor([[token]])], dim=1)
    return out


def parity(adapter: str) -> dict[str, Any]:
    client = OpenAI(base_url=URL, api_key="unused")
    base_path = resolve_model("embedded:smollm2")
    tok = AutoTokenizer.from_pretrained(base_path)
    ids = tok(PROMPT)["input_ids"]
    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32,
                                                local_files_only=True).eval()
    want_base = tok.decode(greedy(base, ids, TOKENS))
    want_lora = tok.decode(greedy(peft.PeftModel.from_pretrained(base, adapter).eval(), ids,
                                  TOKENS))
    got = {m: client.completions.create(model=m, prompt=PROMPT, max_tokens=TOKENS,
                                        temperature=0).choices[0].text
           for m in ("smollm2", "smol-lora")}
    return {"base": got["smollm2"], "base_reference": want_base,
            "adapter": got["smol-lora"], "adapter_reference": want_lora,
            "base_matches": got["smollm2"] == want_base,
            "adapter_matches": got["smol-lora"] == want_lora}


async def rate(models: list[str], n: int = 16, tokens: int = 64) -> float:
    client = AsyncOpenAI(base_url=URL, api_key="unused")

    async def one(i: int) -> int:
        r = await client.completions.create(model=models[i % len(models)], prompt=f"Story {i}:",
                                            max_tokens=tokens, temperature=0,
                                            extra_body={"ignore_eos": True})
        assert r.usage is not None
        return r.usage.completion_tokens

    start = time.perf_counter()
    done = sum(await asyncio.gather(*(one(i) for i in range(n))))
    seconds = time.perf_counter() - start
    await client.close()
    return done / seconds


def main() -> None:
    adapter, out = sys.argv[1], sys.argv[2]
    result: dict[str, Any] = {"parity": parity(adapter), "tokens_per_s": []}
    # Base first and last: the machine's drift shows between them.
    for models in (["smollm2"], ["smol-lora"], ["smollm2", "smol-lora"], ["smollm2"]):
        result["tokens_per_s"].append({"models": models, "tokens_per_s": asyncio.run(rate(models))})
    json.dump(result, open(out, "w"), indent=1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
