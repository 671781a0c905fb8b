"""The served-burst replay: every request gets its first token, and under
the MLFQ the longest prompt's comes last, its last piece alone (the 99th
first token does not wait for it)."""

from __future__ import annotations

import random

from scheduler.cost import LinearCost
from studies.burst.served import replay

COST = LinearCost(base_s=0.013, prefill_per_token_s=0.0015, decode_per_seq_s=0.0,
                  decode_base_s=0.02)


def _records(n: int = 100, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = [{"request_id": f"r{i}", "send_time": 0.001 * i,
            "prompt_tokens": rng.randint(5, 500), "output_tokens": rng.randint(5, 100)}
           for i in range(n)]
    out[37]["prompt_tokens"] = 1500
    return out


def test_every_request_gets_a_first_token_and_the_longest_prompt_comes_last():
    records = _records()
    mlfq = replay(records, COST, 0.0008)
    assert mlfq["last_first_tokens"][-1] == {
        "request_id": "r37", "prompt_tokens": 1500, "ttft_s": mlfq["ttft_max_s"]}
    # Its last piece runs alone (what the 2,048-token iteration before left
    # of it, ~500 tokens): the P99 is that much earlier.
    assert mlfq["ttft_max_s"] - mlfq["ttft_p99_s"] > 0.5
    fcfs = replay(records, COST, 0.0008, policy="fcfs")
    assert fcfs["ttft_mean_s"] > mlfq["ttft_mean_s"]
