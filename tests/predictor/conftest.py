"""Fixtures: a tiny random OPT and a tiny Llama with a locally trained tokenizer.

Nothing is downloaded: the tokenizer is a small BPE trained here with
`tokenizers`, the models are random `OPTConfig` / `LlamaConfig` saved with
`save_pretrained`.  tests/studies/predictor uses the same fixtures.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
import torch

WORDS = (
    "write a short poem about the sea explain quantum computing in simple terms "
    "translate this sentence into french summarize the following text code a python "
    "function that sorts a list give me ten ideas for a birthday party continue hi"
).split()


def synthetic_records(n: int, seed: int = 0) -> list[tuple[str, str, str]]:
    """(id, prompt, answer) with a few repeated prompts, like ShareGPT."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if i % 10 == 0:
            prompt = "continue"
        else:
            prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 40)))
        answer = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 120)))
        out.append((f"r{i}", prompt, answer))
    return out


def _tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<pad>", "<unk>", "</s>"])
    tok.train_from_iterator([" ".join(WORDS)] * 20, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", eos_token="</s>"
    )
    fast.save_pretrained(str(path))


@pytest.fixture(scope="session")
def tiny_opt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import OPTConfig, OPTModel

    path = tmp_path_factory.mktemp("tiny-opt")
    torch.manual_seed(0)
    cfg = OPTConfig(
        vocab_size=200, hidden_size=32, num_hidden_layers=4, ffn_dim=64,
        num_attention_heads=4, max_position_embeddings=256, word_embed_proj_dim=32,
        pad_token_id=0, bos_token_id=2, eos_token_id=2,
    )
    OPTModel(cfg).save_pretrained(str(path))
    _tokenizer(path)
    return path


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=200, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        pad_token_id=0, bos_token_id=2, eos_token_id=2, tie_word_embeddings=True,
    )
    LlamaForCausalLM(cfg).save_pretrained(str(path))
    _tokenizer(path)
    return path


@pytest.fixture()
def tiny_llama_chat(tiny_llama: Path, tmp_path: Path) -> Path:
    from predictor.dataset import load_tokenizer

    path = tmp_path / "tiny-llama-chat"
    shutil.copytree(tiny_llama, path)
    tok = load_tokenizer(str(path))
    tok.chat_template = (
        "{% for m in messages %}</s> {{ m['role'] }} : {{ m['content'] }} </s>{% endfor %}"
        "{% if add_generation_prompt %} assistant :{% endif %}"
    )
    tok.save_pretrained(str(path))
    return path


def save_member(backbone: Path, out: Path, seed: int, **kw: object) -> Path:
    """A trained-looking adapter (random LoRA updates and heads) saved as `train` would."""
    from predictor.config import ModelConfig
    from predictor.model import build_predictor, save_predictor

    torch.manual_seed(seed)
    base: dict[str, object] = dict(
        backbone=str(backbone), lora_layers=2, head="bins", max_len=256, head_hidden=16,
        pool_layers=(2, 4), pooling="mean+last", decode="median",
    )
    base.update(kw)
    model = build_predictor(ModelConfig.model_validate(base))
    # Non-zero LoRA updates and heads that disagree, so members differ.
    for name, p in model.named_parameters():
        if "lora_B" in name or "nets" in name:
            torch.nn.init.normal_(p, std=0.3)
    save_predictor(model, out, {"length_tokenizer": str(backbone), "commands": [f"train --seed {seed}"],
                                "train_config": {"seed": seed}})
    return out


@pytest.fixture(autouse=True)
def _one_thread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.set_num_threads(1)
    monkeypatch.setenv("PREDICTOR_CACHE", str(tmp_path / "cache"))
