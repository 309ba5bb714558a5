"""SIGKILL under load (streamed HTTP and ZMQ requests on two frontends): every request the
fault hits ends with an error within 10 s, each request ends exactly once, none is lost; a dead
scheduler or worker fails the ZMQ requests with an error naming it and ends the launcher
non-zero naming it, with no process left; a dead frontend costs only its own requests: the
other frontend's finish, the server keeps serving through it, frees the dead one's blocks
(integrity holds), names it, and still drains to exit 0 on SIGTERM. (Start-up failures:
test_serve_failures.py.) Long version: scripts/stress.py --scenario faults."""
import re

import pytest

from benchmarks.stresskit.harness import FAULT_DEADLINE_S, launch
from benchmarks.stresskit.scenarios import fault
from conveyor.shared.model_files import default_model_path

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not default_model_path().is_file(),
                                                   reason="default model not fetched")]


@pytest.mark.parametrize("victim", ["worker-0", "scheduler", "frontend-1"])
def test_sigkill_under_load_fails_the_requests_it_hits_within_10_s(victim):
    with launch("--max-num-seqs", "8", "--frontends", "2") as server:
        r = fault(server, victim, duration=2, concurrency=8, max_tokens=64)
        stderr = server.stderr()
    assert r.problems == [], r
    assert r.notes["affected"] > 0 and r.failed >= r.notes["affected"]
    assert r.notes["slowest_error_s"] < FAULT_DEADLINE_S
    if not victim.startswith("frontend-"):
        assert r.notes["exit_code"] not in (None, 0)
        # the reasons have their digits as N: "... worker-N (pid N) died ..."
        zmq = [reason for reason in r.fail_reasons if reason.startswith("zmq")]
        assert zmq and all(re.sub(r"\d+", "N", victim) in z for z in zmq), r.fail_reasons
    else:                                        # the other frontend served on, then drained
        assert r.finished > 0 and r.notes["exit_code_after_sigterm"] == 0
        assert r.leaked_blocks == 0 and r.integrity_ok
        assert victim in stderr                  # the launcher says which frontend died
