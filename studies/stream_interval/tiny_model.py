"""A Llama of random weights small enough that its engine steps take a few
milliseconds at 128 sequences, with SmolLM2's tokenizer and vocabulary (so
that any chat prompt tokenizes into it), saved as a Hugging Face folder for
`model:` (`ceiling.sh`): served, it makes tokens faster than the HTTP path
streams them, so that the path is what a run measures.

    python -m studies.stream_interval.tiny_model OUT_FOLDER
"""

from __future__ import annotations

import argparse
from pathlib import Path

from transformers import AutoTokenizer, LlamaConfig

from engine.model_source import resolve_model
from tests.engine.helpers import save_random_model


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    a = ap.parse_args(argv)
    src = resolve_model("embedded:smollm2")
    tok = AutoTokenizer.from_pretrained(src)
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
    print(save_random_model(config, src, a.out))


if __name__ == "__main__":
    main()
