"""Preemption transparency: our engine's greedy tokens equal the HF reference's.

Every scenario drives the real FCFS scheduler core: one-shot prefill,
chunked prefill (a tiny token budget), and a KV budget so small that jobs
are preempted mid-generation and recomputed.  Token for token, the outputs
must not change.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.models import prepacked
from engine.runner import ModelRunner
from engine.sampling_params import SamplingParams
from tests.engine.helpers import drive, hf_greedy, load_hf, random_prompts

NEW_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)

# (label, scheduler overrides); block_size 4 everywhere.
SCENARIOS = [
    ("one-shot", dict(num_blocks=96, max_batch_tokens=512)),
    ("chunked", dict(num_blocks=96, max_batch_tokens=16)),
    ("preempt", dict(num_blocks=20, max_batch_tokens=24)),
]


def _check(
    runner: ModelRunner, prompts: dict[str, list[int]], expected: dict[str, list[int]],
    scenarios: list[tuple[str, dict[str, int]]] = SCENARIOS,
) -> None:
    for label, overrides in scenarios:
        got = drive(runner, prompts, GREEDY, block_size=4, max_model_len=80, **overrides)
        for job_id in prompts:
            assert got.tokens[job_id] == expected[job_id], (label, job_id)
            assert got.finish[job_id] == "length"
            # Streamed deltas add up to the whole response, once, even for
            # jobs that were recomputed.
            assert got.text[job_id] == runner.tokenizer.decode(
                got.tokens[job_id], skip_special_tokens=True
            ), (label, job_id)
        if label == "preempt":
            assert got.num_preemptions > 0, "the tiny KV budget should force preemption"
            assert got.num_mid_generation_preemptions > 0
        else:
            assert got.num_preemptions == 0


def test_smollm2_parity(smollm2_runner: ModelRunner, smollm2_path: Path) -> None:
    tok = smollm2_runner.tokenizer
    texts = [
        "The capital of France is",
        "Write a short poem about the sea and the wind, in the style of a sailor's song:",
        "Question: A farmer has 17 sheep and all but 9 run away. How many sheep does the "
        "farmer have left? Think step by step before you answer. Answer:",
        "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number, computed iteratively "
        "so that it runs in linear time and constant memory.\"\"\"\n"
        "    if n < 2:\n        return n\n"
        "    a, b = 0, 1\n    for _ in range(",
    ]
    prompts = {f"job{i}": tok.encode(t, add_special_tokens=False) for i, t in enumerate(texts)}
    lengths = sorted(len(p) for p in prompts.values())
    assert lengths[0] <= 8 and lengths[-1] >= 40, lengths
    hf = load_hf(smollm2_path)
    expected = {j: hf_greedy(hf, p, NEW_TOKENS) for j, p in prompts.items()}
    _check(smollm2_runner, prompts, expected)


@pytest.mark.parametrize("pack", ["never", "always"])
@pytest.mark.parametrize(
    "fixture", ["tiny_llama_path", "tiny_llama3_rope_path", "tiny_opt_path", "tiny_opt350_path"]
)
def test_tiny_random_parity(fixture: str, pack: str, request: pytest.FixtureRequest) -> None:
    # Both matmuls of float32 projections, whichever this CPU's `auto` picks:
    # MKL on plain weights, oneDNN on packed ones (engine.models.prepacked).
    if pack == "always" and not prepacked.available(torch.float32, torch.device("cpu")):
        pytest.skip("this torch build has no oneDNN packed linear")
    path: Path = request.getfixturevalue(fixture)
    runner = ModelRunner(path, "float32", "cpu", num_blocks=96, block_size=4,
                         max_model_len=80, num_threads=1, pack_projections=pack)  # type: ignore[arg-type]
    assert runner.model.packed == (pack == "always")
    prompts = random_prompts([5, 23, 41, 60, 1], seed=1)
    hf = load_hf(path)
    expected = {j: hf_greedy(hf, p, NEW_TOKENS) for j, p in prompts.items()}
    _check(runner, prompts, expected)
