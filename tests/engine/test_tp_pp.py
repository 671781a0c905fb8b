"""Two pipeline stages of two tensor-parallel shards each (four processes,
gloo, float32): the greedy tokens of the whole model with recompute
preemption and with swapping, every rank storing its slice of each block."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.runner import ModelRunner
from tests.engine.helpers import drive, random_prompts, split_runner
from tests.engine.test_pipeline_parallel import GREEDY, KWARGS, SCHED, swap_run


def test_two_stages_of_two_shards(tiny_llama_path: Path, ray_cluster: Any) -> None:
    whole = ModelRunner(tiny_llama_path, **KWARGS)
    with split_runner(tiny_llama_path, 2, 2, **KWARGS) as runner:
        assert runner.model.num_heads * 2 == whole.model.num_heads
        assert runner.model.num_layers == 1
        prompts = random_prompts([5, 23, 41, 60, 1, 17], seed=1)
        got = drive(runner, prompts, GREEDY, **SCHED)
        assert got.num_preemptions > 0
        assert got.tokens == drive(whole, prompts, GREEDY, **SCHED).tokens
        prompts, swapped = swap_run(runner, 4, ray_cluster)
    assert swapped == drive(whole, prompts, GREEDY, **SCHED).tokens
