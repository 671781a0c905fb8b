"""LoRA adapters (engine/lora.py): a request with an adapter decodes as
PEFT's model of the base and that adapter does, in one pass with requests
of the base model and of other adapters; refusals name what is wrong."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine.lora import AdapterError
from engine.runner import ModelRunner
from engine.sampling_params import SamplingParams
from tests.engine.helpers import DriveResult, drive, hf_greedy, load_hf, random_prompts

peft = pytest.importorskip("peft")

LLAMA_ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base: Path, out: Path, targets: list[str], r: int = 8, alpha: int = 16,
                 seed: int = 0, **extra: object) -> Path:
    """A PEFT LoRA adapter of `base` with random A and B (a no-op B would
    test nothing), saved as PEFT saves one."""
    torch.manual_seed(seed)
    model = load_hf(base)
    cfg = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=targets,
                          init_lora_weights=False, **extra)
    tuned = peft.get_peft_model(model, cfg)
    with torch.no_grad():  # strong enough to change greedy tokens
        for name, p in tuned.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.3)
    tuned.save_pretrained(out)
    return out


def peft_greedy(base: Path, adapter: Path, prompt: list[int], n: int) -> list[int]:
    model = peft.PeftModel.from_pretrained(load_hf(base), str(adapter)).eval()
    return hf_greedy(model, prompt, n)


def _run(runner: ModelRunner, prompts: dict[str, list[int]], adapters: dict[str, str | None],
         n: int, **kw: object) -> dict[str, list[int]]:
    return _drive(runner, prompts, adapters, n, **kw).tokens


def _drive(runner: ModelRunner, prompts: dict[str, list[int]],
           adapters: dict[str, str | None], n: int, num_blocks: int = 64,
           **kw: object) -> DriveResult:
    params = {j: SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n,
                                adapter=adapters[j]) for j in prompts}
    return drive(runner, prompts, params, num_blocks=num_blocks, block_size=4,
                 **kw)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def llama_adapters(tiny_llama_path: Path, tmp_path_factory: pytest.TempPathFactory
                   ) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora")
    return {"all": make_adapter(tiny_llama_path, root / "all", LLAMA_ALL),
            "qv": make_adapter(tiny_llama_path, root / "qv", ["q_proj", "v_proj"], r=4,
                               alpha=8, seed=1, use_rslora=True)}


def test_each_request_decodes_as_peft_with_its_adapter_in_one_mixed_batch(
        tiny_llama_path: Path, llama_adapters: dict[str, Path]) -> None:
    runner = ModelRunner(tiny_llama_path, "float32", "cpu", num_blocks=64, block_size=4,
                         max_model_len=128,
                         lora_adapters={k: str(v) for k, v in llama_adapters.items()})
    prompts = random_prompts([9, 14, 6, 11], seed=3)
    ids = list(prompts)
    which = {ids[0]: "all", ids[1]: None, ids[2]: "qv", ids[3]: "all"}
    n = 10
    # Small chunks: prefill chunks and decodes of different adapters share passes.
    got = _run(runner, prompts, which, n, max_batch_tokens=16)
    base = load_hf(tiny_llama_path)
    for job, adapter in which.items():
        want = (hf_greedy(base, prompts[job], n) if adapter is None
                else peft_greedy(tiny_llama_path, llama_adapters[adapter], prompts[job], n))
        assert got[job] == want, (job, adapter)
    # Alone, every row of each pass is the adapter's (one GEMM adds its delta).
    alone = _run(runner, {ids[0]: prompts[ids[0]]}, {ids[0]: "all"}, n)
    assert alone[ids[0]] == got[ids[0]]
    # The adapters matter: the base model answers the same prompt otherwise.
    plain = _run(runner, {ids[0]: prompts[ids[0]]}, {ids[0]: None}, n)
    assert plain[ids[0]] != got[ids[0]]


def test_opt_adapters_decode_as_peft(tiny_opt_path: Path, tmp_path: Path) -> None:
    adapter = make_adapter(tiny_opt_path, tmp_path / "opt",
                           ["q_proj", "v_proj", "out_proj", "fc1", "fc2"], seed=2)
    runner = ModelRunner(tiny_opt_path, "float32", "cpu", num_blocks=64, block_size=4,
                         max_model_len=128, lora_adapters={"opt": str(adapter)})
    prompts = random_prompts([7, 12], seed=5)
    a, b = prompts
    got = _run(runner, prompts, {a: "opt", b: None}, 8)
    assert got[a] == peft_greedy(tiny_opt_path, adapter, prompts[a], 8)
    assert got[b] == hf_greedy(load_hf(tiny_opt_path), prompts[b], 8)


def test_deterministic_bf16_adapter_rows_do_not_depend_on_their_neighbours(
        tiny_llama_path: Path, llama_adapters: dict[str, Path]) -> None:
    runner = ModelRunner(tiny_llama_path, "bfloat16", "cpu", num_blocks=64, block_size=4,
                         max_model_len=128, deterministic=True,
                         lora_adapters={k: str(v) for k, v in llama_adapters.items()})
    prompts = random_prompts([9, 14, 6, 11, 8], seed=7)
    which = dict(zip(prompts, ["all", None, "qv", "all", "qv"]))
    together = _run(runner, prompts, which, 12, max_batch_tokens=20)
    for job, adapter in which.items():
        alone = _run(runner, {job: prompts[job]}, {job: adapter}, 12)
        assert alone[job] == together[job], (job, adapter)
    # Preempted and recomputed under a small cache: the same tokens.
    squeezed = _drive(runner, prompts, which, 12, num_blocks=14, max_batch_tokens=12,
                      max_model_len=32)
    assert squeezed.num_mid_generation_preemptions > 0
    assert squeezed.tokens == together

def test_refusals_name_the_adapter_and_what_is_wrong(tiny_llama_path: Path,
                                                     llama_adapters: dict[str, Path],
                                                     tmp_path: Path) -> None:
    def load(path: Path) -> None:
        ModelRunner(tiny_llama_path, "float32", "cpu", num_blocks=8, block_size=4,
                    max_model_len=32, lora_adapters={"bad": str(path)})

    with pytest.raises(AdapterError, match="'bad'.*adapter_config.json"):
        load(tmp_path / "missing")
    dora = make_adapter(tiny_llama_path, tmp_path / "dora", ["q_proj"], use_dora=True)
    with pytest.raises(AdapterError, match="use_dora"):
        load(dora)
    head = make_adapter(tiny_llama_path, tmp_path / "head", ["lm_head"])
    with pytest.raises(AdapterError, match="lm_head"):
        load(head)
    other = tmp_path / "other"
    other.mkdir()
    cfg = json.loads((llama_adapters["qv"] / "adapter_config.json").read_text())
    (other / "adapter_config.json").write_text(json.dumps(cfg))
    from safetensors.torch import load_file, save_file

    tensors = {k: torch.cat([v, v], dim=-1) if "lora_A" in k else v
               for k, v in load_file(str(llama_adapters["qv"] /
                                         "adapter_model.safetensors")).items()}
    save_file(tensors, str(other / "adapter_model.safetensors"))
    with pytest.raises(AdapterError, match="another base model"):
        load(other)
    runner = ModelRunner(tiny_llama_path, "float32", "cpu", num_blocks=8, block_size=4,
                         max_model_len=32, lora_adapters={"qv": str(llama_adapters["qv"])})
    with pytest.raises(ValueError, match="no LoRA adapter 'nope'.*'qv'"):
        runner.add_request("j", SamplingParams(adapter="nope", max_tokens=2), [5, 6])
