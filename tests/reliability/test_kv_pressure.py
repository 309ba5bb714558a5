"""A KV pool so small (10 blocks for 8 sequences) that requests are preempted and recomputed
again and again: greedy outputs over HTTP and ZMQ equal the offline API's, preemptions are
counted (Stats and conveyor:num_preemptions_total), no request is lost or starved, and every
block is free afterwards. Long version: scripts/stress.py --scenario kv-pressure."""
import pytest

from benchmarks.stresskit.harness import launch
from benchmarks.stresskit.scenarios import kv_pressure
from conveyor.shared.model_files import default_model_path

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not default_model_path().is_file(),
                                                   reason="default model not fetched")]


def test_outputs_equal_the_offline_api_under_constant_preemption():
    with launch("--max-num-seqs", "8", "--num-kv-blocks", "10") as server:
        r = kv_pressure(server, requests=16, concurrency=8, max_tokens=24)
    assert r.problems == [], r
    assert r.finished == r.sent == 16
    assert r.notes["preemptions"] > 0, r.notes
    assert r.max_ttft_s is not None and r.leaked_blocks == 0
