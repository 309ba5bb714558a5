"""SIGTERM under load (streamed and whole requests, HTTP and ZMQ): the requests in flight
complete normally within --shutdown-timeout, a new request gets 503 over HTTP and an ErrorReply
with code 503 over ZMQ, and the launcher exits 0 with no process left.
Long version: scripts/stress.py --scenario graceful-stop."""
import pytest

from benchmarks.stresskit.harness import launch
from benchmarks.stresskit.scenarios import graceful_stop
from conveyor.shared.model_files import default_model_path

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not default_model_path().is_file(),
                                                   reason="default model not fetched")]


def test_sigterm_under_load_finishes_in_flight_requests_and_refuses_new_ones():
    with launch("--max-num-seqs", "8", "--shutdown-timeout", "60") as server:
        r = graceful_stop(server, duration=2, concurrency=8, max_tokens=32,
                                 shutdown_timeout=60)
    assert r.problems == [], r
    assert r.notes["in_flight_at_sigterm"] > 0 and r.failed == 0
    assert r.notes["refusals"] == {"http": 503, "zmq": 503}
    assert r.notes["exit_code"] == 0
