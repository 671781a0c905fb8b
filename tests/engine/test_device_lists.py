"""Host lists staged to the device without waiting for it
(engine/device_lists.py), and the paths that use them: a swap's block
copies, sampling (temperature, top-k, top-p, logit bias, allowed tokens and
bans), an op-by-op pass's inputs.  On CUDA each must return while a long
kernel queued before it still runs (the host keeps planning the next
iteration while a pass computes, scheduler/ahead.py); on a CPU the values
are checked."""

from __future__ import annotations

import time

import pytest
import torch

from engine.device_lists import index, on_device, staged
from engine.kv_cache import KVCache
from engine.sampling import Sampler, SampleRequest
from engine.sampling_params import SamplingParams


def test_values_and_dtypes_on_the_cpu() -> None:
    cpu = torch.device("cpu")
    assert torch.equal(index([3, 0, 2], cpu), torch.tensor([3, 0, 2]))
    t = on_device([0.5, 2.0], torch.float32, cpu)
    assert t.dtype is torch.float32 and t.tolist() == [0.5, 2.0]
    assert on_device([], torch.long, cpu).shape == (0,)
    assert torch.equal(staged(torch.arange(3), cpu), torch.arange(3))


def _kernel_seconds(cycles: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_nothing_here_waits_for_the_kernel_queued_before_it() -> None:
    dev = torch.device("cuda")
    cycles = 10_000_000
    while _kernel_seconds(cycles) < 0.2:  # a kernel of 0.2 s or more
        cycles *= 2
    cache = KVCache(2, 8, 4, 2, 16, torch.float32, dev)
    blocks = torch.randn(3, 2, 2, 4, 2, 16).pin_memory()
    logits = torch.randn(6, 50, device=dev)
    hot = [SampleRequest(SamplingParams(temperature=0.8, seed=7), 3),
           SampleRequest(SamplingParams(temperature=0.0), 3),
           SampleRequest(SamplingParams(temperature=0.7, top_p=0.9), 3),
           SampleRequest(SamplingParams(temperature=1.0, top_k=5, min_p=0.05), 3),
           SampleRequest(SamplingParams(temperature=0.0, logit_bias={7: 50.0}), 3),
           SampleRequest(SamplingParams(temperature=0.9, allowed_token_ids=[1, 2, 3]), 3,
                         banned_token_ids=(2,))]
    sampler = Sampler(seed=0, device=dev)
    sampler.sample_tensor(logits, hot)  # kernels built before the clock starts
    torch.cuda.synchronize()
    torch.cuda._sleep(cycles)
    t0 = time.perf_counter()
    staged = on_device([5, 6, 7], torch.long, dev)
    cache.write_blocks([1, 4, 6], blocks)
    read = cache.read_blocks([1, 4, 6])
    tokens = sampler.sample_tensor(logits, hot)
    queued_in = time.perf_counter() - t0
    torch.cuda.synchronize()
    assert queued_in < 0.1, f"the host waited {queued_in:.3f} s for the device"
    assert staged.tolist() == [5, 6, 7]
    assert torch.equal(read.cpu(), blocks)
    assert tokens.shape == (6,) and tokens[1] == logits[1].argmax()
    assert tokens[3] in logits[3].topk(5).indices
    assert tokens[4] == 7 and tokens[5] in (1, 3)
