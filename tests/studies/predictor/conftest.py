"""The predictor tests' fixtures (tiny models, synthetic records, one torch thread)."""

from __future__ import annotations

from tests.predictor.conftest import (  # noqa: F401  (fixtures are found by name)
    _one_thread,
    save_member,
    synthetic_records,
    tiny_llama,
    tiny_llama_chat,
    tiny_opt,
)
