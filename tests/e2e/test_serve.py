"""`conveyor serve` end to end on CPU: TP=1 (async scheduling, the default) and TP=3 without
async scheduling equal the in-process LLM without it (sync and async clients, 64 concurrent
requests); streaming, cancellation freeing blocks, malformed frames, and a client written with
plain zmq + msgpack. (The default model has 9 heads: --tp 2 cannot split it. TP > 1 with async
scheduling is checked against TP 1 in test_tp_cpu.py.)
"""
import asyncio
import contextlib
import os
import signal
import time

import pytest
import zmq
from serve_util import alive, start_server

from conveyor import SamplingParams
from conveyor.client import AsyncClient, Client, ServerError
from conveyor.shared.model_files import default_model_path

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not default_model_path().is_file(),
                                                   reason="default model not fetched")]

BASE = ["The capital of France is", "1, 2, 3,", "Hello, my name is", "The sky is",
        "def fib(n):", "Water boils at", "My favourite food is", "Once upon a time"]
PROMPTS = [f"{p}" if i < 8 else f"({i}) {p}" for i, p in enumerate(BASE * 8)]
GREEDY = SamplingParams(temperature=0, max_tokens=8)


@pytest.fixture(scope="module")
def tp1():
    server = start_server("--tp", "1")
    yield server
    server.kill_all()


@pytest.fixture(scope="module")
def tp3():
    server = start_server("--tp", "3", "--frontends", "2", "--no-async-scheduling")
    yield server
    server.kill_all()


