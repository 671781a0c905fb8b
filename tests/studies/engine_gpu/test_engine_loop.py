"""`studies.engine_gpu.engine_loop` end to end on CPU with a tiny Llama shape,
so that the GPU study of the replica's serving loop keeps running between
GPU sessions: every request finishes, swaps happen and every device and
host block comes back."""

from __future__ import annotations

import gc
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from studies.engine_gpu import engine_loop


@pytest.fixture(autouse=True)
def _collector_as_it_was() -> Iterator[None]:
    """The study freezes the heap and sets the collector's thresholds, as a
    replica does: the rest of the session gets the collector back as it was."""
    thresholds = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*thresholds)


def _burst(out: Path, tokenizer: Path) -> list[str]:
    """30 requests on a tiny Llama shape, with too little device KV for them."""
    return [
        "--out", str(out), "--device", "cpu", "--dtype", "float32", "--layers", "2",
        "--hidden", "64", "--intermediate", "128", "--heads", "4", "--kv-heads", "2",
        "--tokenizer", str(tokenizer), "--requests", "30", "--prompt-len", "8,120",
        "--output-len", "4,24", "--kv-tokens", "512", "--host-kv-tokens", "4096",
        "--max-batch-size", "8", "--max-batch-tokens", "128", "--max-model-len", "256",
    ]


def test_serves_a_burst_to_completion_and_frees_every_block(tmp_path: Path) -> None:
    from engine.model_source import ModelSourceError, resolve_model

    try:
        tokenizer = resolve_model("embedded:smollm2")
    except ModelSourceError as e:
        pytest.skip(f"embedded SmolLM2 unavailable: {e}")
    out = tmp_path / "loop.json"
    engine_loop.main(_burst(out, tokenizer))
    r = json.loads(out.read_text())
    assert r["all_finished"] and r["finished"] == 30 and not r["errors"]
    # Too little device KV for the burst: jobs were swapped out and back.
    assert r["swap_outs"] > 0 and r["swap_ins"] > 0
    assert r["free_blocks_after"] == r["num_blocks"] == 32
    assert r["host_free_blocks_after"] == r["host_blocks"] == 256
    assert r["output_tokens"] > 0 and r["ttft_s"]["p50"] > 0


def test_the_null_pass_serves_the_burst_with_no_forward_pass(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.model_source import ModelSourceError, resolve_model
    from engine.runner import ModelRunner

    try:
        tokenizer = resolve_model("embedded:smollm2")
    except ModelSourceError as e:
        pytest.skip(f"embedded SmolLM2 unavailable: {e}")
    passes: list[int] = []
    stripped_after: list[int] = []
    forward, strip = ModelRunner._forward, engine_loop.strip_pass

    def counted(self: ModelRunner, plan: object, batch: object) -> object:
        passes.append(1)
        return forward(self, plan, batch)  # type: ignore[arg-type]

    def noted(runner: ModelRunner, seed: int = 0) -> None:
        stripped_after.append(len(passes))
        strip(runner, seed)

    monkeypatch.setattr(ModelRunner, "_forward", counted)
    monkeypatch.setattr(engine_loop, "strip_pass", noted)
    out = tmp_path / "loop.json"
    engine_loop.main(_burst(out, tokenizer) + ["--null-pass", "--gc-young", "1234"])
    r = json.loads(out.read_text())
    assert r["null_pass"] and r["all_finished"] and r["finished"] == 30 and not r["errors"]
    assert r["swap_outs"] > 0 and r["free_blocks_after"] == r["num_blocks"]
    assert r["host_free_blocks_after"] == r["host_blocks"]
    # Passes ran to measure the cost model, none once the loop served.
    assert stripped_after and len(passes) == stripped_after[0] > 0
    assert r["gc_thresholds"][0] == 1234
