"""Decode steps and mixed steps from captured buckets (engine/cuda_graphs.py,
engine/cuda_graphs_mixed.py).

On CUDA the buckets are captured graphs; without CUDA the same static
buffers, padding and bucket choice run eagerly with the Triton kernels
under Triton's interpreter.  Either way greedy tokens must equal Hugging
Face's through one-shot prefill, chunked prefill and recompute after
preemption, with steps of more decodes (or tokens) than the largest bucket
falling back to the ordinary forward pass.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.attention import SeqSpan
from engine.runner import ModelRunner
from tests.engine.helpers import hf_greedy, load_hf, random_prompts
from tests.engine.test_parity import NEW_TOKENS, SCENARIOS, _check

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


# Under the interpreter a run of the three scenarios takes ~35 s: there the
# default run keeps the preemption scenario (chunked prefill, recompute and
# decode steps of every size) and the OPT shape only runs in the slow run.
_SLOW_ON_CPU = () if torch.cuda.is_available() else (pytest.mark.slow,)
_SCENARIOS = SCENARIOS if torch.cuda.is_available() else [s for s in SCENARIOS
                                                          if s[0] == "preempt"]


@pytest.mark.parametrize("fixture", [
    "tiny_llama_path", pytest.param("tiny_opt_path", marks=_SLOW_ON_CPU)])
def test_graph_buckets_keep_greedy_parity(fixture: str, request: pytest.FixtureRequest) -> None:
    path: Path = request.getfixturevalue(fixture)
    runner = ModelRunner(path, "float32", DEVICE, num_blocks=96, block_size=4, max_model_len=80,
                         num_threads=1, attention_backend="triton", cuda_graph_max_batch=3,
                         cuda_graph_max_tokens=24)
    graphs, mixed = runner.graphs, runner.mixed_graphs
    assert graphs is not None and mixed is not None
    assert [b.size for b in graphs._buckets] == [1, 2, 3]
    assert [b.tokens for b in mixed._buckets] == [16, 24]
    # Without CUDA (the interpreter), fewer and shorter prompts.
    prompts = random_prompts([5, 23, 41, 60, 1] if torch.cuda.is_available() else [5, 41, 60, 1],
                             seed=1)
    hf = load_hf(path)
    expected = {j: hf_greedy(hf, p, NEW_TOKENS) for j, p in prompts.items()}
    _check(runner, prompts, expected, _SCENARIOS)
    assert graphs.num_runs > 0 and mixed.num_runs > 0


def test_graphs_reject_what_they_cannot_hold(tiny_llama_path: Path) -> None:
    runner = ModelRunner(tiny_llama_path, "float32", DEVICE, num_blocks=8, block_size=4,
                         max_model_len=16, num_threads=1, attention_backend="triton",
                         cuda_graph_max_batch=2)
    graphs = runner.graphs
    assert graphs is not None and graphs.bucket_for(3) is None and graphs.bucket_for(2) == 2
    with pytest.raises(ValueError, match="do not fit"):
        graphs.run([5, 6, 7], [SeqSpan(3, 1, [0])] * 3)
    with pytest.raises(ValueError, match="exceeds the captured block tables"):
        graphs.run([5], [SeqSpan(16, 1, [0, 1, 2, 3, 4])])


def test_graphs_need_the_triton_backend(tiny_llama_path: Path) -> None:
    with pytest.raises(ValueError, match="CUDA graphs need the 'triton' attention backend"):
        ModelRunner(tiny_llama_path, "float32", "cpu", num_blocks=8, block_size=4,
                    max_model_len=16, num_threads=1, attention_backend="torch",
                    cuda_graph_max_batch=2)