@pytest.fixture(scope="module")
def reference(small_llm):
    # one step at a time: the servers, with async scheduling or without, give the same tokens
    return [o.outputs[0].token_ids for o in small_llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def _wait_all_free(client: Client, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while True:
        s = client.stats()
        if (s.num_running == 0 and s.num_free_blocks == s.num_total_blocks) or \
                time.monotonic() > deadline:
            return s
        time.sleep(0.1)


def test_tp1_and_tp3_match_in_process(tp1, tp3, reference):
    with Client(tp1.addresses[0], timeout=120) as c:
        assert [r.token_ids for r in c.generate(PROMPTS, GREEDY)] == reference
    with Client(tp3.addresses[0], timeout=120) as c:
        results = c.generate(PROMPTS, GREEDY)
        assert [r.token_ids for r in results] == reference
        assert all(r.finish_reason == "length" and r.text for r in results)

    async def run_async():
        async with AsyncClient(tp3.addresses[1]) as ac:
            return await asyncio.wait_for(ac.generate(PROMPTS, GREEDY), 120)
    assert [r.token_ids for r in asyncio.run(run_async())] == reference


def test_stream_delivers_tokens_as_produced_and_cancel_frees_blocks(tp1):
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    with Client(tp1.addresses[0], timeout=60) as c:
        deltas = []
        for d in c.stream("Once upon a time", SamplingParams(temperature=0, max_tokens=24,
                                                              ignore_eos=True)):
            deltas.append(d)
        assert deltas[0].finish_reason is None and deltas[-1].finish_reason == "length"
        assert sum(len(d.token_ids) for d in deltas) == 24 and len(deltas) >= 12
        for i, _ in enumerate(c.stream("Tell me a long story", params)):
            if i == 3:
                break                            # leaving the stream cancels the request
        s = _wait_all_free(c)
        assert s.num_free_blocks == s.num_total_blocks and s.integrity_ok and s.num_running == 0


def test_async_cancel_frees_blocks(tp1):
    async def run():
        async with AsyncClient(tp1.addresses[0]) as ac:
            params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
            task = asyncio.create_task(ac.generate("Tell me a long story", params))
            async with contextlib.aclosing(ac.stream("Another story", params)) as stream:
                async for _ in stream:
                    break
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            for _ in range(100):
                s = await ac.stats()
                if s.num_running == 0 and s.num_free_blocks == s.num_total_blocks:
                    return s
                await asyncio.sleep(0.1)
            return s
    s = asyncio.run(run())
    assert s.num_free_blocks == s.num_total_blocks and s.integrity_ok and s.num_running == 0


def _dealer(ctx: zmq.Context, address: str, timeout_ms: int) -> zmq.Socket:
    """A bare client socket, as a client in another language would open one."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
    sock.connect(address)
    return sock


def test_malformed_frames_get_errors_and_server_keeps_serving(tp1):
    import msgpack
    ctx = zmq.Context()
    sock = _dealer(ctx, tp1.addresses[0], 10000)
    try:
        bad = [[os.urandom(40)], [b"\x63", b"junk"], [b"\x04", msgpack.packb([1, [], [], []])],
               [b"\x0a", msgpack.packb({"id": 5})], [b"\x0a", b"\xc1\xc1"],
               [b"\x0a", msgpack.packb({"id": "x", "prompt": "hi",
                                        "sampling": {"temperature": -1}})]]
        for frames in bad:
            sock.send_multipart(frames)
            tag, body = sock.recv_multipart()
            assert tag == b"\x0e", frames           # ErrorReply
            assert msgpack.unpackb(body)["error"]
        # oversized: the server drops the frame (and the connection); it keeps serving
        big = ctx.socket(zmq.DEALER)
        big.setsockopt(zmq.LINGER, 0)
        big.connect(tp1.addresses[0])
        big.send_multipart([b"\x0a", b"\0" * ((64 << 20) + 1024)])
        time.sleep(0.5)
        big.close()
    finally:
        sock.close()
        ctx.term()
    with Client(tp1.addresses[0], timeout=60) as c:
        assert c.generate("The sky is", GREEDY).text


def test_plain_zmq_and_msgpack_client(tp1):
    import msgpack
    ctx = zmq.Context()
    sock = _dealer(ctx, tp1.addresses[0], 60000)
    try:
        request = {"id": "a", "prompt": "The capital of France is", "stream": True,
                   "sampling": {"temperature": 0, "max_tokens": 8}}
        sock.send_multipart([bytes([10]), msgpack.packb(request)])
        text, tokens, finished = "", [], False
        while not finished:
            tag, body = sock.recv_multipart()
            assert tag == bytes([13])            # GenerateOutput
            out = msgpack.unpackb(body)
            assert out["id"] == "a"
            for c in out["outputs"]:
                text += c.get("text", "")
                tokens += c.get("token_ids", [])
            finished = out.get("finished", False)
        sock.send_multipart([bytes([12]), msgpack.packb({})])   # StatsRequest
        tag, body = sock.recv_multipart()
        assert tag == bytes([9]) and msgpack.unpackb(body)["num_total_blocks"] > 0
    finally:
        sock.close()
        ctx.term()
    with Client(tp1.addresses[0], timeout=60) as c:
        r = c.generate("The capital of France is", GREEDY)
    assert (r.text, r.token_ids) == (text, tokens)


def test_killing_a_tp_worker_fails_open_requests(tp3):
    params = SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True)
    with Client(tp3.addresses[0], timeout=10) as c:
        stream = c.stream("Tell me a long story", params)
        next(stream)
        start = time.monotonic()
        os.kill(tp3.children["conveyor::worker-1"], signal.SIGKILL)
        with pytest.raises(ServerError):
            for d in stream:
                if d.finish_reason == "error":
                    assert "worker-1" in d.error
                    raise ServerError(d.error)
        assert time.monotonic() - start < 10
    assert tp3.proc.wait(20) != 0
    assert "worker-1" in tp3.proc.stderr.read()
    time.sleep(0.5)
    assert not [name for name, pid in tp3.children.items() if alive(pid)]


def test_sigterm_stops_everything_cleanly(tp1):
    tp1.proc.send_signal(signal.SIGTERM)
    assert tp1.proc.wait(30) == 0
    time.sleep(0.5)
    assert not [name for name, pid in tp1.children.items() if alive(pid)]
