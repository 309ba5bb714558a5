"""The rate limit: one token bucket per key for the whole server, whichever frontend process a
request reaches; a refusal says how long to wait (Retry-After) in a message that reads right."""
import asyncio
import json
import subprocess
import sys
import time

import pytest

from conveyor.frontend.guard import Guard, error_body
from conveyor.frontend.rate_limit import PROBES, SLOTS, SharedBuckets

_TAKE = """
import sys
from conveyor.frontend.rate_limit import SharedBuckets
b = SharedBuckets(0.01, 4, sys.argv[1])
print(sum(b.take("key:k") == 0 for _ in range(int(sys.argv[2]))))
"""


def test_the_burst_holds_across_processes(tmp_path):
    """Two frontend processes, four requests each, burst 4: four pass in all, not eight."""
    path = tmp_path / "rate-limit"
    procs = [subprocess.Popen([sys.executable, "-c", _TAKE, str(path), "4"],
                              stdout=subprocess.PIPE, text=True) for _ in range(2)]
    passed = [int(p.communicate(timeout=60)[0]) for p in procs]
    assert sum(passed) == 4, passed
    assert SharedBuckets(0.01, 4, path).take("key:k") > 0          # still empty here too
    assert SharedBuckets(0.01, 4, path).take("key:other") == 0     # keys are apart


def test_tokens_refill_at_the_rate_and_the_wait_says_when():
    b = SharedBuckets(rate=20.0, burst=2)
    assert [b.take("a") for _ in range(2)] == [0.0, 0.0]
    wait = b.take("a")
    assert 0.03 < wait <= 0.05
    time.sleep(wait + 0.01)
    assert b.take("a") == 0.0


def test_many_keys_never_share_a_bucket_while_they_are_limited():
    b = SharedBuckets(rate=1e-3, burst=1)
    keys = [f"key:{i}" for i in range(SLOTS // 4)]
    assert all(b.take(k) == 0 for k in keys)
    refused = sum(b.take(k) > 0 for k in keys)
    # a key finds its bucket unless PROBES busy slots in a row pushed it out (rare at 1/4 load)
    assert refused >= len(keys) * 0.99, (refused, PROBES)


def _call(guard: Guard, path: str, method: str = "GET", client=("10.0.0.1", 1)):
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "path": path, "method": method, "headers": [], "client": client,
             "query_string": b"", "root_path": ""}
    asyncio.run(guard(scope, receive, send))
    start = sent[0]
    body = b"".join(m.get("body", b"") for m in sent[1:])
    return start["status"], dict(start["headers"]), json.loads(body) if body else None


@pytest.mark.parametrize("rate, words", [(2.0, "2 requests per second"),
                                         (1.0, "1 request per second"),
                                         (0.5, "0.5 requests per second")])
def test_a_429_says_the_rate_as_set_and_when_to_retry(rate, words):
    async def ok(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    guard = Guard(ok, rate_limit=rate, burst=1)
    assert _call(guard, "/v1/models")[0] == 200
    status, headers, body = _call(guard, "/v1/models")
    assert status == 429 and body["error"]["type"] == "rate_limit_error"
    assert words in body["error"]["message"] and "per client address" in body["error"]["message"]
    assert int(headers[b"retry-after"]) == max(1, round(1 / rate + 0.49))
    assert _call(guard, "/v1/models", client=("10.0.0.2", 1))[0] == 200   # another address


def test_a_wrong_method_is_typed_as_the_client_s_mistake():
    from conveyor.frontend.core import FrontendCore
    from conveyor.frontend.routes import build_app

    guard = Guard(build_app(FrontendCore(None, 100, 512, "t-", lambda msg: None), ("m",), 4))
    status, _, body = _call(guard, "/v1/completions", method="GET")
    assert status == 405 and body == error_body(405, body["error"]["message"])
    assert body["error"]["type"] == "invalid_request_error"
