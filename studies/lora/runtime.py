"""Against a running server with `lora_runtime` enabled (run_runtime.sh
starts it, its root holding adapters `a` and `b`): vLLM's runtime LoRA
routes as a client uses them.  Loads `a` as `smol-rt`, checks its greedy
answer against PEFT's model (float32), times the load and the first and
later requests (the engine reads the adapter on its first request), loads
`b` in place under the same name and checks the answer follows, unloads it
and checks the name is gone; a stream on the adapter runs throughout the
in-place reload and the unload, and must end whole.
`python -m studies.lora.runtime ROOT OUT_JSON`."""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import peft
import torch
from openai import OpenAI
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine.model_source import resolve_model
from studies.lora.live import PROMPT, TOKENS, greedy

BASE = "http://127.0.0.1:8000"
NAME = "smol-rt"


def reference(root: Path) -> dict[str, str]:
    path = resolve_model("embedded:smollm2")
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok(PROMPT)["input_ids"]
    out = {}
    for which in ("a", "b"):
        base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                    local_files_only=True).eval()
        model = peft.PeftModel.from_pretrained(base, str(root / which)).eval()
        out[which] = tok.decode(greedy(model, ids, TOKENS))
    return out


def answer(client: OpenAI) -> tuple[str, float]:
    t = time.perf_counter()
    text = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=TOKENS,
                                     temperature=0).choices[0].text
    return text, time.perf_counter() - t


def long_stream(client: OpenAI, out: dict[str, Any]) -> None:
    """One streamed answer on the adapter, read slowly, while it is reloaded
    and unloaded."""
    n, finish = 0, None
    for chunk in client.completions.create(model=NAME, prompt="A long story:", max_tokens=400,
                                           temperature=0, stream=True,
                                           extra_body={"ignore_eos": True}):
        if chunk.choices:
            n += 1
            finish = chunk.choices[0].finish_reason or finish
    out.update(stream_chunks=n, stream_finish=finish)


def main() -> None:
    root, out_path = Path(sys.argv[1]), sys.argv[2]
    want = reference(root)
    client = OpenAI(base_url=f"{BASE}/v1", api_key="unused")
    http = httpx.Client(base_url=BASE, timeout=120)
    res: dict[str, Any] = {}
    t = time.perf_counter()
    r = http.post("/v1/load_lora_adapter", json={"lora_name": NAME, "lora_path": "a"})
    res["load"] = {"status": r.status_code, "text": r.text,
                   "seconds": round(time.perf_counter() - t, 3)}
    res["models"] = [m.id for m in client.models.list().data]
    first, first_s = answer(client)
    later = [answer(client) for _ in range(3)]
    res["a"] = {"answer": first, "peft": want["a"], "matches": first == want["a"],
                "first_request_s": round(first_s, 3),
                "later_requests_s": [round(s, 3) for _, s in later],
                "later_equal": all(x == first for x, _ in later)}
    streamed: dict[str, Any] = {}
    th = threading.Thread(target=long_stream, args=(client, streamed))
    th.start()
    time.sleep(1.0)
    r = http.post("/v1/load_lora_adapter", json={"lora_name": NAME, "lora_path": "b",
                                                 "load_inplace": True})
    b_text, b_s = answer(client)
    res["b_in_place"] = {"status": r.status_code, "answer": b_text, "peft": want["b"],
                         "matches": b_text == want["b"], "first_request_s": round(b_s, 3)}
    r = http.post("/v1/unload_lora_adapter", json={"lora_name": NAME})
    gone = http.post("/v1/completions", json={"model": NAME, "prompt": "x", "max_tokens": 2})
    res["unload"] = {"status": r.status_code, "text": r.text,
                     "then_request_status": gone.status_code,
                     "models": [m.id for m in client.models.list().data]}
    th.join()
    res["stream_across_reload_and_unload"] = streamed
    Path(out_path).write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
