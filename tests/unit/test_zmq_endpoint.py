"""The ZMQ client endpoint alone (a real ROUTER, a FrontendCore whose engine is a list): the
per-connection limits, and a closed connection's requests aborted in the engine."""
import asyncio

import pytest
import zmq
import zmq.asyncio

from conveyor.frontend import zmq_endpoint
from conveyor.frontend.core import READY, FrontendCore
from conveyor.frontend.tokenizer import load_tokenizer
from conveyor.frontend.zmq_endpoint import ZmqEndpoint
from conveyor.shared.messages import decode, encode
from conveyor.shared.messages.client import CancelRequest, ErrorReply, GenerateRequest
from conveyor.shared.messages.engine import Abort, AddRequest, Stats, StatsRequest
from conveyor.shared.model_files import default_model_path, resolve_model
from conveyor.shared.sampling_params import SamplingParams
from conveyor.shared.sockets import Socket, ipc

pytestmark = pytest.mark.skipif(not default_model_path().is_file(),
                                reason="default model not fetched (make model)")


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(resolve_model(None))


def _run(tok, tmp_path, script):
    """Serve an endpoint on ipc; script(client, sent, core) drives a DEALER against it."""
    sent = []

    async def main():
        actx = zmq.asyncio.Context()
        core = FrontendCore(tok, len(tok), 512, "f-", sent.append, state=READY)
        router = Socket(actx, zmq.ROUTER, ipc(tmp_path, "clients"), bind=True,
                        allowed=(GenerateRequest, CancelRequest, StatsRequest))
        serving = asyncio.ensure_future(ZmqEndpoint(router, core).serve())
        client = actx.socket(zmq.DEALER)
        client.setsockopt(zmq.LINGER, 0)
        client.connect(ipc(tmp_path, "clients"))
        try:
            await script(client, sent, core)
        finally:
            serving.cancel()
            client.close(0)
            router.close()
            actx.destroy(0)

    asyncio.run(main())
    return sent


async def _reply(client, timeout=5.0):
    assert await client.poll(int(timeout * 1000)), "no reply"
    return decode(await client.recv_multipart())


async def _settle(predicate, timeout=5.0):
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        assert loop.time() < deadline
        await asyncio.sleep(0.01)


def test_one_stats_request_at_a_time_per_connection(tok, tmp_path):
    async def script(client, sent, core):
        await client.send_multipart(encode(StatsRequest()))
        await client.send_multipart(encode(StatsRequest()))
        refusal = await _reply(client)
        assert isinstance(refusal, ErrorReply) and refusal.code == 429
        assert sent == [StatsRequest()]               # one question to the engine
        core.on_stats(Stats(num_running=1))
        answer = await _reply(client)
        assert isinstance(answer, Stats) and answer.num_running == 1
        await client.send_multipart(encode(StatsRequest()))     # the next one is welcome
        await _settle(lambda: len(sent) == 2)

    _run(tok, tmp_path, script)


def test_open_requests_per_connection_are_capped(tok, tmp_path, monkeypatch):
    monkeypatch.setattr(zmq_endpoint, "MAX_OPEN_PER_CLIENT", 2)

    async def script(client, sent, core):
        for i in range(3):
            await client.send_multipart(encode(GenerateRequest(
                id=f"r{i}", prompt="Hi", sampling=SamplingParams(max_tokens=4))))
        refusal = await _reply(client)
        assert isinstance(refusal, ErrorReply) and refusal.id == "r2" and refusal.code == 429
        assert [type(m) for m in sent] == [AddRequest, AddRequest]
        await client.send_multipart(encode(CancelRequest("r0")))   # room again
        await client.send_multipart(encode(GenerateRequest(id="r3", prompt="Hi")))
        await _settle(lambda: sum(isinstance(m, AddRequest) for m in sent) == 3)

    _run(tok, tmp_path, script)


def test_a_closed_connection_has_its_requests_aborted(tok, tmp_path):
    async def script(client, sent, core):
        for i in range(2):
            await client.send_multipart(encode(GenerateRequest(id=f"r{i}", prompt="Hi")))
        await _settle(lambda: len(core.open) == 2)
        client.close(0)
        await _settle(lambda: not core.open)
        aborted = {i for m in sent if isinstance(m, Abort) for i in m.ids}
        assert aborted == {f"{rid}/0" for rid in ("f-0", "f-1")}

    _run(tok, tmp_path, script)


def test_a_long_prompt_cancelled_while_it_is_tokenized_never_runs(tok, tmp_path):
    async def script(client, sent, core):
        prompt = "word " * 6000                              # 30k characters: a thread
        await client.send_multipart(encode(GenerateRequest(id="long", prompt=prompt)))
        await client.send_multipart(encode(CancelRequest("long")))
        await asyncio.sleep(1.0)                             # the tokenizer thread is done
        assert not core.open                                 # submitted, then cancelled
        added = [m.id for m in sent if isinstance(m, AddRequest)]
        aborted = [i for m in sent if isinstance(m, Abort) for i in m.ids]
        assert added == aborted

    _run(tok, tmp_path, script)
