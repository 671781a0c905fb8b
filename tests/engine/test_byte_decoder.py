"""A byte-level tokenizer's text from its table of token bytes, step by
step against the tokenizer library's `DecodeStream`."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models
from tokenizers.decoders import DecodeStream

from engine.byte_decoder import ByteLevelStream, byte_table
from engine.tokenizer import load_tokenizer

TEXT = "Héllo wörld! 你好世界 🤖🎉 naïve café — done.\nNext line: ok"


@pytest.fixture(scope="module")
def backend(smollm2_path: Path) -> Tokenizer:
    return load_tokenizer(smollm2_path)._tokenizer


def _streams_agree(backend: Tokenizer, ids: list[int], skip: bool) -> int:
    """Feed `ids` to both decoders; returns how many steps gave text."""
    table = byte_table(backend, skip)
    assert table is not None
    ours, theirs = ByteLevelStream(table), DecodeStream(ids=[], skip_special_tokens=skip)
    pieces = 0
    for k, token in enumerate(ids):
        got, want = ours.step(token), theirs.step(backend, token)
        assert got == want, (k, token)
        pieces += got is not None
    return pieces


@pytest.mark.parametrize("skip", [True, False])
def test_the_table_streams_as_decode_stream_does(backend: Tokenizer, skip: bool) -> None:
    rng = random.Random(0)
    vocab = backend.get_vocab_size(with_added_tokens=True)
    specials = [i for i, t in backend.get_added_tokens_decoder().items() if t.special]
    text = backend.encode(TEXT * 20, add_special_tokens=False).ids
    # Random ids over the vocabulary; the byte tokens alone (cut and invalid
    # UTF-8 sequences) with special tokens among them; ids past the vocabulary.
    anywhere = [rng.randrange(vocab) for _ in range(20000)]
    bytes_ = [rng.choice(specials) if rng.random() < 0.05 else rng.randrange(300)
              for _ in range(20000)]
    beyond = [rng.choice([vocab + 5, *text[:40]]) for _ in range(400)]
    for ids in (text, anywhere, bytes_, beyond):
        assert _streams_agree(backend, ids, skip) > 0
    # A special token's text is its own where kept, nothing where skipped.
    out = ByteLevelStream(byte_table(backend, skip)).step(specials[0])  # type: ignore[arg-type]
    assert out == (None if skip else backend.id_to_token(specials[0]))


def test_a_cut_character_is_held_until_complete(backend: Tokenizer) -> None:
    table = byte_table(backend, True)
    assert table is not None
    # "🤖" is four bytes; each has its own byte token.
    byte_ids = [next(i for i, raw in enumerate(table) if raw == bytes([b]))
                for b in "🤖".encode()]
    stream = ByteLevelStream(table)
    assert [stream.step(i) for i in byte_ids] == [None, None, None, "🤖"]


def test_only_a_byte_level_decoder_gets_a_table() -> None:
    word_level = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    word_level.decoder = decoders.Metaspace()
    assert byte_table(word_level, True) is None


def test_the_table_is_built_once_per_tokenizer_and_mode(backend: Tokenizer) -> None:
    assert byte_table(backend, True) is byte_table(backend, True)
    assert byte_table(backend, True) is not byte_table(backend, False)
