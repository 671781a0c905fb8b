"""`bench.gpu_step` end to end on a tiny Llama shape on CPU (the torch backend,
deterministic mode's Triton kernels under the interpreter, and HF), so that
the GPU benchmark keeps running between GPU sessions."""

from __future__ import annotations

import json
from pathlib import Path

from bench import gpu_step


def test_writes_every_section_and_a_plot(tmp_path: Path) -> None:
    out = tmp_path / "step.json"
    gpu_step.main([
        "--out", str(out), "--device", "cpu", "--dtype", "float32", "--layers", "2",
        "--hidden", "64", "--intermediate", "128", "--heads", "4", "--kv-heads", "2",
        "--vocab", "500", "--batches", "1,3", "--context", "20", "--steps", "2",
        "--warmup", "1", "--prefill-lens", "16", "--backends", "torch,triton-det,triton-det32",
        "--ceiling-bytes", "1000000",
    ])
    result = json.loads(out.read_text())
    assert result["shape"]["kv_heads"] == 2 and result["ceilings"]["copy_bytes_per_s"] > 0
    ours = [r for r in result["decode"] if r["backend"] == "torch"]
    assert [r["batch"] for r in ours] == [1, 3]
    for r in ours:
        assert r["step_s"] > 0 and r["floor_s"] > 0
        assert r["fraction_of_floor"] == r["floor_s"] / r["step_s"]
    assert [r["batch"] for r in result["decode"] if r["backend"] == "hf-sdpa"] == [1, 3]
    # Deterministic mode, op by op and from its graph buckets.
    # Deterministic mode, op by op and from its graph buckets, with query
    # tiles of 16 and of 32 rows.
    for backend in ("triton-det", "triton-det+graphs", "triton-det32", "triton-det32+graphs"):
        assert [r["batch"] for r in result["decode"] if r["backend"] == backend] == [1, 3]
    assert {r["backend"] for r in result["prefill"]} == {
        "torch", "triton-det", "triton-det32", "hf-sdpa"}
    assert [r["batch"] for r in result["attention"]] == [1, 3, 1, 3, 1, 3]
    # Weights read by a decode: everything but the (untied) embedding.
    assert result["weight_bytes_read_by_decode"] > 0
    assert out.with_suffix(".png").stat().st_size > 0
