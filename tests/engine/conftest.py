from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import os

import pytest
import torch

from tests.engine.helpers import TINY_VOCAB, save_random_model

if TYPE_CHECKING:
    from engine.runner import ModelRunner


@pytest.fixture(scope="session", autouse=True)
def _one_thread() -> None:
    # The machine has 2 cores and may be shared: oversubscribed OpenMP
    # threads slow everything down by an order of magnitude.
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    from engine.model_source import ModelSourceError, resolve_model

    try:
        return resolve_model("embedded:smollm2")
    except ModelSourceError as e:
        pytest.skip(f"embedded SmolLM2 unavailable: {e}")


@pytest.fixture(scope="session")
def smollm2_runner(smollm2_path: Path) -> "ModelRunner":
    """Shared by the test modules (loading costs seconds); the block budget
    fits the parity scenarios.  Tests must remove the requests they add."""
    from engine.runner import ModelRunner

    return ModelRunner(smollm2_path, "float32", "cpu", num_blocks=96, block_size=4,
                       max_model_len=80, num_threads=1)


@pytest.fixture(scope="session")
def tokenizer_src() -> Path:
    """The tokenizer the tiny random models reuse: SmolLM2's, from the
    embedded model or, where that package is absent (a GPU machine), from
    the folder `PREEMPT_SERVE_TEST_TOKENIZER` names."""
    folder = os.environ.get("PREEMPT_SERVE_TEST_TOKENIZER")
    if folder:
        return Path(folder)
    from engine.model_source import ModelSourceError, resolve_model

    try:
        return resolve_model("embedded:smollm2")
    except ModelSourceError as e:
        pytest.skip(f"embedded SmolLM2 unavailable: {e}")


def _tiny_llama(folder: Path, tokenizer_src: Path, heads: int, kv_heads: int) -> Path:
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=512, rope_theta=10000.0, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )
    return save_random_model(config, tokenizer_src, folder)


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory: pytest.TempPathFactory, tokenizer_src: Path) -> Path:
    return _tiny_llama(tmp_path_factory.mktemp("tiny-llama"), tokenizer_src, 4, 2)


@pytest.fixture(scope="session")
def tiny_llama_d32_path(tmp_path_factory: pytest.TempPathFactory, tokenizer_src: Path) -> Path:
    """Heads of 32: a head dim the CPU prefill operator's vector path takes."""
    return _tiny_llama(tmp_path_factory.mktemp("tiny-llama-d32"), tokenizer_src, 2, 1)


@pytest.fixture(scope="session")
def tiny_llama3_rope_path(tmp_path_factory: pytest.TempPathFactory, tokenizer_src: Path) -> Path:
    """Tied embeddings, attention bias, head_dim != hidden/heads, llama3 RoPE scaling."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=TINY_VOCAB, hidden_size=48, intermediate_size=96, head_dim=16,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
        max_position_embeddings=512, tie_word_embeddings=True, attention_bias=True,
        rope_parameters={
            "rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )
    return save_random_model(config, tokenizer_src, tmp_path_factory.mktemp("tiny-llama3"))


@pytest.fixture(scope="session")
def tiny_opt_path(tmp_path_factory: pytest.TempPathFactory, tokenizer_src: Path) -> Path:
    from transformers import OPTConfig

    config = OPTConfig(
        vocab_size=TINY_VOCAB, hidden_size=64, ffn_dim=128, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=256, word_embed_proj_dim=64,
        do_layer_norm_before=True, bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )
    return save_random_model(config, tokenizer_src, tmp_path_factory.mktemp("tiny-opt"))


@pytest.fixture(scope="session")
def tiny_opt350_path(tmp_path_factory: pytest.TempPathFactory, tokenizer_src: Path) -> Path:
    """The OPT-350m shape: project_in/out and post-norm layers."""
    from transformers import OPTConfig

    config = OPTConfig(
        vocab_size=TINY_VOCAB, hidden_size=64, ffn_dim=128, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=256, word_embed_proj_dim=32,
        do_layer_norm_before=False, bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )
    return save_random_model(config, tokenizer_src, tmp_path_factory.mktemp("tiny-opt350"))
