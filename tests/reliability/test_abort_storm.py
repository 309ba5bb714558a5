"""400 streamed requests, alternately HTTP SSE and ZMQ `Client.stream`, half of them left at
a random point: every KV block is free again, the block manager's integrity holds, each request
ended exactly once (its client saw one finish or left; the server counted each once), no
frontend keeps any state, and memory is back near where it started.
Long version: scripts/stress.py --scenario abort-storm."""
import pytest

from benchmarks.stresskit.harness import launch
from benchmarks.stresskit.scenarios import abort_storm
from conveyor.shared.model_files import default_model_path

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not default_model_path().is_file(),
                                                   reason="default model not fetched")]


@pytest.fixture(scope="module")
def server():
    with launch("--max-num-seqs", "64") as s:
        yield s


def test_four_hundred_streams_half_cancelled_leave_nothing_behind(server):
    r = abort_storm(server, requests=400, concurrency=64, max_tokens=4, max_growth_mib=64)
    assert r.problems == [], r
    assert r.sent == r.finished + r.aborted == 400 and r.lost == 0
    assert r.aborted > 120 and r.finished > 120
    assert r.leaked_blocks == 0 and r.integrity_ok
    assert r.frontend_leftovers == {"frontend-0": 0}
