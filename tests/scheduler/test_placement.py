from scheduler.placement import Placement


def test_places_on_least_pressured_and_counts_burst():
    p = Placement()
    p.report("a", num_blocks=100, free_blocks=50, queued_tokens=500, num_jobs=3, now=0.0)
    p.report("b", num_blocks=100, free_blocks=90, queued_tokens=100, num_jobs=1, now=0.0)
    # Pressure = (queued + placed since report) / blocks: a 5.0, b 1.0.
    assert p.place("j1", tokens=300, now=0.1) == "b"  # b -> 4.0
    assert p.place("j2", tokens=300, now=0.1) == "b"  # b -> 7.0
    assert p.place("j3", tokens=300, now=0.1) == "a"  # burst spills over
    # A fresh report resets what was counted since the last one.
    p.report("b", num_blocks=100, free_blocks=90, queued_tokens=0, num_jobs=0, now=0.2)
    assert p.place("j4", tokens=10, now=0.3) == "b"

def test_stale_replicas_are_dropped_and_none_without_replicas():
    p = Placement(stale_after_s=1.0)
    assert p.place("j", 10, now=0.0) is None
    p.report("a", 10, 10, 0, 0, now=0.0)
    assert p.place("j", 10, now=0.5) == "a"
    assert p.place("k", 10, now=2.0) is None
    p.release("j")
    assert "j" not in p.job_replica
