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


@pytest.fixture
def tokenizer() -> Path:
    """SmolLM2's tokenizer folder (the embedded model's)."""
    from engine.model_source import ModelSourceError, resolve_model

    try:
        return resolve_model("embedded:smollm2")
    except ModelSourceError as e:
        pytest.skip(f"embedded SmolLM2 unavailable: {e}")


def _burst(out: Path, tokenizer: Path) -> list[str]:
    """30 requests on a tiny Llama shape, with too little device KV for them."""
    return [
        "--out", str(out), "--device", "cpu", "--dtype", "float32", "--layers", "2",
        "--hidden", "64", "--intermediate", "128", "--heads", "4", "--kv-heads", "2",
        "--tokenizer", str(tokenizer), "--requests", "30", "--prompt-len", "8,120",
        "--output-len", "4,24", "--kv-tokens", "512", "--host-kv-tokens", "4096",
        "--max-batch-size", "8", "--max-batch-tokens", "128", "--max-model-len", "256",
    ]


def test_serves_a_burst_to_completion_and_frees_every_block(
        tmp_path: Path, tokenizer: Path) -> None:
    out = tmp_path / "loop.json"
    engine_loop.main(_burst(out, tokenizer) + ["--sync-sites"])
    r = json.loads(out.read_text())
    assert r["all_finished"] and r["finished"] == 30 and not r["errors"]
    # Counted where a GPU would warn; a CPU never waits on a device.
    assert r["sync_sites"] == {"total": 0, "by_site": []} and r["syncs_per_iteration"] == 0
    # Too little device KV for the burst: jobs were swapped out and back.
    assert r["swap_outs"] > 0 and r["swap_ins"] > 0
    assert r["free_blocks_after"] == r["num_blocks"] == 32
    assert r["host_free_blocks_after"] == r["host_blocks"] == 256
    assert r["output_tokens"] > 0 and r["ttft_s"]["p50"] > 0


def test_the_null_pass_serves_the_burst_with_no_forward_pass(
        tmp_path: Path, tokenizer: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.runner import ModelRunner

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


def test_the_emulated_device_queues_passes_and_collect_waits_for_them() -> None:
    import time
    from types import SimpleNamespace

    from scheduler.cost import LinearCost
    from scheduler.plan import Plan, ScheduledChunk
    from studies.engine_gpu.null_pass import device_time, emulate_device

    cost = LinearCost(base_s=0.03, prefill_per_token_s=1e-4, decode_per_seq_s=0.01,
                      decode_base_s=0.02)
    decode = ScheduledChunk("a", [5], 9, [0], True, 1)
    prompt = ScheduledChunk("b", list(range(100)), 0, [0] * 7, True, 0)
    assert device_time(cost, Plan(0)) == 0.0
    assert device_time(cost, Plan(1, [decode])) == pytest.approx(0.02 + 0.01)
    assert device_time(cost, Plan(2, [decode, prompt])) == pytest.approx(0.03 + 0.01 + 0.01)
    collected: list[object] = []
    readies: list[object] = []
    tier = SimpleNamespace(offload=lambda job, indices, blocks, ready=None: readies.append(ready))
    runner = SimpleNamespace(launch=lambda plan: object(), collect=collected.append,
                             swapper=SimpleNamespace(tier=tier))
    busy = emulate_device(runner, cost)  # type: ignore[arg-type]
    t0 = time.perf_counter()
    first = runner.launch(Plan(1, [decode]))
    # A swap-out of the next plan, while the first pass is on the device.
    runner.swapper.tier.offload("a", [0], None)
    second = runner.launch(Plan(2, [decode, prompt]))
    assert busy == pytest.approx([0.03, 0.05])
    # Its copy is ready once the pass queued before it has ended.
    readies[0]()  # type: ignore[operator]
    assert time.perf_counter() - t0 >= 0.03
    runner.collect(first)
    assert time.perf_counter() - t0 >= 0.03
    # The second pass was queued behind the first: it ends 0.05 s after it.
    runner.collect(second)
    assert time.perf_counter() - t0 >= 0.08
    assert collected == [first, second]


def test_the_null_pass_on_an_emulated_device_plans_ahead(tmp_path: Path,
                                                        tokenizer: Path) -> None:
    out = tmp_path / "loop.json"
    engine_loop.main(_burst(out, tokenizer) + [
        "--null-pass", "--device-cost", "0.002,0.00001,0.0001,0.0015", "--ahead"])
    r = json.loads(out.read_text())
    assert r["emulated_device"] and r["all_finished"] and not r["errors"]
    assert r["cost_model"].startswith("LinearCost(base_s=0.002,")
    assert r["launched_ahead"] > 0 and r["free_blocks_after"] == r["num_blocks"]
    # One pass at a time on the device: never busier than the wall time.
    assert r["device_busy_s"] >= r["iterations"] * 0.0015 * 0.5
    assert 0 < r["device_utilization"] <= 1.0
    with pytest.raises(SystemExit):
        engine_loop.parse_args(["--out", "x", "--device-cost", "1,0,0,1"])
