"""Same-prompt ceiling: re-posts are skipped, regenerations are scored leave-one-out."""

from __future__ import annotations

import pytest

from studies.predictor.ceiling import same_prompt_ceiling
from predictor.dataset import LengthPair


def _pairs(rows: list[tuple[str, int]]) -> list[LengthPair]:
    return [LengthPair(id=str(i), prompt=p, prompt_tokens=len(p.split()), response_len=n)
            for i, (p, n) in enumerate(rows)]


def test_regenerated_answers_are_predicted_by_the_median_of_the_others() -> None:
    q = "explain quantum computing in simple terms please"
    rows = [
        (q, 100), (q, 130), (q, 400), (q, 100),  # distinct lengths 100, 130, 400
        ("write a poem about the sea now", 80), ("write a poem about the sea now ", 80),  # a re-post
        ("hi", 10), ("hi", 500),  # too short to count
        ("a prompt seen only once here", 50),
    ]
    r = same_prompt_ceiling(_pairs(rows), min_words=5)
    assert (r.repeated_prompts, r.reposts, r.groups, r.answers) == (2, 1, 1, 3)
    # 100 <- median(130, 400) = 265; 130 <- median(100, 400) = 250; 400 <- median(100, 130) = 115.
    assert r.mae == pytest.approx((165 + 120 + 285) / 3)
    assert r.acc50 == 0.0 and r.acc100 == 0.0
    # Without the word filter "hi" counts too: 10 <- 500 and 500 <- 10.
    r0 = same_prompt_ceiling(_pairs(rows), min_words=0)
    assert r0.groups == 2 and r0.answers == 5


def test_no_regenerations_is_an_error() -> None:
    with pytest.raises(ValueError, match="distinct"):
        same_prompt_ceiling(_pairs([("one two three four five", 5), ("one two three four five", 5)]))
