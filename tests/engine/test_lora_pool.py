"""Runtime LoRA adapters (engine/lora_pool.py): read from their folder when
a request first names them, at most `max_lora_loaded` kept, a newer version
of a name replacing the older, and a running request keeping its adapter
whatever the pool drops."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.lora import AdapterError
from engine.runner import ModelRunner
from engine.sampling_params import SamplingParams
from tests.engine.helpers import drive, random_prompts
from tests.engine.test_lora import LLAMA_ALL, make_adapter, peft_greedy

pytest.importorskip("peft")


@pytest.fixture(scope="module")
def folders(tiny_llama_path: Path, tmp_path_factory: pytest.TempPathFactory
            ) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("runtime-lora")
    return {"a": make_adapter(tiny_llama_path, root / "a", LLAMA_ALL, seed=11),
            "b": make_adapter(tiny_llama_path, root / "b", ["q_proj", "v_proj"], r=4,
                              seed=12)}


def _params(name: str | None, folder: Path | None, n: int, at: float = 1.0
            ) -> SamplingParams:
    return SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n, adapter=name,
                          adapter_path=None if folder is None else str(folder),
                          adapter_loaded_at=None if folder is None else at)


def _run(runner: ModelRunner, prompts: dict[str, list[int]],
         params: dict[str, SamplingParams]) -> dict[str, list[int]]:
    return drive(runner, prompts, params, num_blocks=64, block_size=4,
                 max_batch_tokens=16).tokens


def test_runtime_adapters_load_on_first_use_and_decode_as_peft(
        tiny_llama_path: Path, folders: dict[str, Path]) -> None:
    runner = ModelRunner(tiny_llama_path, "float32", "cpu", num_blocks=64, block_size=4,
                         max_model_len=128, max_lora_loaded=1)
    prompts = random_prompts([9, 12, 7], seed=21)
    x, y, z = prompts
    n = 8
    # One slot, two adapters in one batch: each request holds its own.
    got = _run(runner, prompts, {x: _params("a", folders["a"], n),
                                 y: _params("b", folders["b"], n), z: _params(None, None, n)})
    assert got[x] == peft_greedy(tiny_llama_path, folders["a"], prompts[x], n)
    assert got[y] == peft_greedy(tiny_llama_path, folders["b"], prompts[y], n)
    assert runner.adapters.num_loads == 2 and len(runner.adapters.runtime) == 1
    # "b" stayed (named last); "a" is read again when named again.
    again = _run(runner, {x: prompts[x]}, {x: _params("a", folders["a"], n)})
    assert again[x] == got[x] and runner.adapters.num_loads == 3
    _run(runner, {x: prompts[x]}, {x: _params("a", folders["a"], n)})
    assert runner.adapters.num_loads == 3  # kept: no read


def test_a_newer_version_of_a_name_replaces_the_older(
        tiny_llama_path: Path, folders: dict[str, Path]) -> None:
    runner = ModelRunner(tiny_llama_path, "float32", "cpu", num_blocks=64, block_size=4,
                         max_model_len=128)
    prompts = random_prompts([10], seed=22)
    (x,) = prompts
    first = _run(runner, prompts, {x: _params("tenant", folders["a"], 6, at=1.0)})
    second = _run(runner, prompts, {x: _params("tenant", folders["b"], 6, at=2.0)})
    assert first[x] == peft_greedy(tiny_llama_path, folders["a"], prompts[x], 6)
    assert second[x] == peft_greedy(tiny_llama_path, folders["b"], prompts[x], 6)
    assert [k[:2] for k in runner.adapters.runtime] == [("tenant", str(folders["b"]))]


def test_a_folder_that_cannot_be_served_is_refused_at_the_request(
        tiny_llama_path: Path, tmp_path: Path) -> None:
    runner = ModelRunner(tiny_llama_path, "float32", "cpu", num_blocks=8, block_size=4,
                         max_model_len=32)
    with pytest.raises(AdapterError, match="'gone'.*adapter_config.json"):
        runner.add_request("j", _params("gone", tmp_path / "gone", 2), [5, 6])
    assert not runner.has_request("j") and not runner.adapters.runtime
    with pytest.raises(ValueError, match="no LoRA adapter 'x' is loaded"):
        runner.add_request("k", _params("x", None, 2), [5, 6])
