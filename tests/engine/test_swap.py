"""KV block ops through a host tier: copies, and transparency of swapping."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from engine.kv_cache import KVCache
from engine.runner import ModelRunner
from engine.sampling_params import SamplingParams
from engine.swapper import BlockSwapper
from kvstore.tier import LocalHostTier
from scheduler.plan import BlockOp, BlockOpKind, Plan
from tests.engine.helpers import drive, hf_greedy, load_hf, random_prompts


def test_engine_and_local_tier_import_without_ray() -> None:
    # The engine owns `HostKVTier` and kvstore.tier implements it; neither
    # may pull Ray in, as the GPU test machines have none.
    code = "import sys, engine.runner, kvstore.tier; sys.exit('ray' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_read_write_blocks_roundtrip() -> None:
    cache = KVCache(3, 8, 4, 2, 5, torch.float32, "cpu")
    cache.data.copy_(torch.randn_like(cache.data))
    got = cache.read_blocks([6, 1])
    assert got.shape == (2, 3, 2, 4, 2, 5)
    assert torch.equal(got[0, 2, 1], cache.value(2)[6])
    cache.write_blocks([0, 3], got)
    assert torch.equal(cache.key(1)[0], cache.key(1)[6])
    assert torch.equal(cache.value(0)[3], cache.value(0)[1])


def _swapped_out(dtype: torch.dtype, device: str
                 ) -> tuple[KVCache, torch.Tensor, LocalHostTier, BlockSwapper]:
    """A random cache whose blocks 2 and 5 (job "j"'s blocks 0 and 1) were
    just swapped out; with a host copy of them as they were."""
    cache = KVCache(2, 8, 4, 2, 3, dtype, device)
    cache.data.copy_(torch.randn_like(cache.data))
    before = cache.read_blocks([2, 5]).cpu()
    tier = LocalHostTier(capacity_bytes=10**6)
    sw = BlockSwapper(cache, tier)
    sw.apply([BlockOp(BlockOpKind.SWAP_OUT, "j", 0, [2, 5])])
    return cache, before, tier, sw


def test_swapper_moves_blocks_and_reports_landing() -> None:
    cache, before, tier, sw = _swapped_out(torch.bfloat16, "cpu")
    cache.data.zero_()  # the freed blocks get overwritten by others
    sw.apply([BlockOp(BlockOpKind.SWAP_IN, "j", 0, [7]), BlockOp(BlockOpKind.SWAP_IN, "j", 1, [0])])
    done: list[str] = []
    deadline = time.monotonic() + 5
    while not done and time.monotonic() < deadline:
        done, failed = sw.poll(wait_s=0.05)
        assert not failed
    assert done == ["j"] and sw.num_in_flight == 0
    assert torch.equal(cache.read_blocks([7, 0]), before)
    # Unknown host copy: the fetch fails and says so.
    sw.apply([BlockOp(BlockOpKind.DROP, "j", 0, []), BlockOp(BlockOpKind.SWAP_IN, "j", 0, [1])])
    deadline = time.monotonic() + 5
    failed = []
    while not failed and time.monotonic() < deadline:
        _, failed = sw.poll(wait_s=0.05)
    assert failed == ["j"]


def test_drop_abandons_a_fetch_in_flight() -> None:
    cache = KVCache(2, 8, 4, 2, 3, torch.float32, "cpu")
    cache.data.copy_(torch.randn_like(cache.data))
    tier = LocalHostTier(capacity_bytes=10**6)
    sw = BlockSwapper(cache, tier)
    sw.apply([BlockOp(BlockOpKind.SWAP_OUT, "j", 0, [3])])
    sw.apply([BlockOp(BlockOpKind.SWAP_IN, "j", 0, [5])])
    # Aborted before the copy landed: block 5 may already be someone else's.
    sw.apply([BlockOp(BlockOpKind.DROP, "j", 0, [])])
    snapshot = cache.data.clone()
    tier.flush()
    assert sw.poll(wait_s=0.05) == ([], [])
    assert sw.num_in_flight == 0
    assert torch.equal(cache.data, snapshot)


NEW = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def swap_runner(tiny_llama_path: Path) -> ModelRunner:
    return ModelRunner(tiny_llama_path, "float32", "cpu", num_blocks=96, block_size=4,
                       max_model_len=80, num_threads=1)


@pytest.mark.parametrize("host_bytes", [10**8, 1], ids=["host-fits", "host-refuses"])
def test_swapping_is_transparent(
    swap_runner: ModelRunner, tiny_llama_path: Path, host_bytes: int
) -> None:
    prompts = random_prompts([5, 23, 41, 60, 1], seed=1)
    hf = load_hf(tiny_llama_path)
    expected = {j: hf_greedy(hf, p, NEW) for j, p in prompts.items()}
    tier = LocalHostTier(capacity_bytes=host_bytes)
    swap_runner.set_kv_tier(tier)
    try:
        got = drive(swap_runner, prompts, GREEDY, num_blocks=20, block_size=4, max_model_len=80,
                    max_batch_tokens=24, swap_mode="reactive", host_kv_blocks=64)
        assert got.core is not None
        # Host copies of the last jobs to finish: their DROPs wait for the
        # next plan, which a drained scheduler never makes.
        swap_runner.execute(Plan(0, [], block_ops=got.core.swap.take_pending()))
    finally:
        swap_runner.swapper = None
    assert got.tokens == expected
    swap = got.core.swap
    assert swap.num_swap_out > 0 and swap.num_swap_in > 0
    if host_bytes > 1:
        assert swap.num_recompute_fallbacks == 0 and tier.stats.fetches > 0
    else:
        # Every offload was refused: every swap-in fails over to recompute.
        assert swap.num_recompute_fallbacks > 0 and tier.stats.offload_failures > 0
    for j, p in prompts.items():
        assert got.text[j] == swap_runner.tokenizer.decode(got.tokens[j])
    tier.flush()
    assert tier.used == 0


def test_block_ops_without_tier_and_profiler_probe(swap_runner: ModelRunner) -> None:
    # DROP needs no tier; the others do.
    swap_runner.execute(Plan(1, [], block_ops=[BlockOp(BlockOpKind.DROP, "x", 0, [])]))
    # The start-up profiler times a swap round trip with an unregistered job.
    swap_runner.set_kv_tier(LocalHostTier(capacity_bytes=10**7))
    try:
        out = [BlockOp(BlockOpKind.SWAP_OUT, "probe", 0, [0, 1, 2])]
        inn = [BlockOp(BlockOpKind.SWAP_IN, "probe", 0, [0, 1, 2])]
        swap_runner.execute(Plan(2, [], block_ops=out))
        res = swap_runner.execute(Plan(3, [], block_ops=inn))
        assert res.swaps_in_done == ["probe"]
    finally:
        swap_runner.swapper = None
    assert swap_runner.kv_block_bytes == swap_runner.kv_cache.bytes_per_block


def _land(sw: BlockSwapper) -> list[str]:
    done: list[str] = []
    deadline = time.monotonic() + 5
    while not done and time.monotonic() < deadline:
        done, failed = sw.poll(wait_s=0.05)
        assert not failed
    return done


def test_checkpoints_accumulate_and_prefetch_keeps_them() -> None:
    """Blocks checkpointed over two iterations come back together; a
    prefetch leaves the checkpoint on the host, so it can be restored
    again; DROP forgets it."""
    cache = KVCache(2, 8, 4, 2, 3, torch.float32, "cpu")
    cache.data.copy_(torch.randn_like(cache.data))
    before = cache.read_blocks([2, 5, 6]).clone()
    tier = LocalHostTier(capacity_bytes=10**6)
    sw = BlockSwapper(cache, tier)
    sw.apply([BlockOp(BlockOpKind.CHECKPOINT, "j", 0, [2])])
    sw.apply([BlockOp(BlockOpKind.CHECKPOINT, "j", 1, [5]), BlockOp(BlockOpKind.CHECKPOINT, "j", 2, [6])])
    for target in ([0, 1, 3], [7, 4, 1]):
        cache.data.zero_()
        sw.apply([BlockOp(BlockOpKind.PREFETCH, "j", 0, list(target))])
        assert _land(sw) == ["j"]
        assert torch.equal(cache.read_blocks(target), before)
        tier.flush()
        assert tier.used == before.numel() * before.element_size()
    sw.apply([BlockOp(BlockOpKind.DROP, "j", 0, [])])
    tier.flush()
    assert tier.used == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_checkpoints_on_a_side_stream_hold_the_blocks_as_they_were() -> None:
    """On a GPU a checkpoint is copied on a side stream while the compute
    stream goes on; the next plan's work waits for it, so overwriting the
    blocks after the next `apply` cannot change the copy."""
    cache = KVCache(2, 8, 4, 2, 3, torch.float32, "cuda")
    cache.data.copy_(torch.randn_like(cache.data))
    before = cache.read_blocks([2, 5]).cpu()
    tier = LocalHostTier(capacity_bytes=10**6)
    sw = BlockSwapper(cache, tier)
    assert sw._side is not None
    sw.apply([BlockOp(BlockOpKind.CHECKPOINT, "j", 0, [2]), BlockOp(BlockOpKind.CHECKPOINT, "j", 1, [5])])
    # The next pass, block ops or not (the runner calls this before each):
    # its work is ordered after the copy.
    sw.order_after_copies()
    cache.data.zero_()
    sw.apply([BlockOp(BlockOpKind.PREFETCH, "j", 0, [0]), BlockOp(BlockOpKind.PREFETCH, "j", 1, [1])])
    assert _land(sw) == ["j"]
    assert torch.equal(cache.read_blocks([0, 1]).cpu(), before)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_swaps_on_a_gpu_go_through_pinned_memory_without_waiting() -> None:
    """On a GPU a swap-out is copied on the side stream and this plan's
    work waits for it on the device: blocks overwritten right after `apply`
    (a chunk of the same plan handed them) leave the copy as the blocks
    were.  The swap-in lands in pinned memory and is written back."""
    cache, before, tier, sw = _swapped_out(torch.float32, "cuda")
    cache.data.zero_()  # queued on the compute stream, after the copy
    tier.flush()
    assert tier.fetch("j", [0, 1], pinned=True).result().is_pinned()
    sw.apply([BlockOp(BlockOpKind.SWAP_IN, "j", 0, [6]), BlockOp(BlockOpKind.SWAP_IN, "j", 1, [1])])
    assert _land(sw) == ["j"]
    assert torch.equal(cache.read_blocks([6, 1]).cpu(), before)
    assert not sw._copies  # nothing left for the next plan to wait for


def test_every_pass_waits_for_the_last_plans_checkpoint_copies(tiny_llama_path: Path) -> None:
    """A plan without block ops may reuse blocks whose checkpoint copy the
    last plan started: the runner orders every pass after those copies,
    not only passes whose plan has block ops of its own."""
    runner = ModelRunner(tiny_llama_path, "float32", "cpu", num_blocks=32, block_size=4,
                         max_model_len=64, num_threads=1)
    runner.set_kv_tier(LocalHostTier(capacity_bytes=10**7))
    assert runner.swapper is not None
    calls: list[int] = []
    passes: list[int] = []
    order, execute = runner.swapper.order_after_copies, runner.execute
    runner.swapper.order_after_copies = lambda: (calls.append(1), order())[1]  # type: ignore[method-assign]
    runner.execute = lambda plan: (passes.append(len(plan.block_ops)), execute(plan))[1]  # type: ignore[method-assign]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    drive(runner, random_prompts([5, 9], seed=0), params, num_blocks=32, block_size=4,
          max_model_len=64)
    assert passes and not any(passes)  # no plan had block ops
    assert len(calls) == len(passes)


def test_no_side_stream_on_a_cpu() -> None:
    cache = KVCache(1, 4, 4, 1, 2, torch.float32, "cpu")
    assert BlockSwapper(cache, LocalHostTier(capacity_bytes=10**4))._side is None
