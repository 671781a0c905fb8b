"""Tensor parallelism on CPU (gloo): a model split over two shards, one in
this process and one in a Ray actor, gives the greedy tokens of the whole
model (float32), with recompute preemption, with swapping through the
object-store tier (each shard moving its own slice of each block), with
passes cut between layers and resuming from every shard's checkpoints; and
the pieces it is made of."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.runner import ModelRunner
from engine.sampling_params import SamplingParams
from engine.shards import SwapsInFlight
from engine.tensor_parallel import TensorParallel, load_slice
from scheduler.plan import BlockOp, BlockOpKind, Plan
from tests.engine.helpers import drive, hf_greedy, load_hf, random_prompts, split_runner
from tests.engine.test_layer_preemption import run as run_with_cuts
from tests.engine.test_survival_resume import resume_on_split_replica


NEW = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
KWARGS: dict[str, Any] = dict(dtype="float32", device="cpu", num_blocks=96, block_size=4,
                              max_model_len=80, num_threads=1)


# Pieces ---------------------------------------------------------------------


def test_shards_split_evenly_or_say_why() -> None:
    tp = TensorParallel(1, 2)
    assert tp.split(8, "attention heads") == 4
    with pytest.raises(ValueError, match="tensor_parallel_size 3 does not divide the model's 4 "
                                         "attention heads"):
        TensorParallel(0, 3).split(4, "attention heads")
    with pytest.raises(ValueError, match="not a shard"):
        TensorParallel(2, 2)
    # The vocabulary is cut in equal slices, the last padded.
    assert TensorParallel(0, 3).vocab_part(10) == (0, 4)
    assert TensorParallel(2, 3).vocab_part(10) == (8, 4)


def test_load_slice_takes_the_shards_rows_and_pads_the_last() -> None:
    full = torch.arange(20.0).view(10, 2)
    dest = torch.empty(4, 2)
    assert torch.equal(load_slice(dest, full, 0, TensorParallel(1, 3)), full[4:8])
    last = load_slice(dest, full, 0, TensorParallel(2, 3))
    assert torch.equal(last[:2], full[8:10]) and torch.equal(last[2:], torch.zeros(2, 2))
    cols = load_slice(torch.empty(10, 1), full, 1, TensorParallel(1, 2))
    assert torch.equal(cols, full[:, 1:])


def test_a_swap_in_lands_when_every_shard_has_it() -> None:
    swaps = SwapsInFlight(2)
    swaps.issued([BlockOp(BlockOpKind.SWAP_IN, "a", 0, [3]), BlockOp(BlockOpKind.SWAP_IN, "b", 0, [4]),
                  BlockOp(BlockOpKind.PREFETCH, "c", 0, [5])])
    assert swaps.combine([(["a"], []), ([], [])]) == ([], [])
    assert swaps.pending == 3  # what the first shard waits for with nothing to run
    assert swaps.combine([(["b"], []), (["a", "b"], [])]) == (["a", "b"], [])
    # Lost on one shard: failed, and what lands elsewhere later is ignored.
    assert swaps.combine([(["c"], []), ([], ["c"])]) == ([], ["c"])
    assert swaps.combine([([], []), (["c"], [])]) == ([], [])
    swaps.issued([BlockOp(BlockOpKind.SWAP_IN, "d", 0, [6]), BlockOp(BlockOpKind.DROP, "d", 0, [])])
    assert swaps.combine([(["d"], []), (["d"], [])]) == ([], [])


# Two shards -----------------------------------------------------------------


@pytest.fixture(scope="module", params=["tiny_llama_path", "tiny_opt_path"])
def model(request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="module")
def tp2(model: Path, ray_cluster: Any) -> Iterator[ModelRunner]:
    """The first shard's runner of `model` over two shards."""
    with split_runner(model, 2, **KWARGS) as runner:
        assert runner.tp == TensorParallel(0, 2) and not runner.pp.enabled
        yield runner


@pytest.fixture(scope="module")
def whole(model: Path) -> ModelRunner:
    return ModelRunner(model, **KWARGS)


def test_each_shard_holds_half_of_the_model(tp2: ModelRunner, whole: ModelRunner) -> None:
    assert tp2.model.num_heads * 2 == whole.model.num_heads
    assert tp2.kv_cache.num_kv_heads * 2 == whole.kv_cache.num_kv_heads
    assert tp2.kv_block_bytes == whole.kv_block_bytes  # both shards together
    shard = sum(p.numel() for p in tp2.model.parameters())
    assert shard < 0.7 * sum(p.numel() for p in whole.model.parameters())


