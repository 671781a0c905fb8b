"""`studies.engine_gpu.engine_loop` end to end on CPU with a tiny Llama shape,
so that the GPU study of the replica's serving loop keeps running between
GPU sessions: every request finishes, swaps happen and every device and
host block comes back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from studies.engine_gpu import engine_loop


def test_serves_a_burst_to_completion_and_frees_every_block(tmp_path: Path) -> None:
    from engine.model_source import ModelSourceError, resolve_model

    try:
        tokenizer = resolve_model("embedded:smollm2")
    except ModelSourceError as e:
        pytest.skip(f"embedded SmolLM2 unavailable: {e}")
    out = tmp_path / "loop.json"
    engine_loop.main([
        "--out", str(out), "--device", "cpu", "--dtype", "float32", "--layers", "2",
        "--hidden", "64", "--intermediate", "128", "--heads", "4", "--kv-heads", "2",
        "--tokenizer", str(tokenizer), "--requests", "30", "--prompt-len", "8,120",
        "--output-len", "4,24", "--kv-tokens", "512", "--host-kv-tokens", "4096",
        "--max-batch-size", "8", "--max-batch-tokens", "128", "--max-model-len", "256",
    ])
    r = json.loads(out.read_text())
    assert r["all_finished"] and r["finished"] == 30 and not r["errors"]
    # Too little device KV for the burst: jobs were swapped out and back.
    assert r["swap_outs"] > 0 and r["swap_ins"] > 0
    assert r["free_blocks_after"] == r["num_blocks"] == 32
    assert r["host_free_blocks_after"] == r["host_blocks"] == 256
    assert r["output_tokens"] > 0 and r["ttft_s"]["p50"] > 0
