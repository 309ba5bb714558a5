"""Four times --max-num-seqs clients in a closed loop with --max-queued-requests set: every
request finishes or is refused with 429, none is lost, latency stays bounded, and nothing is
held afterwards. Long version: scripts/stress.py --scenario load."""
import pytest

from benchmarks.stresskit.harness import launch
from benchmarks.stresskit.scenarios import load
from conveyor.shared.model_files import default_model_path

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not default_model_path().is_file(),
                                                   reason="default model not fetched")]


def test_overload_is_refused_with_429_and_latency_stays_bounded():
    with launch("--max-num-seqs", "4", "--max-queued-requests", "4") as server:
        r = load(server, duration=5, concurrency=16, max_tokens=8, max_peak_mib=2048)
    assert r.problems == [], r
    assert r.notes["refused_429"] > 0 and r.finished > 0
    assert set(r.fail_reasons) <= {"http 429", "zmq error 429"}, r.fail_reasons
    assert r.latency_p99_s < 60
