"""Scheduling policies through `conveyor serve` on CPU: with the engine saturated by low-priority
requests (HTTP), high-priority ones (ZMQ client) get their first token sooner and the low ones
still finish; objectives reach /metrics; bad objectives are a 400; a policy that cannot be loaded
stops the launch with one line."""
import statistics
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serve_util import run_serve, start_server

from conveyor import SamplingParams
from conveyor.client import Client
from conveyor.shared.model_files import default_model_path

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not default_model_path().is_file(),
                                                   reason="default model not fetched")]

NUM_LOW, NUM_HIGH, LOW_TOKENS = 6, 3, 16


@pytest.fixture(scope="module")
def server():
    s = start_server("--scheduling-policy", "priority", "--max-num-seqs", "2")
    yield s
    s.kill_all()


def low_request(server, i: int, out: dict) -> None:
    """A streamed low-priority completion: its client-side TTFT and its token count."""
    body = {"prompt": f"({i}) Tell me a story", "max_tokens": LOW_TOKENS, "ignore_eos": True,
            "stream": True, "priority": 1, "return_token_ids": True}
    start, tokens = time.monotonic(), 0
    with httpx.stream("POST", server.http + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                ids = httpx.Response(200, content=line[6:]).json()["choices"][0]["token_ids"]
                if ids and "ttft" not in out:
                    out["ttft"] = time.monotonic() - start
                tokens += len(ids)
    out["tokens"] = tokens


def high_request(server, i: int, out: dict) -> None:
    with Client(server.addresses[0], timeout=120) as c:
        start = time.monotonic()
        for delta in c.stream(f"({i}) Say hi", SamplingParams(max_tokens=4, ignore_eos=True),
                              priority=-1, ttft_slo=60.0):
            if delta.token_ids and "ttft" not in out:
                out["ttft"] = time.monotonic() - start


def test_high_priority_goes_first_and_low_priority_still_finishes(server):
    lows, highs = [{} for _ in range(NUM_LOW)], [{} for _ in range(NUM_HIGH)]
    threads = [threading.Thread(target=low_request, args=(server, i, o))
               for i, o in enumerate(lows)]
    for t in threads:
        t.start()
    with Client(server.addresses[0], timeout=30) as c:
        deadline = time.monotonic() + 60
        while (c.stats().num_running, c.stats().num_waiting) != (2, NUM_LOW - 2):
            assert time.monotonic() < deadline, c.stats()
            time.sleep(0.02)
        more = [threading.Thread(target=high_request, args=(server, i, o))
                for i, o in enumerate(highs)]
        for t in more:
            t.start()
        for t in threads + more:
            t.join(120)
        stats = c.stats()
    assert all(o["tokens"] == LOW_TOKENS for o in lows), lows
    high_ttft = statistics.median(o["ttft"] for o in highs)
    low_ttft = statistics.median(o["ttft"] for o in lows)
    assert high_ttft < low_ttft, (highs, lows)
    assert stats.num_preemptions >= 1 and stats.num_running == stats.num_waiting == 0
    assert (stats.ttft_slo_judged, stats.ttft_slo_missed) == (NUM_HIGH, 0)
    metrics = {(s.name, tuple(v for k, v in s.labels.items() if k != "model_name")): s.value
               for f in text_string_to_metric_families(httpx.get(server.http + "/metrics").text)
               for s in f.samples}
    assert metrics[("conveyor:slo_judged_total", ("ttft",))] == NUM_HIGH
    assert metrics[("conveyor:slo_missed_total", ("ttft",))] == 0
    assert metrics[("conveyor:longest_wait_seconds", ())] == 0
    assert metrics[("conveyor:queue_cap_requests", ())] > 0


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "x", "ttft_slo": -1}),
    ("/v1/completions", {"prompt": "x", "tpot_slo": 0}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "ttft_slo": 0.0}),
])
def test_bad_objectives_are_a_400(server, path, body):
    r = httpx.post(server.http + path, json=body, timeout=30)
    assert r.status_code == 400 and "must be a positive number of seconds" in r.text, r.text
    r = httpx.post(server.http + path, json={**body, "ttft_slo": "soon", "tpot_slo": None})
    assert r.status_code == 400 and "ttft_slo" in r.text, r.text


def test_a_policy_that_cannot_be_loaded_stops_the_launch():
    proc = run_serve("--scheduling-policy", "no_such_module:Policy")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2
    assert err.strip().splitlines()[-1].startswith(
        "conveyor: error: cannot load scheduling policy 'no_such_module:Policy'")


def test_offline_api_takes_a_priority_per_prompt(tmp_path):
    """LLM.generate(priority=...) under the priority policy: with one sequence slot the
    prompts run in priority order, not in the order given."""
    from models_util import make_tiny_model

    from conveyor import LLM

    llm = LLM(str(make_tiny_model("llama", tmp_path)), skip_tokenizer_init=True, max_num_seqs=1,
              scheduling_policy="priority")
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outs = llm.generate([[3, 4, 5], [6, 7], [8, 9, 10]], params, use_tqdm=False,
                        priority=[2, 0, 1])
    order = sorted(range(3), key=lambda i: outs[i].metrics.first_token_time)
    assert order == [1, 2, 0]
    with pytest.raises(ValueError, match="got 2 priorities for 3 prompts"):
        llm.generate([[3], [4], [5]], params, use_tqdm=False, priority=[0, 1])
    with pytest.raises(ValueError, match="priority must fit in 64 bits"):
        llm.generate([[3]], params, use_tqdm=False, priority=1 << 64)
