"""The step-inputs benchmark times the runner's own host work on plans the
runner accepts: each sequence's row, position and blocks as a served decode
would have them."""

from __future__ import annotations

import json
import random

import pytest
import torch

from bench.step_inputs import PARTS, decode_plan, main
from engine.runner import ModelRunner


def test_decode_plan_feeds_each_sequences_output_over_its_own_blocks():
    runner = ModelRunner("embedded:smollm2", "float32", "cpu", num_blocks=16, block_size=16,
                         max_model_len=64)
    blocks = list(range(16))[::-1]
    plan = decode_plan(runner, 3, 40, random.Random(0), blocks)
    prepared = runner._prepare(plan)
    assert prepared.positions == [39, 39, 39]
    assert prepared.logits_indices == [0, 1, 2]
    # Each fed token is the request's output, past its 39-token prompt: a decode.
    for chunk, state in prepared.sampled:
        assert len(state.prompt_token_ids) == 39 and state.output_token_ids == chunk.token_ids
    # Three blocks a sequence, none shared, in the order they were handed.
    tables = [list(s.block_table) for s in prepared.spans]
    assert tables == [[15, 14, 13], [12, 11, 10], [9, 8, 7]]
    md = runner._forward_batch(prepared).attn_metadata
    # Position 39 lies in each table's third block, at offset 7.
    assert md.slot_mapping.tolist() == [13 * 16 + 7, 10 * 16 + 7, 7 * 16 + 7]
    assert torch.equal(runner._forward_batch(prepared).input_ids,
                       torch.tensor([c.token_ids[0] for c in plan.chunks]))


def test_report_has_each_part_per_batch(tmp_path):
    out = tmp_path / "s.json"
    main(["--dtype", "float32", "--batches", "1,4", "--context", "40", "--reps", "3",
          "--warmup", "1", "--out", str(out)])
    doc = json.loads(out.read_text())
    assert [r["batch"] for r in doc["rows"]] == [1, 4]
    for row in doc["rows"]:
        assert all(row[k] > 0 for k in PARTS)
        assert abs(row["total_us"] - sum(row[k] for k in PARTS)) < 0.5
        assert abs(row["us_per_sequence"] - row["total_us"] / row["batch"]) < 0.05
    assert doc["context"] == 40 and doc["block_size"] == 16


def test_deterministic_runner_attends_the_plan_as_decodes():
    """In deterministic mode a prompt position takes the prefill operator;
    the plan's positions are outputs, so every row is a decode."""
    runner = ModelRunner("embedded:smollm2", "float32", "cpu", num_blocks=16, block_size=16,
                         max_model_len=64, deterministic=True)
    if type(runner.attn).__name__ != "CppAttentionBackend" or runner.attn.kernel is None:
        pytest.skip("no C++ attention operator on this machine")
    plan = decode_plan(runner, 3, 40, random.Random(0), list(range(16)))
    md = runner._forward_batch(runner._prepare(plan)).attn_metadata
    assert md.num_decodes == 3 and md.prefill_rows is None
    assert md.decode_context_lens.tolist() == [40, 40, 40]
