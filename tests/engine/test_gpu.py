"""The engine on CUDA with the Triton attention backend (skipped without CUDA).

Preemption transparency as `test_parity` checks it on CPU: our greedy tokens
on the GPU, in float32, equal Hugging Face's on the CPU, with one-shot
prefill, chunked prefill and recompute after preemption, for the Llama and
OPT shapes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.runner import ModelRunner
from tests.engine.helpers import hf_greedy, load_hf, random_prompts
from tests.engine.test_parity import NEW_TOKENS, _check

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("graph_max_batch", [0, 8], ids=["eager", "graphs"])
@pytest.mark.parametrize(
    "fixture", ["tiny_llama_path", "tiny_llama3_rope_path", "tiny_opt_path", "tiny_opt350_path"]
)
def test_triton_runner_parity_on_cuda(
    fixture: str, graph_max_batch: int, request: pytest.FixtureRequest
) -> None:
    path: Path = request.getfixturevalue(fixture)
    runner = ModelRunner(path, "float32", "cuda", num_blocks=96, block_size=4,
                         max_model_len=80, cuda_graph_max_batch=graph_max_batch)
    assert runner.attn.name == "triton"  # the CUDA default
    prompts = random_prompts([5, 23, 41, 60, 1], seed=1)
    hf = load_hf(path)
    expected = {j: hf_greedy(hf, p, NEW_TOKENS) for j, p in prompts.items()}
    _check(runner, prompts, expected)
    if runner.graphs is not None:
        assert runner.graphs.num_runs > 0
