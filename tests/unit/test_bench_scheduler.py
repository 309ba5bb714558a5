"""benchmarks/scheduler.py: the scheduler alone decodes every request to its end, and the timed
steps are the full-batch decode steps (the first, prefill-carrying steps are not counted)."""
import pytest

from benchmarks.scheduler import run


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_times_the_full_decode_steps(async_scheduling):
    r = run(requests=12, steps=20, async_scheduling=async_scheduling)
    # all 12 prompts fit one step, which samples each request's first token; 19 decode steps of
    # the whole batch then sample the other 19
    assert r["steps"] == 19
    assert r["schedule"] > 0 and r["update"] > 0 and r["codec"] > 0
