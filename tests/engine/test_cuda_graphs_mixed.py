"""Mixed steps (prefill chunks beside decodes) from captured buckets
(engine/cuda_graphs_mixed.py).

On CUDA the buckets are captured graphs; without CUDA the same static
buffers, padding and launches run eagerly with the Triton kernels under
Triton's interpreter.  A step's logits must equal the same step run op by
op, whatever an earlier, larger step left in the buffers; greedy parity with
Hugging Face through chunked prefill and recompute is in
tests/engine/test_cuda_graphs.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.attention import SeqSpan
from engine.models import ForwardBatch
from engine.runner import ModelRunner

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BS = 4


def _runner(path: Path, max_tokens: int) -> ModelRunner:
    runner = ModelRunner(path, "float32", DEVICE, num_blocks=64, block_size=BS,
                         max_model_len=80, num_threads=1, attention_backend="triton",
                         cuda_graph_max_batch=4, cuda_graph_max_tokens=max_tokens)
    # Random K/V stand for the contexts the steps attend to.
    gen = torch.Generator().manual_seed(0)
    cache = runner.kv_cache.data
    cache.copy_(torch.randn(cache.shape, generator=gen).to(cache))
    return runner


def _step(spans: list[SeqSpan], seed: int) -> tuple[list[int], list[int], list[int]]:
    """Token ids, positions and logits rows (each span's last token)."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(s.num_tokens for s in spans)
    ids = torch.randint(3, 500, (total,), generator=gen).tolist()
    positions = [p for s in spans for p in range(s.start_pos, s.context_len)]
    rows, end = [], 0
    for s in spans:
        end += s.num_tokens
        rows.append(end - 1)
    return ids, positions, rows


def _eager(runner: ModelRunner, ids: list[int], positions: list[int], spans: list[SeqSpan],
           rows: list[int]) -> torch.Tensor:
    dev = runner.device
    batch = ForwardBatch(
        input_ids=torch.tensor(ids, device=dev), positions=torch.tensor(positions, device=dev),
        attn_metadata=runner.attn.build_metadata(spans),
        logits_indices=torch.tensor(rows, device=dev))
    with torch.inference_mode():
        return runner.model.compute_logits(runner.model(batch, runner.kv_cache))


def _tables(n: int, first: int) -> list[int]:
    return list(range(first, first + n))


# Under the interpreter the OPT shape only runs in the slow run.
_SLOW_ON_CPU = () if torch.cuda.is_available() else (pytest.mark.slow,)


@pytest.mark.parametrize("fixture", [
    "tiny_llama_path", pytest.param("tiny_opt_path", marks=_SLOW_ON_CPU)])
def test_a_mixed_step_from_a_bucket_equals_the_step_op_by_op(
    fixture: str, request: pytest.FixtureRequest
) -> None:
    runner = _runner(request.getfixturevalue(fixture), max_tokens=40)
    mixed = runner.mixed_graphs
    assert mixed is not None
    assert [b.tokens for b in mixed._buckets] == [16, 32, 40]
    # A larger step first (two decodes, a chunk continuing a 9-token
    # context, a fresh 20-token prompt: 39 tokens), then a smaller one
    # (one decode beside a 7-token chunk) that must not read the first
    # step's rows left in the buffers; then a prefill alone.
    steps = [
        [SeqSpan(30, 1, _tables(8, 0)), SeqSpan(12, 1, _tables(4, 8)),
         SeqSpan(9, 17, _tables(7, 12)), SeqSpan(0, 20, _tables(5, 19))],
        [SeqSpan(5, 1, _tables(2, 24)), SeqSpan(40, 7, _tables(12, 26))],
        [SeqSpan(0, 13, _tables(4, 40))],
    ]
    for seed, spans in enumerate(steps):
        ids, positions, rows = _step(spans, seed)
        assert mixed.bucket_for(len(ids)) == [40, 16, 16][seed]
        want = _eager(runner, ids, positions, spans, rows)
        got = mixed.run(ids, positions, spans, rows)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert mixed.num_runs == len(steps)


def test_mixed_graphs_reject_what_they_cannot_hold(tiny_llama_path: Path) -> None:
    runner = _runner(tiny_llama_path, max_tokens=16)
    mixed = runner.mixed_graphs
    assert mixed is not None and mixed.bucket_for(17) is None
    assert not mixed.fits(17, 2, 2) and not mixed.fits(8, 5, 5) and mixed.fits(16, 4, 4)
    spans = [SeqSpan(0, 17, _tables(5, 0))]
    with pytest.raises(ValueError, match="does not fit the captured buckets"):
        mixed.run(*_step(spans, 0)[:2], spans, [16])
    spans = [SeqSpan(79, 2, _tables(21, 0))]
    with pytest.raises(ValueError, match="exceeds the captured block tables"):
        mixed.run(*_step(spans, 0)[:2], spans, [1])


def test_deterministic_mode_runs_mixed_steps_op_by_op(tiny_llama_path: Path) -> None:
    runner = ModelRunner(tiny_llama_path, "float32", DEVICE, num_blocks=8, block_size=BS,
                         max_model_len=16, num_threads=1, attention_backend="triton",
                         deterministic=True, cuda_graph_max_batch=2, cuda_graph_max_tokens=8)
    assert runner.graphs is not None and runner.mixed_graphs is None
