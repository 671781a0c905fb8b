"""Pipeline parallelism on CPU (gloo): a model's layers split into two
stages (stage 0 in this process, stage 1 a Ray actor) gives the greedy
tokens of the whole model (float32) with recompute preemption and with
swapping through the object-store tier (each rank moving its slice of each
block); and the pieces: the split of the layers and of a batch into
micro-batches.  Two stages of two shards each: test_tp_pp.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.attention import SeqSpan
from engine.pipeline_parallel import PipelineStage, micro_batches
from engine.runner import ModelRunner
from engine.sampling_params import SamplingParams
from scheduler.plan import Plan, ScheduledChunk
from tests.engine.helpers import drive, random_prompts, split_runner
from tests.engine.test_survival_resume import resume_on_split_replica

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
KWARGS: dict[str, Any] = dict(dtype="float32", device="cpu", num_blocks=96, block_size=4,
                              max_model_len=80, num_threads=1)
SCHED: dict[str, Any] = dict(num_blocks=20, block_size=4, max_model_len=80,
                             max_batch_tokens=24)


def test_stages_take_consecutive_layers_the_first_one_more() -> None:
    assert [PipelineStage(s, 2).layers(5) for s in range(2)] == [range(0, 3), range(3, 5)]
    assert [PipelineStage(s, 3).layers(6) for s in range(3)] == [
        range(0, 2), range(2, 4), range(4, 6)]
    with pytest.raises(ValueError, match="pipeline_parallel_size 3 exceeds the model's 2 "
                                         "layers"):
        PipelineStage(0, 3).layers(2)


def test_micro_batches_are_whole_chunks_of_about_equal_tokens() -> None:
    spans = [SeqSpan(9, 1, [0]), SeqSpan(4, 1, [1]), SeqSpan(0, 6, [2, 3]),
             SeqSpan(0, 4, [4])]
    # Rows 0, 1 (decodes), 7 (the 6-token chunk's last), 11 (the last's),
    # then a prompt row 3 whose logprobs are owed.
    mbs = micro_batches(spans, [0, 1, 7, 11, 3], 2)
    assert [(mb.rows.start, mb.rows.stop) for mb in mbs] == [(0, 8), (8, 12)]
    assert [len(mb.spans) for mb in mbs] == [3, 1]
    assert (mbs[0].logits_rows, mbs[0].logits_places) == ([0, 1, 7, 3], [0, 1, 2, 4])
    assert (mbs[1].logits_rows, mbs[1].logits_places) == ([3], [3])
    assert len(micro_batches(spans[:1], [0], 4)) == 1


@pytest.fixture(scope="module", params=["tiny_llama_path", "tiny_opt_path"])
def model(request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="module")
def pp2(model: Path, ray_cluster: Any) -> Iterator[ModelRunner]:
    with split_runner(model, 1, 2, **KWARGS) as runner:
        assert runner.pp == PipelineStage(0, 2) and runner.model.num_layers == 1
        yield runner


@pytest.fixture(scope="module")
def whole(model: Path) -> ModelRunner:
    return ModelRunner(model, **KWARGS)


def test_two_stages_give_the_whole_models_logits(pp2: ModelRunner, whole: ModelRunner) -> None:
    prompts = random_prompts([9, 6, 1], seed=3)
    chunks = []
    block = 0
    for job_id, prompt in prompts.items():
        for runner in (pp2, whole):
            runner.add_request(job_id, GREEDY, prompt)
        blocks = list(range(block, block + 3))
        block += 3
        chunks.append(ScheduledChunk(job_id, prompt, 0, blocks, sample=True, output_index=0))
    try:
        got, want = pp2.logits(Plan(0, chunks)), whole.logits(Plan(0, chunks))
    finally:
        for job_id in prompts:
            pp2.remove_request(job_id)
            whole.remove_request(job_id)
    assert got.shape == want.shape == (3, whole.vocab_size)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert pp2.kv_block_bytes == whole.kv_block_bytes


def _close(got: list[Any], want: list[Any]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert (g is None) == (w is None)
        if g is not None:
            assert [t for t, _ in g.top] == [t for t, _ in w.top]
            assert g.logprob == pytest.approx(w.logprob, abs=1e-4)


def test_two_stages_greedy_with_recompute_preemption(pp2: ModelRunner,
                                                    whole: ModelRunner) -> None:
    prompts = random_prompts([5, 23, 41, 60, 1, 17], seed=1)
    scored = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2,
                            prompt_logprobs=2)
    params = {j: scored if i % 2 else GREEDY for i, j in enumerate(prompts)}
    got = drive(pp2, prompts, params, **SCHED)
    want = drive(whole, prompts, params, **SCHED)
    assert got.num_preemptions > 0
    assert got.tokens == want.tokens
    assert got.prompt_logprobs.keys() == want.prompt_logprobs.keys() != set()
    for job_id in prompts:
        _close(got.logprobs[job_id], want.logprobs[job_id])
        _close(got.prompt_logprobs.get(job_id, []), want.prompt_logprobs.get(job_id, []))


def swap_run(runner: ModelRunner, ranks: int, ray: Any) -> Any:
    """Greedy tokens with reactive swapping through one KV directory that
    every rank stores its slices in."""
    from kvstore.directory import KVDirectory
    from kvstore.tier import ObjectStoreTier

    prompts = random_prompts([5, 23, 41, 60, 1], seed=2)
    directory = KVDirectory.remote(ranks * 64)
    runner.set_kv_tier(ObjectStoreTier(directory))
    assert runner.shards is not None
    runner.shards.set_kv_tier(directory)  # type: ignore[attr-defined]
    try:
        got = drive(runner, prompts, GREEDY, swap_mode="reactive", host_kv_blocks=64, **SCHED)
        assert got.core is not None
        runner.execute(Plan(0, [], block_ops=got.core.swap.take_pending()))
    finally:
        runner.swapper = None
    stats = ray.get(directory.stats.remote())
    swap = got.core.swap
    assert swap.num_swap_out > 0 and swap.num_swap_in > 0
    assert swap.num_recompute_fallbacks == 0
    assert stats["bytes_in"] > 0
    return prompts, got.tokens


def test_logits_rows_come_back_in_the_batchs_order(pp2: ModelRunner,
                                                   whole: ModelRunner) -> None:
    # Two prompts prefilled in one step, one micro-batch each: the first
    # one's prompt-logprob rows follow the second one's sampled row in the
    # step's logits, so the last stage must put them back in that order.
    prompts = random_prompts([12, 12], seed=7)
    scored = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=2)
    plain = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    params = {"job0": scored, "job1": plain}
    sched = dict(SCHED, max_batch_tokens=64)
    got = drive(pp2, prompts, params, **sched)
    want = drive(whole, prompts, params, **sched)
    assert got.num_steps == 3  # both prompts in the first step
    assert got.tokens == want.tokens
    _close(got.prompt_logprobs["job0"], want.prompt_logprobs["job0"])


def test_two_stages_greedy_with_swapping(pp2: ModelRunner, whole: ModelRunner,
                                         ray_cluster: Any) -> None:
    prompts, got = swap_run(pp2, 2, ray_cluster)
    assert got == drive(whole, prompts, GREEDY, **SCHED).tokens


def test_two_stages_checkpoint_and_prefetch(pp2: ModelRunner, whole: ModelRunner,
                                            ray_cluster: Any) -> None:
    """ConServe's incremental checkpoints and prefetches, every rank copying
    its slice: offline jobs discarded for an online burst come back from
    their checkpoints with the tokens of the whole model's run."""
    from kvstore.directory import KVDirectory
    from kvstore.tier import LocalHostTier, ObjectStoreTier
    from tests.engine.test_checkpoint_resume import co_serve

    offline = {f"off{i}": p for i, p in
               enumerate(random_prompts([18, 25, 9, 30], seed=11).values())}
    online = {f"on{i}": p for i, p in enumerate(random_prompts([28, 20], seed=12).values())}
    whole.set_kv_tier(LocalHostTier(capacity_bytes=10**8))
    try:
        want, _ = co_serve(whole, offline, online, online_at=6)
    finally:
        whole.swapper = None
    directory = KVDirectory.remote(2 * 128)
    pp2.set_kv_tier(ObjectStoreTier(directory))
    assert pp2.shards is not None
    pp2.shards.set_kv_tier(directory)  # type: ignore[attr-defined]
    try:
        got, core = co_serve(pp2, offline, online, online_at=6)
    finally:
        pp2.swapper = None
    assert got == want
    assert core.swap.num_checkpoint_discards > 0 and core.swap.num_recompute_fallbacks == 0


def test_two_stages_resume_from_every_stages_checkpoints(pp2: ModelRunner,
                                                         whole: ModelRunner) -> None:
    resume_on_split_replica(pp2, whole)
