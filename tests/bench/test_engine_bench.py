"""The engine benchmark's decode set-ups: a shared prompt or a copy per sequence."""

from __future__ import annotations

from bench.engine_bench import OursBench, parse_args


def _decode(distinct: bool) -> tuple[OursBench, list[list[int]]]:
    args = parse_args(["--dtypes", "float32", "--prefill-lens", "16", "--decode-batches", "3",
                       "--decode-context", "32", "--decode-steps", "3", "--warmup", "0",
                       "--no-hf", *(["--distinct-kv"] if distinct else [])])
    bench = OursBench(args, "float32")
    step = bench.start_decode(list(range(200, 232)), 3)
    for _ in range(3):
        assert step() > 0
    outputs = [bench.runner._requests[j].output_token_ids for j in bench._decode_jobs]
    return bench, outputs


def test_distinct_kv_gives_each_sequence_its_own_copy_of_the_context():
    shared_bench, shared = _decode(distinct=False)
    distinct_bench, distinct = _decode(distinct=True)
    # Same prompt, same greedy tokens, whether the context is shared or copied.
    assert distinct == shared
    assert all(len(o) == 4 for o in distinct)  # the prefill's token and three steps
    kv = distinct_bench.runner.kv_cache
    shared_ids = [0, 1]  # the prompt's two blocks of 16 tokens
    # The blocks after the prompt's: the copies, each equal to the prompt's.
    for first in (2, 2 + distinct_bench.private_blocks + 2):
        assert kv.read_blocks([first, first + 1]).equal(kv.read_blocks(shared_ids))
