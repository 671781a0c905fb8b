"""The step profile groups real op time of our engine (decode or prefill)."""

from __future__ import annotations

import json

from bench.step_profile import _group, main


def test_groups_name_the_ops():
    assert _group("aten::mm") == "matmul"
    assert _group("aten::index_select") == "kv gather / write"
    assert _group("preempt_serve::write_kv") == "kv gather / write"
    assert _group("aten::_scaled_dot_product_flash_attention_for_cpu") == "attention"
    # Every operator of ours that attends or multiplies, on vectors or tiles.
    for op in ("paged_decode", "paged_decode_tiles", "paged_prefill"):
        assert _group(f"preempt_serve::{op}") == "attention"
    for op in ("linear_bf16", "linear_bf16_codes", "linear_bf16_codes_silu_mul", "linear_f32",
               "linear_f32_codes"):
        assert _group(f"preempt_serve::{op}") == "matmul"
    assert _group("aten::silu") == "other"


def test_profile_of_a_small_step(tmp_path):
    out = tmp_path / "p.json"
    main(["--batch", "2", "--context", "32", "--steps", "1", "--out", str(out)])
    doc = json.loads(out.read_text())
    assert abs(sum(doc["share"].values()) - 1.0) < 0.01
    assert doc["share"]["matmul"] > 0.1  # a forward pass is mostly linear layers
    assert doc["meta"]["kind"] == "decode" and doc["meta"]["batch"] == 2


def test_profile_of_a_prefill(tmp_path):
    out = tmp_path / "p.json"
    main(["--prefill", "--context", "48", "--steps", "1", "--out", str(out)])
    doc = json.loads(out.read_text())
    assert doc["meta"]["kind"] == "prefill" and doc["meta"]["batch"] == 1
    assert abs(sum(doc["share"].values()) - 1.0) < 0.01
    assert doc["share"]["matmul"] > 0.1 and doc["share"]["attention"] > 0.0
