"""A decoder layer as one C++ operator (engine/csrc/decode_layer.cpp,
`LlamaForCausalLM._one_op_layers`): on decode-only steps, and on steps with
prompt chunks that the prefill operator attends.

It calls the operators the op-by-op layer calls, in the same order, so each
step's hidden states and the K/V it writes must be the same bits as the
op-by-op forward of the same step.  In bfloat16 where the operators'
library has its AVX512-BF16 build (the packed bf16 projections it needs); in
float32 where it has the AVX2 FMA GEMMs (projections on float32 weights, and
SmolLM2's on its GGUF codes)."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from unittest.mock import patch

import pytest
import torch

from engine.attention import SeqSpan, get_attention_backend
from engine.models import packed_bf16, packed_f32
from engine.models.llama import LlamaForCausalLM
from engine.runner import ModelRunner
from engine.sampling_params import SamplingParams
from tests.engine.helpers import drive, random_prompts

needs_bf16 = pytest.mark.skipif(not packed_bf16.built(),
                                reason="no AVX512-BF16 build of the C++ operators here")
needs_f32 = pytest.mark.skipif(not packed_f32.built(),
                               reason="no AVX2 FMA build of the C++ operators here")

BS = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)


def _checked_forward(model: LlamaForCausalLM, seen: dict[str, int]) -> Any:
    """`model.forward`, which on every step that takes the one-operator layers
    also runs the op-by-op layers on the same cache as it was, and checks
    that both give the same hidden states and leave the same cache."""
    forward = model.forward

    def checked(batch: Any, kv_cache: Any, hidden: Any = None) -> torch.Tensor:
        t = batch.input_ids.shape[0]
        args = model._layer_args(batch, t)
        if args is None:
            seen["op_by_op"] += 1
            return forward(batch, kv_cache, hidden)
        op, step, last = args
        if len(last) == 2:  # prefill_layer_*: (tiles, num_decodes)
            kind = "rows" if step[8] is not None else "mixed" if last[1] else "prefill"
            seen[kind] = seen.get(kind, 0) + 1
        before = kv_cache.data.clone()
        out = forward(batch, kv_cache, hidden)
        after = kv_cache.data.clone()
        kv_cache.data.copy_(before)
        with patch.object(model, "_layer_args", lambda b, n: None):
            ref = forward(batch, kv_cache, hidden)
        assert torch.equal(out, ref)
        assert torch.equal(kv_cache.data, after)
        seen["fused"] += 1
        return out

    return checked


BF16 = ("bfloat16", "bf16_dot")
F32 = ("float32", "f32_fma")


@pytest.mark.parametrize("kind,model_fixture,deterministic", [
    pytest.param(BF16, "tiny_llama_path", False, marks=needs_bf16),
    # Heads of 32: deterministic mode's prompts on the prefill operator.
    pytest.param(BF16, "tiny_llama_d32_path", True, marks=needs_bf16),
    # Heads of 16, whose prompts deterministic mode gives the decode operator
    # (every step is then decodes only to the layers).
    pytest.param(BF16, "tiny_llama_path", True, marks=needs_bf16),
    # Biases on q, k, v and o, tied embeddings, a head dim of 16, llama3 RoPE.
    pytest.param(BF16, "tiny_llama3_rope_path", False, marks=needs_bf16),
    pytest.param(F32, "tiny_llama_path", False, marks=needs_f32),
    pytest.param(F32, "tiny_llama_path", True, marks=needs_f32),
    pytest.param(F32, "tiny_llama3_rope_path", False, marks=needs_f32),
    # Every projection on its 4-bit codes: the C++ layer picks each
    # projection's GEMM by its packing, as the op-by-op linear does.
    pytest.param(F32, "smollm2_path", True, marks=needs_f32),
])
def test_one_operator_layers_give_the_op_by_op_bits(
    kind: tuple[str, str], model_fixture: str, deterministic: bool,
    request: pytest.FixtureRequest
) -> None:
    dtype, packing = kind
    path: Path = request.getfixturevalue(model_fixture)
    runner = ModelRunner(path, dtype, "cpu", num_blocks=64, block_size=BS,
                         max_model_len=64, num_threads=1, attention_backend="cpp",
                         deterministic=deterministic, pack_projections=packing)
    model = runner.model
    assert isinstance(model, LlamaForCausalLM) and model.packing == packing
    assert ("q4" in model.weight_codes()) == (model_fixture == "smollm2_path")
    seen = {"fused": 0, "op_by_op": 0}
    model.forward = _checked_forward(model, seen)  # type: ignore[method-assign]
    prompts = random_prompts([5, 11, 3, 8], seed=2)
    result = drive(runner, prompts, GREEDY, num_blocks=64, block_size=BS, max_model_len=64,
                   max_batch_tokens=64)
    assert all(len(t) == GREEDY.max_tokens for t in result.tokens.values())
    # Every step in one operator a layer, but for prompts that the reference
    # attention takes (no prefill operator for these heads, outside
    # deterministic mode, which gives them the decode operator).
    reference_prompts = runner.attn.prefill_kernel is None and not deterministic
    assert (seen["op_by_op"] > 0) == reference_prompts
    assert seen["fused"] >= GREEDY.max_tokens - 1 + (0 if reference_prompts else 1)
    # The prompts together in one step of prompt rows only.
    assert (seen.get("prefill", 0) > 0) == (runner.attn.prefill_kernel is not None)


@pytest.mark.parametrize("kind", [pytest.param(BF16, marks=needs_bf16),
                                  pytest.param(F32, marks=needs_f32)])
@pytest.mark.parametrize("deterministic", [False, True])
def test_prompt_chunks_beside_decodes_and_recomputes_give_the_op_by_op_bits(
    kind: tuple[str, str], deterministic: bool, tiny_llama_d32_path: Path
) -> None:
    """Heads of 32, which the prefill operator takes: prompts cut into
    chunks of 6 tokens beside other jobs' decodes, and too few blocks, so
    that jobs are preempted and recomputed (in deterministic mode a
    recompute's generated positions go to the decode operator beside its
    prompt's rows)."""
    dtype, packing = kind
    runner = ModelRunner(tiny_llama_d32_path, dtype, "cpu", num_blocks=64, block_size=BS,
                         max_model_len=64, num_threads=1, attention_backend="cpp",
                         deterministic=deterministic, pack_projections=packing)
    if runner.attn.prefill_kernel is None:
        pytest.skip("no vector build of the prefill operator here")
    model = runner.model
    seen = {"fused": 0, "op_by_op": 0}
    model.forward = _checked_forward(model, seen)  # type: ignore[method-assign]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = random_prompts([5, 17, 3, 13, 9], seed=4)
    result = drive(runner, prompts, params, num_blocks=10, block_size=BS, max_model_len=32,
                   max_batch_tokens=6)
    assert result.num_mid_generation_preemptions > 0
    assert all(len(t) == params.max_tokens for t in result.tokens.values())
    assert seen["op_by_op"] == 0
    # Chunks beside decodes: split by their order, or by rows in deterministic mode.
    assert seen.get("rows" if deterministic else "mixed", 0) > 0
    # The same tokens as the layers op by op.
    with patch.object(model, "_layer_args", lambda b, n: None):
        ref = drive(runner, prompts, params, num_blocks=10, block_size=BS, max_model_len=32,
                    max_batch_tokens=6)
    assert ref.tokens == result.tokens


@needs_bf16
def test_unpacked_projections_take_the_op_by_op_layers(tiny_llama_path: Path) -> None:
    runner = ModelRunner(tiny_llama_path, "bfloat16", "cpu", num_blocks=64, block_size=BS,
                         max_model_len=64, num_threads=1, attention_backend="cpp",
                         pack_projections="never")
    assert runner.model.packing == "none"
    seen = {"fused": 0, "op_by_op": 0}
    runner.model.forward = _checked_forward(runner.model, seen)  # type: ignore[method-assign]
    drive(runner, random_prompts([6, 4], seed=3), GREEDY, num_blocks=64, block_size=BS,
          max_model_len=64)
    assert seen["fused"] == 0 and seen["op_by_op"] > 0


@needs_bf16
def test_the_backend_offers_only_decode_only_steps() -> None:
    cls = get_attention_backend("cpp")
    backend = cls(4, 2, 16, BS, torch.device("cpu"), dtype=torch.bfloat16)
    decodes = [SeqSpan(6, 1, [0, 1]), SeqSpan(2, 1, [2])]
    md = backend.build_metadata(decodes)
    got = backend.decode_layer_step(md, 2)
    assert got is not None
    step, tiles = got
    assert tiles == (backend.kv_layout == "tiles")
    slots, block_ids, starts, lens = step
    assert slots.tolist() == [1 * BS + 2, 2 * BS + 2]
    assert block_ids.tolist() == [0, 1, 2] and starts.tolist() == [0, 2]
    assert lens.tolist() == [7, 3]
    # A prefill chunk in the step, or a token count that is not the decodes'.
    mixed = backend.build_metadata([SeqSpan(6, 1, [0, 1]), SeqSpan(0, 3, [2])])
    assert backend.decode_layer_step(mixed, 4) is None
    assert backend.decode_layer_step(md, 3) is None
    # The reference backend never offers it.
    torch_backend = get_attention_backend("torch")(4, 2, 16, BS, torch.device("cpu"))
    assert torch_backend.decode_layer_step(torch_backend.build_metadata(decodes), 2) is None
