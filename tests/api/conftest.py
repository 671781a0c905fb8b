"""One ingress app per session for each configuration the tests need."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.api.harness import Harness, harness

API_KEY = "sk-test-0123456789abcdef"
# Small, so oversized bodies cost little and long prompts overflow often.
MAX_REQUEST_BYTES = 64 * 1024
MAX_MODEL_LEN = 256


@pytest.fixture(scope="session")
def served() -> Iterator[Harness]:
    with harness(max_request_bytes=MAX_REQUEST_BYTES, max_model_len=MAX_MODEL_LEN) as h:
        yield h


@pytest.fixture(scope="session")
def keyed() -> Iterator[Harness]:
    with harness(api_key=API_KEY, max_request_bytes=MAX_REQUEST_BYTES,
                 max_model_len=MAX_MODEL_LEN) as h:
        yield h


@pytest.fixture(scope="session")
def _wide() -> Iterator[Harness]:
    with harness(max_model_len=1024) as h:
        yield h


@pytest.fixture
def wide(_wide: Harness) -> Iterator[Harness]:
    """A harness with room for long prompts (a tool description); the
    canned answer a test gives its engine (`engine.state.answer`) ends with
    the test."""
    yield _wide
    _wide.engine.state.answer = None


@pytest.fixture
def refusing(served: Harness) -> Iterator[Harness]:
    """`served` while its scheduler refuses every admission (429)."""
    served.scheduler.reject = True
    try:
        yield served
    finally:
        served.scheduler.reject = False
