"""The lm_head's prepacked oneDNN linear against F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.models import prepacked

needs_onednn = pytest.mark.skipif(
    not prepacked.available(torch.float32, torch.device("cpu")),
    reason="this torch build has no oneDNN packed linear")


@needs_onednn
@pytest.mark.parametrize("rows", [1, 3, 64, 130])
def test_matches_f_linear(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 48, generator=gen)
    w = torch.randn(1000, 48, generator=gen)
    b = torch.randn(1000, generator=gen)
    lin = prepacked.PrepackedLinear()
    torch.testing.assert_close(lin(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lin(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)


@needs_onednn
def test_repacks_when_the_weight_changes() -> None:
    # Weights are loaded into the parameters after the model is built; a
    # packed copy of the old values must not outlive them.
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 32, generator=gen)
    w = torch.zeros(64, 32)
    lin = prepacked.PrepackedLinear()
    assert torch.count_nonzero(lin(x, w)) == 0
    w.copy_(torch.randn(64, 32, generator=gen))
    torch.testing.assert_close(lin(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
    other = torch.randn(64, 32, generator=gen)
    torch.testing.assert_close(lin(x, other), F.linear(x, other), rtol=1e-5, atol=1e-5)


def test_only_float32_cpu_is_packed() -> None:
    assert not prepacked.available(torch.bfloat16, torch.device("cpu"))
    assert not prepacked.available(torch.float32, torch.device("cuda"))


@needs_onednn
def test_model_logits_use_the_packed_head() -> None:
    from engine.runner import ModelRunner

    runner = ModelRunner("embedded:smollm2", dtype="float32", device="cpu",
                         num_blocks=8, block_size=16, max_model_len=64)
    model = runner.model
    assert isinstance(model.head_linear, prepacked.PrepackedLinear)
    hidden = torch.randn(5, model.config.hidden_size)
    head = model.embed if model.lm_head is None else model.lm_head
    torch.testing.assert_close(model.compute_logits(hidden), F.linear(hidden, head),
                               rtol=1e-4, atol=1e-4)