def test_two_shards_give_the_whole_models_logits(tp2: ModelRunner, whole: ModelRunner) -> None:
    from scheduler.plan import ScheduledChunk

    prompt = random_prompts([9], seed=3)["job0"]
    for runner in (tp2, whole):
        runner.add_request("p", GREEDY, prompt)
    try:
        plan = Plan(0, [ScheduledChunk("p", prompt, 0, list(range(3)), sample=True,
                                       output_index=0)])
        got, want = tp2.logits(plan), whole.logits(plan)
    finally:
        tp2.remove_request("p")
        whole.remove_request("p")
    assert got.shape == want.shape == (1, whole.vocab_size)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_the_length_head_reads_the_whole_models_state(tp2: ModelRunner,
                                                     whole: ModelRunner) -> None:
    """The driving shard's final hidden states are the whole model's: the
    length head gives the estimates the unsplit model gives."""
    import math

    from engine.length_head import LengthHead

    size = whole.config.hidden_size
    g = torch.Generator().manual_seed(4)
    head = LengthHead(torch.zeros(size), torch.ones(size), 0.05 * torch.randn(size, generator=g),
                      0.3, math.log(40.0), 400)
    prompts = random_prompts([5, 9, 23, 41], seed=6)
    got = {}
    for name, runner in (("tp2", tp2), ("whole", whole)):
        runner.length_head = head
        try:
            got[name] = drive(runner, prompts, GREEDY, num_blocks=40, block_size=4,
                              max_model_len=80, max_batch_tokens=20).head_estimates
        finally:
            runner.length_head = None
    assert got["tp2"].keys() == got["whole"].keys() == prompts.keys()
    for j in prompts:
        assert abs(got["tp2"][j] - got["whole"][j]) <= max(1, 0.01 * got["whole"][j]), j


def test_greedy_tokens_with_recompute_preemption(tp2: ModelRunner, whole: ModelRunner,
                                                 model: Path) -> None:
    prompts = random_prompts([5, 23, 41, 60, 1, 17], seed=1)
    # 20 blocks of 4 tokens for ~150 prompt tokens: jobs are preempted and recomputed.
    got = drive(tp2, prompts, GREEDY, num_blocks=20, block_size=4, max_model_len=80,
                max_batch_tokens=24)
    want = drive(whole, prompts, GREEDY, num_blocks=20, block_size=4, max_model_len=80,
                 max_batch_tokens=24)
    assert got.num_preemptions > 0
    assert got.tokens == want.tokens
    if "llama" in model.name:
        hf = load_hf(model)
        assert got.tokens == {j: hf_greedy(hf, p, NEW) for j, p in prompts.items()}


def test_greedy_tokens_with_swapping_through_the_object_store(
        tp2: ModelRunner, whole: ModelRunner, ray_cluster: Any) -> None:
    from kvstore.directory import KVDirectory
    from kvstore.tier import ObjectStoreTier

    prompts = random_prompts([5, 23, 41, 60, 1], seed=2)
    want = drive(whole, prompts, GREEDY, num_blocks=20, block_size=4, max_model_len=80,
                 max_batch_tokens=24)
    ray = ray_cluster
    directory = KVDirectory.remote(2 * 64)  # two slices of each block
    tp2.set_kv_tier(ObjectStoreTier(directory))
    group = tp2.shards
    assert group is not None
    group.set_kv_tier(directory)  # type: ignore[attr-defined]
    try:
        got = drive(tp2, prompts, GREEDY, num_blocks=20, block_size=4, max_model_len=80,
                    max_batch_tokens=24, swap_mode="reactive", host_kv_blocks=64)
        assert got.core is not None
        stats = ray.get(directory.stats.remote())
        tp2.execute(Plan(0, [], block_ops=got.core.swap.take_pending()))
    finally:
        tp2.swapper = None
    assert got.tokens == want.tokens
    swap = got.core.swap
    assert swap.num_swap_out > 0 and swap.num_swap_in > 0
    assert swap.num_recompute_fallbacks == 0
    # Each shard stored its own slice: half a block's bytes per entry.
    assert stats["block_bytes"] * 2 == tp2.kv_block_bytes


@pytest.mark.parametrize("cut", [{1}, {0, 4, 5}])
def test_a_pass_cut_between_layers_stops_every_shard(tp2: ModelRunner, whole: ModelRunner,
                                                     cut: set[int]) -> None:
    prompts = random_prompts([30, 7, 19, 3], seed=5)
    want, _ = run_with_cuts(whole, prompts, set())
    got, interrupted = run_with_cuts(tp2, prompts, cut)
    assert interrupted == len(cut)
    assert got == want



def test_a_job_resumes_from_every_shards_checkpoints(tp2: ModelRunner,
                                                     whole: ModelRunner) -> None:
    resume_on_split_replica(tp2, whole)
