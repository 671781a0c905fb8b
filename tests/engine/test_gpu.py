"""The engine on CUDA with the Triton attention backend (skipped without CUDA).

Preemption transparency as `test_parity` checks it on CPU: our greedy tokens
on the GPU, in float32, equal Hugging Face's on the CPU, with one-shot
prefill, chunked prefill and recompute after preemption, for the Llama and
OPT shapes; and deterministic mode's batch invariance on CUDA, bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.runner import ModelRunner
from scheduler.plan import TokenLogprob
from tests.engine.helpers import drive, hf_greedy, load_hf, random_prompts
from tests.engine.test_batch_invariant import BS, GREEDY, SEEDED, _alone
from tests.engine.test_parity import NEW_TOKENS, _check

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("graph_max_batch,graph_max_tokens", [(0, 0), (8, 0), (8, 64)],
                         ids=["eager", "graphs", "mixed-graphs"])
@pytest.mark.parametrize(
    "fixture", ["tiny_llama_path", "tiny_llama3_rope_path", "tiny_opt_path", "tiny_opt350_path"]
)
def test_triton_runner_parity_on_cuda(
    fixture: str, graph_max_batch: int, graph_max_tokens: int, request: pytest.FixtureRequest
) -> None:
    """Greedy parity with Hugging Face op by op, with decode steps from
    graphs, and with mixed steps of up to 64 tokens from graphs too (the
    one-shot scenario's 130-token step falls back to op by op)."""
    path: Path = request.getfixturevalue(fixture)
    runner = ModelRunner(path, "float32", "cuda", num_blocks=96, block_size=4,
                         max_model_len=80, cuda_graph_max_batch=graph_max_batch,
                         cuda_graph_max_tokens=graph_max_tokens)
    assert runner.attn.name == "triton"  # the CUDA default
    prompts = random_prompts([5, 23, 41, 60, 1], seed=1)
    hf = load_hf(path)
    expected = {j: hf_greedy(hf, p, NEW_TOKENS) for j, p in prompts.items()}
    _check(runner, prompts, expected)
    if runner.graphs is not None:
        assert runner.graphs.num_runs > 0
    assert (runner.mixed_graphs is not None) == (graph_max_tokens > 0)
    if runner.mixed_graphs is not None:
        assert runner.mixed_graphs.num_runs > 0


@pytest.mark.parametrize("fixture,dtype", [
    ("tiny_llama_path", "bfloat16"), ("tiny_llama_path", "float32"),
    ("tiny_llama3_rope_path", "bfloat16"), ("tiny_opt_path", "bfloat16"),
    ("smollm2_path", "bfloat16"),
])
def test_deterministic_tokens_do_not_depend_on_the_batch_on_cuda(
    fixture: str, dtype: str, request: pytest.FixtureRequest
) -> None:
    """Deterministic mode on CUDA: the batch-invariant Triton GEMM and
    attention.  Each request's tokens, run with others in 24-token chunks and
    too few blocks (preemption, recompute part-way through prompts), op by
    op or from graph buckets, equal its tokens run alone op by op, bit for
    bit, greedy and seeded."""
    path: Path = request.getfixturevalue(fixture)
    eager, graphs = (ModelRunner(path, dtype, "cuda", num_blocks=96, block_size=BS,
                                 max_model_len=80, deterministic=True,
                                 cuda_graph_max_batch=size) for size in (0, 4))
    lengths = [5, 23, 41, 60, 1, 17, 33]
    prompts = (random_prompts(lengths, seed=1, vocab=20000) if fixture == "smollm2_path"
               else random_prompts(lengths, seed=1))
    for params in (GREEDY, SEEDED):
        alone = _alone(eager, prompts, params)
        for runner in (eager, graphs):
            together = drive(runner, prompts, params, num_blocks=20, block_size=BS,
                             max_model_len=80, max_batch_tokens=24)
            assert together.num_mid_generation_preemptions > 0
            assert together.num_mid_prompt_preemptions > 0
            assert together.tokens == alone, (params, runner.graphs is not None)
        assert _alone(graphs, prompts, params) == alone
    assert graphs.graphs is not None and graphs.graphs.num_runs > 0


def test_sampling_controls_and_drafts_give_the_cpu_tokens_on_cuda(
        tiny_llama_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the sampler and the verifier do on the device (allowed ids, bad
    words, `min_tokens`, penalties, logprobs, prompt logprobs; drafts
    verified, some refused) gives on CUDA, with graphs on, the greedy tokens
    and top logprob ids of the same requests on the CPU (float32), with and
    without preemption."""
    from engine.sampling_params import SamplingParams
    from tests.engine.test_speculative import SPEC, Oracle, _looping

    cpu = ModelRunner(tiny_llama_path, "float32", "cpu", num_blocks=96, block_size=4,
                      max_model_len=80, num_threads=1)
    gpu = ModelRunner(tiny_llama_path, "float32", "cuda", num_blocks=96, block_size=4,
                      max_model_len=80, cuda_graph_max_batch=8, cuda_graph_max_tokens=64)
    prompts = random_prompts([6, 21, 13, 30, 9, 17], seed=41)
    base = {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True}
    plain = drive(cpu, prompts, SamplingParams(**base), num_blocks=96, block_size=4,
                  max_model_len=80).tokens
    a, b, c, d = (plain[j] for j in list(prompts)[:4])
    controls = [
        {"allowed_token_ids": sorted(set(a)) + [1, 2, 3]},
        {"allowed_token_ids": [t for t in (11, 12, 13, 14) if t != b[0]][:3]},
        {"bad_words_token_ids": [[c[0]], [c[3], c[4]]]},
        {"min_tokens": 8, "ignore_eos": False, "repetition_penalty": 1.3,
         "bad_words_token_ids": [[d[4], d[5]]]},
        {"presence_penalty": 0.7, "frequency_penalty": 0.4, "logprobs": 3},
        {"logprobs": 2, "prompt_logprobs": 2},
    ]
    params = {j: SamplingParams(**(base | kw)) for j, kw in zip(prompts, controls)}
    for sched in ({"num_blocks": 96}, {"num_blocks": 14, "max_batch_tokens": 10,
                                       "max_model_len": 48}):
        want = drive(cpu, prompts, params, block_size=4, **sched)  # type: ignore[arg-type]
        got = drive(gpu, prompts, params, block_size=4, **sched)  # type: ignore[arg-type]
        assert got.tokens == want.tokens
        for kind in ("logprobs", "prompt_logprobs"):
            mine, theirs = getattr(got, kind), getattr(want, kind)
            assert mine.keys() == theirs.keys() and mine
            for j, lps in theirs.items():
                assert [_top(lp) for lp in mine[j]] == [_top(lp) for lp in lps], (kind, j)
                assert all(abs(x.logprob - y.logprob) < 1e-3
                           for x, y in zip(mine[j], lps) if x and y), (kind, j)
    assert gpu.graphs is not None and gpu.graphs.num_runs > 0

    # Drafts: an oracle proposes each job's future tokens (every third
    # proposal with a wrong one), so drafts are accepted and refused alike.
    looping = _looping(4, seed=31)
    greedy = {j: SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
              for j in looping}
    alone = drive(cpu, looping, greedy, num_blocks=64, block_size=4, max_model_len=80)
    oracle = Oracle({tuple(looping[j]): alone.tokens[j] for j in looping})
    monkeypatch.setattr("scheduler.speculation.NgramIndex.propose",
                        lambda self, tokens, limit: oracle.propose(tokens, limit))
    drafted = drive(gpu, looping, greedy, num_blocks=64, block_size=4, max_model_len=80,
                    speculative=SPEC)
    assert drafted.tokens == alone.tokens
    assert drafted.num_steps <= 0.6 * alone.num_steps


def _top(lp: TokenLogprob | None) -> list[int] | None:
    return None if lp is None else [t for t, _ in lp.top]
