"""`conveyor serve --data-parallel-size 2` on CPU: greedy outputs equal to one in-process
engine; prefix affinity sends a repeated prefix to one replica (its prefix-cache counters show
it); /health and /metrics per replica; a replica whose scheduler is SIGKILLed fails its own
in-flight request with a reason while the other replica finishes its own and keeps serving.
"""
import json
import os
import signal
import time
import urllib.request

import pytest
from serve_util import alive, start_server

from conveyor import SamplingParams
from conveyor.client import Client
from conveyor.shared.model_files import default_model_path

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not default_model_path().is_file(),
                                                   reason="default model not fetched")]

PROMPTS = ["The capital of France is", "1, 2, 3,", "Hello, my name is", "The sky is",
           "def fib(n):", "Water boils at", "My favourite food is", "Once upon a time"]
GREEDY = SamplingParams(temperature=0, max_tokens=6)
# four KV blocks and more of the same text: what prefix affinity keys on
PREFIX = ("You are a careful assistant. Answer in one short sentence, plainly, without lists, "
          "and never repeat the question. Do not guess: when you do not know, say so. Keep "
          "to facts a schoolbook would state, use plain words, avoid jargon, give no advice "
          "nobody asked for, and end with a full stop. Here is the question: ")


@pytest.fixture(scope="module")
def server():
    s = start_server("-dp", "2", "--frontends", "1")
    yield s
    s.kill_all()


def _get(server, path: str):
    with urllib.request.urlopen(server.http + path, timeout=30) as r:
        return r.read().decode()


def test_greedy_outputs_equal_one_engine(server, small_llm):
    reference = [o.outputs[0].token_ids for o in small_llm.generate(PROMPTS, GREEDY,
                                                                      use_tqdm=False)]
    with Client(server.addresses[0], timeout=120) as c:
        assert [r.token_ids for r in c.generate(PROMPTS, GREEDY)] == reference
        stats = c.stats()
    # both replicas computed some of them (short prompts go to the least loaded)
    assert [s.replica for s in stats.replicas] == [0, 1]
    assert all(s.num_prompt_tokens > 0 for s in stats.replicas), stats.replicas


def test_a_repeated_prefix_goes_to_one_replica(server):
    with Client(server.addresses[0], timeout=120) as c:
        before = c.stats().replicas
        for q in ("Why is the sea salty?", "What is rain?", "Who built Rome?"):
            c.generate([PREFIX + q], SamplingParams(temperature=0, max_tokens=2))
        after = c.stats().replicas
    queried = [a.prefix_cache_queries - b.prefix_cache_queries for a, b in zip(after, before)]
    hits = [a.prefix_cache_hits - b.prefix_cache_hits for a, b in zip(after, before)]
    home = max(range(2), key=lambda r: queried[r])
    assert queried[1 - home] == 0 and hits[1 - home] == 0, (queried, hits)
    assert hits[home] >= 2 * 4 * 16, (queried, hits)     # the 2nd and 3rd found the prefix


def test_health_and_metrics_per_replica(server):
    health = json.loads(_get(server, "/health"))
    assert [r["replica"] for r in health["replicas"]] == [0, 1]
    metrics = _get(server, "/metrics")
    for r in (0, 1):
        assert f'conveyor:replica_up{{model_name="SmolLM2-135M-Instruct",replica="{r}"}} 1.0' \
            in metrics
        assert (f'conveyor:prefix_cache_hits_total{{model_name="SmolLM2-135M-Instruct",'
                f'replica="{r}"}}') in metrics


def test_a_killed_replica_fails_its_requests_and_the_other_serves_on(server):
    long = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    with Client(server.addresses[0], timeout=60) as c:
        # two requests at once: the second goes to the replica the first left idle
        streams = [c.stream(p, long) for p in ("Tell me a story", "Tell me a joke")]
        for s in streams:
            next(s)
        os.kill(server.children["conveyor::scheduler-1"], signal.SIGKILL)
        ends = []
        for s in streams:
            for d in s:
                if d.finish_reason is not None:
                    ends.append((d.finish_reason, d.error))
        assert sorted(e[0] for e in ends) == ["error", "length"], ends
        error = next(e[1] for e in ends if e[0] == "error")
        assert "replica 1" in error and "scheduler-1" in error, error
        time.sleep(0.5)
        assert not alive(server.children["conveyor::worker-1.0"])   # its replica was stopped
        assert server.proc.poll() is None
        # the survivor takes every new request
        assert [r.finish_reason for r in c.generate(PROMPTS[:3], GREEDY)] == ["length"] * 3
        assert c.stats().dead_replicas == [1]
    health = json.loads(_get(server, "/health"))["replicas"]
    assert health[0]["status"] == "ok" and health[1]["status"] == "dead", health
    assert "scheduler-1" in health[1]["reason"]
    assert 'replica_up{model_name="SmolLM2-135M-Instruct",replica="1"} 0.0' in _get(
        server, "/metrics")
