"""The burst replay's packing: the server's chunked prefill of a burst."""

from studies.engine_cpu.vllm_cpu.burst_replay import pack


def test_first_prompt_alone_then_full_budgets_with_prompts_cut_across() -> None:
    steps = pack([5, 3, 4, 6], budget=6)
    assert steps == [
        [(0, 0, 5)],
        [(1, 0, 3), (2, 0, 3)],
        [(2, 3, 1), (3, 0, 5)],
        [(3, 5, 1)],
    ]
    # Every prompt token is computed once, in order, and no step is over budget.
    for i, n in enumerate([5, 3, 4, 6]):
        chunks = [(s, k) for step in steps for j, s, k in step if j == i]
        assert sum(k for _, k in chunks) == n
        assert [s for s, _ in chunks] == sorted(s for s, _ in chunks)
    assert all(sum(k for _, _, k in step) <= 6 for step in steps[1:])


def test_a_prompt_longer_than_the_budget_spans_several_steps() -> None:
    steps = pack([1, 10], budget=4)
    assert steps[1:] == [[(1, 0, 4)], [(1, 4, 4)], [(1, 8, 2)]]
