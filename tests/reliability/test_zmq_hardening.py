"""The ZMQ client port as hardened as HTTP: each test replays what an outside attack run did to
one frontend (the only one, so that its death would stop the server) and checks that the damage
stays with the attacker: a malformed conversation, infinite temperature, a 7.8 MB prompt, a
flood of StatsRequests whose replies are never read, and a client that leaves with requests
running."""
import threading
import time

import httpx
import msgspec
import pytest
import zmq

from benchmarks.stresskit.clients import dealer, greedy, zmq_exchange
from benchmarks.stresskit.harness import launch, stats
from conveyor.client import Client
from conveyor.outputs import RequestOutput
from conveyor.shared.messages import decode, encode
from conveyor.shared.messages.client import ErrorReply, GenerateRequest
from conveyor.shared.messages.engine import StatsRequest
from conveyor.shared.model_files import default_model_path

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not default_model_path().is_file(),
                                                   reason="default model not fetched")]


@pytest.fixture(scope="module")
def server():
    with launch("--frontends", "1", "--max-num-seqs", "8") as s:
        yield s


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


def _still_serves(server) -> None:
    assert server.proc.poll() is None, server.stderr()[-2000:]
    with Client(server.zmq[0], timeout=60) as c:
        out = c.generate("The capital of France is", greedy(2))
    assert out.outputs[0].finish_reason == "length"


def _health_s(server) -> float:
    start = time.monotonic()
    assert httpx.get(server.http + "/health", timeout=30).status_code == 200
    return time.monotonic() - start


def test_a_chat_message_without_a_role_is_refused_and_the_frontend_lives(server, ctx):
    body = {"id": "c", "messages": [{"content": "no role"}], "sampling": {"max_tokens": 2}}
    replies, answered = zmq_exchange(ctx, server, [bytes([10]), msgspec.msgpack.encode(body)], 30)
    assert answered and isinstance(replies[-1], ErrorReply), replies
    assert replies[-1].code == 400 and "role" in replies[-1].error
    _still_serves(server)


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
def test_a_non_finite_temperature_is_refused(server, ctx, value):
    body = {"id": "t", "prompt": "Hi", "sampling": {"temperature": value, "max_tokens": 2}}
    replies, answered = zmq_exchange(ctx, server, [bytes([10]), msgspec.msgpack.encode(body)], 30)
    assert answered and isinstance(replies[-1], ErrorReply), replies
    assert replies[-1].code == 400 and "temperature" in replies[-1].error


def test_a_huge_prompt_is_refused_at_once_and_blocks_nobody(server, ctx):
    prompt = "hello world, this is a test. " * 270_000          # 7.8 MB
    sock = dealer(ctx, server)
    start = time.monotonic()
    sock.send_multipart(encode(GenerateRequest(id="big", prompt=prompt, sampling=greedy(2))))
    health = _health_s(server)
    assert sock.poll(30_000)
    reply = decode(sock.recv_multipart())
    took = time.monotonic() - start
    sock.close()
    assert isinstance(reply, ErrorReply) and reply.code == 400, reply
    assert "characters" in reply.error
    assert took < 3 and health < 2, (took, health)


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def test_a_flood_of_unread_stats_requests_starves_nobody_and_holds_bounded_memory(server, ctx):
    frontend = server.children["conveyor::frontend-0"]
    before = _rss_mib(frontend)
    flood = ctx.socket(zmq.DEALER)
    flood.setsockopt(zmq.SNDHWM, 0)           # queue everything; never read a reply
    flood.setsockopt(zmq.RCVHWM, 1)
    flood.setsockopt(zmq.LINGER, 0)
    flood.connect(server.zmq[0])
    frames = encode(StatsRequest())
    sent = 0
    stop = time.monotonic() + 3
    while time.monotonic() < stop:
        for _ in range(1000):
            flood.send_multipart(frames)
        sent += 1000
    worst = 0.0
    done = threading.Event()
    served = []

    def other_client():
        start = time.monotonic()
        with Client(server.zmq[0], timeout=30) as c:
            served.append((c.generate("Hello, my name is", greedy(4)), time.monotonic() - start))
        done.set()

    t = threading.Thread(target=other_client, daemon=True)
    t.start()
    for _ in range(10):                       # while the flood is being read
        worst = max(worst, _health_s(server))
        time.sleep(0.2)
    t.join(60)
    after = _rss_mib(frontend)
    flood.close()
    assert sent >= 20_000, sent
    assert served and served[0][0].outputs[0].finish_reason == "length"
    assert served[0][1] < 10 and worst < 2, (served[0][1], worst)
    assert after - before < 150, (before, after)
    _still_serves(server)


def test_a_client_that_disconnects_has_its_requests_aborted(server, ctx):
    sock = dealer(ctx, server)
    for i in range(4):
        sock.send_multipart(encode(GenerateRequest(id=f"s{i}", prompt="Once upon a time",
                                                   sampling=greedy(400), stream=True)))
    assert sock.poll(30_000)
    assert isinstance(decode(sock.recv_multipart()), RequestOutput)
    assert stats(server).frontend_open_requests == 4
    sock.close(linger=0)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        s = stats(server)
        if s.frontend_open_requests == 0 and s.num_running == 0:
            break
        time.sleep(0.2)
    assert s.frontend_open_requests == 0 and s.num_running == 0, s
    assert s.num_free_blocks == s.num_total_blocks
