"""The ceiling study's model: any chat prompt fits its vocabulary, and our
engine loads it."""

from __future__ import annotations

import pytest


def test_the_tiny_model_takes_any_chat_prompt(tmp_path):
    from engine.model_source import ModelSourceError, resolve_model

    try:
        resolve_model("embedded:smollm2")
    except ModelSourceError as e:
        pytest.skip(f"embedded SmolLM2 unavailable: {e}")
    from transformers import AutoConfig, AutoTokenizer

    from engine.runner import ModelRunner
    from studies.stream_interval.tiny_model import main

    out = tmp_path / "tiny"
    main([str(out)])
    tok, cfg = AutoTokenizer.from_pretrained(out), AutoConfig.from_pretrained(out)
    text = tok.apply_chat_template([{"role": "user", "content": "Say a number near 7, only that."}],
                                   add_generation_prompt=True, tokenize=False)
    ids = tok(text)["input_ids"]
    assert cfg.vocab_size == len(tok) and max(ids) < cfg.vocab_size
    assert (cfg.num_hidden_layers, cfg.hidden_size) == (2, 64)
    runner = ModelRunner(out, "float32", "cpu", num_blocks=8, block_size=16, max_model_len=128,
                         num_threads=1)
    assert runner.vocab_size == len(tok)
