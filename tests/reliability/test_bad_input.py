"""Fuzzing the HTTP API and the ZMQ client port (random bytes; every field of a valid request
set to wrong types, huge, negative, NaN/Infinity, deeply nested or invalid UTF-8 values; oversized
bodies, headers and frames; wrong frame counts and tags; internal message types; slowloris and
non-reading clients; huge n and max_tokens; prompts at and beyond the context): no process
dies, no client mistake gets a 5xx, every probe is answered in time, and the greedy answers sent
right after equal the offline API's. Then one test per product bug the fuzzing found (each
once took the server down or leaked a request).
Long version: scripts/stress.py --scenario bad-input."""
import httpx
import msgspec
import pytest
import zmq

from benchmarks.stresskit.clients import greedy, zmq_exchange
from benchmarks.stresskit.fuzz import bad_input, deep_msgpack_request
from benchmarks.stresskit.harness import launch, stats
from conveyor import SamplingParams
from conveyor.outputs import RequestOutput
from conveyor.shared.messages import encode
from conveyor.shared.messages.client import ErrorReply, GenerateRequest
from conveyor.shared.model_files import default_model_path

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not default_model_path().is_file(),
                                                   reason="default model not fetched")]


@pytest.fixture(scope="module")
def server():
    with launch("--max-num-seqs", "16", "--max-n", "8") as s:
        yield s


def test_fuzzing_never_gets_a_5xx_a_crash_or_a_hang(server):
    r = bad_input(server, sample=0.5)         # half the one-field mutations
    assert r.problems == [], r
    assert r.lost == 0 and r.sent > 1000
    answers = r.notes["answers"]
    assert answers["http 400"] > 500 and answers["zmq ErrorReply 400"] > 300, answers
    assert not [a for a in answers if a.split()[-1].startswith("5")], answers


@pytest.mark.parametrize("route", ["/v1/completions", "/tokenize"])
@pytest.mark.parametrize("deep", ['{"a":' * 1000 + "1" + "}" * 1000, "[" * 1000 + "]" * 1000])
def test_deeply_nested_json_is_a_400(server, route, deep):
    body = '{"prompt": "Hi", "max_tokens": 1, "unknown": ' + deep + "}"
    r = httpx.post(server.http + route, content=body, timeout=30)
    assert r.status_code == 400, r.text


def test_zmq_n_is_capped_like_http(server):
    ctx = zmq.Context()
    try:
        request = GenerateRequest(id="n", prompt="Hi", sampling=SamplingParams(
            n=9, max_tokens=1))                  # the server's --max-n is 8
        replies, answered = zmq_exchange(ctx, server, encode(request), 60)
    finally:
        ctx.destroy(linger=0)
    assert answered and isinstance(replies[-1], ErrorReply), replies
    assert replies[-1].code == 400


def test_ints_beyond_64_bits_are_a_400_and_leave_nothing_open(server):
    for field, value in (("seed", 2 ** 64), ("priority", -2 ** 63 - 1), ("top_k", 2 ** 64),
                         ("stop_token_ids", [2 ** 64])):
        body = {"prompt": "Hi", "max_tokens": 2, field: value}
        r = httpx.post(server.http + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 400, (field, r.status_code, r.text)
    assert stats(server).frontend_open_requests == 0


# --- bugs that once stopped the server they hit: a server of their own -------------------------

@pytest.fixture(scope="module")
def fragile():
    """Shared by the bug tests: each checks that it still serves after its probe."""
    with launch("--max-num-seqs", "4") as s:
        yield s


def _survives(server, frames: list[bytes]) -> None:
    """The frames are answered, and the server still serves."""
    ctx = zmq.Context()
    try:
        replies, answered = zmq_exchange(ctx, server, frames, 15)
        assert answered, server.stderr()[-2000:]
        assert isinstance(replies[-1], ErrorReply) or all(
            c.finish_reason != "error" for c in replies[-1].outputs), replies
        again, _ = zmq_exchange(ctx, server, encode(GenerateRequest(
            id="t", prompt="Hi", sampling=greedy(2))), 60)
    finally:
        ctx.destroy(linger=0)
    assert server.proc.poll() is None, server.stderr()[-2000:]
    assert isinstance(again[-1], RequestOutput) and again[-1].outputs[0].finish_reason == "length"


def test_a_seed_that_overflows_for_the_second_sample_does_not_kill_the_server(fragile):
    body = {"id": "s", "prompt": "Hi", "sampling": {"seed": 2 ** 64 - 1, "n": 2,
                                                    "max_tokens": 2}}
    _survives(fragile, [bytes([10]), msgspec.msgpack.encode(body)])


def test_deeply_nested_msgpack_is_an_error_reply_not_a_crash(fragile):
    _survives(fragile, [bytes([10]), deep_msgpack_request()])
