"""CurveZMQ with a client allowlist: with DIR/clients/ present, `serve --zmq-curve-keys DIR`
admits only clients whose public key is in one of its *.key certificates; the server refuses the
others' handshake and they see the connection drop. A client proves its key with `client_key=`
(its .key_secret file)."""
import asyncio
import time

import pytest
import zmq.auth
from models_util import make_tiny_model
from serve_util import start_server

from conveyor import SamplingParams
from conveyor.client import AsyncClient, Client, ServerError

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def allowlisted(tmp_path_factory):
    root = tmp_path_factory.mktemp("curve")
    keys, clients, own = root / "keys", root / "keys" / "clients", root / "client-side"
    clients.mkdir(parents=True)
    own.mkdir()
    zmq.auth.create_certificates(own, "alice")          # alice keeps her secret...
    (clients / "alice.key").write_bytes((own / "alice.key").read_bytes())  # ...and hands in this
    zmq.auth.create_certificates(own, "mallory")        # never allowed
    model = make_tiny_model("llama", root / "llama", max_position_embeddings=512)
    server = start_server("--model", str(model), "--skip-tokenizer-init", "--port", "-1",
                          "--zmq-curve-keys", str(keys))
    try:
        yield server.addresses[0], keys / "server.key", own
    finally:
        server.kill_all()


def test_an_allowed_client_is_served(allowlisted):
    address, server_key, own = allowlisted
    with Client(address, server_public_key=server_key, client_key=own / "alice.key_secret",
                timeout=60) as client:
        assert len(client.generate([[1, 2, 3]], GREEDY)[0].token_ids) == 4


@pytest.mark.parametrize("who", ["mallory", None])
def test_other_clients_are_refused(allowlisted, who):
    address, server_key, own = allowlisted
    key = own / f"{who}.key_secret" if who else None    # None: a fresh keypair
    with Client(address, server_public_key=server_key, client_key=key, timeout=30) as client:
        with pytest.raises(ServerError, match="lost the connection"):
            client.generate([[1, 2, 3]], GREEDY)
        with pytest.raises(ServerError, match="lost the connection"):   # at once, no send
            client.stats()


def test_an_async_client_refused_fails_now_and_on_later_calls(allowlisted):
    address, server_key, _ = allowlisted

    async def run():
        async with AsyncClient(address, server_public_key=server_key) as client:
            with pytest.raises(ServerError, match="lost the connection"):
                await client.generate([1, 2, 3], GREEDY)
            for call in (client.generate([1, 2, 3], GREEDY), client.stats()):
                with pytest.raises(ServerError, match="lost the connection"):
                    await call

    asyncio.run(asyncio.wait_for(run(), 30))


@pytest.mark.timeout(60)
def test_a_refusal_before_the_constructor_returns_is_seen(allowlisted, monkeypatch):
    """The server may refuse the handshake before Client() returns (a loaded machine): the
    disconnect must still reach the client (its monitor is attached before it connects), and
    its first send must not block (the refused connection may already be gone, and a DEALER
    with none waits forever to send; whether it is gone yet varies, hence five tries)."""
    address, server_key, own = allowlisted
    connect = zmq.Socket.connect

    def slow_connect(sock, addr):
        result = connect(sock, addr)
        if addr == address:
            time.sleep(0.5)              # the refusal (milliseconds) lands in the constructor
        return result

    async def refused_async():
        async with AsyncClient(address, server_public_key=server_key) as client:
            with pytest.raises(ServerError, match="lost the connection"):
                await client.stats()

    monkeypatch.setattr(zmq.Socket, "connect", slow_connect)
    for _ in range(5):
        with Client(address, server_public_key=server_key, timeout=15) as client:
            with pytest.raises(ServerError, match="lost the connection"):
                client.generate([[1, 2, 3]], GREEDY)
            with pytest.raises(ServerError, match="lost the connection"):
                client.stats()
        asyncio.run(refused_async())


def test_a_client_key_must_be_a_secret_certificate(allowlisted, tmp_path):
    address, server_key, own = allowlisted
    with pytest.raises(ValueError, match="no secret key"):
        Client(address, server_public_key=server_key, client_key=own / "alice.key")
    with pytest.raises(ValueError, match="needs server_public_key"):
        AsyncClient(address, client_key=own / "alice.key_secret")
