"""The ZMQ engine port is closed to other hosts by default, and opened beyond loopback only with
CurveZMQ and a list of admitted clients (docs/SECURITY.md). Reached from a non-loopback address
of this machine, as another host would reach it."""
import socket
import stat
import subprocess
import sys

import pytest
import zmq
import zmq.auth
from serve_util import start_server

from conveyor import SamplingParams
from conveyor.client import Client, ServerError
from conveyor.shared.engine_port import is_loopback, secure_engine_port
from conveyor.shared.messages import decode, encode
from conveyor.shared.messages.client import GenerateRequest
from conveyor.shared.model_files import default_model_path

needs_model = pytest.mark.skipif(not default_model_path().is_file(),
                                 reason="default model not fetched")
GREEDY = SamplingParams(temperature=0, max_tokens=2)


def _outside_address() -> str | None:
    """An address of this machine that is not loopback (as another host would connect to)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))          # no packet is sent; picks the route's address
            ip = s.getsockname()[0]
        except OSError:
            return None
    return None if ip.startswith("127.") else ip


def _elsewhere(address: str, ip: str) -> str:
    return f"tcp://{ip}:{address.rsplit(':', 1)[1]}"


def _plain_request_answered(address: str, timeout_ms: int = 3000) -> bool:
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        sock.send_multipart(encode(GenerateRequest(id="x", prompt="Hi", sampling=GREEDY)))
        if not sock.poll(timeout_ms):
            return False
        decode(sock.recv_multipart())
        return True
    finally:
        ctx.destroy(linger=0)


def test_loopback_is_told_from_other_addresses():
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("0.0.0.0") and not is_loopback("::") and not is_loopback("10.1.2.3")
    assert not is_loopback("no-such-host.invalid")


def test_beyond_loopback_the_port_needs_admitted_client_keys(tmp_path):
    keys = tmp_path / "keys"
    assert secure_engine_port("127.0.0.1", None) == (None, None)
    with pytest.raises(ValueError, match=r"clients/"):
        secure_engine_port("0.0.0.0", str(keys))
    (keys / "clients").mkdir(parents=True)
    with pytest.raises(ValueError, match="admit any client"):          # an empty list
        secure_engine_port("0.0.0.0", str(keys))
    zmq.auth.create_certificates(tmp_path, "alice")
    (keys / "clients" / "alice.key").write_bytes((tmp_path / "alice.key").read_bytes())
    folder, note = secure_engine_port("0.0.0.0", str(keys))
    public, _ = zmq.auth.load_certificate(keys / "server.key")
    assert folder == str(keys) and public.decode() in note and "1 client key" in note
    for name in ("server.key", "server.key_secret"):
        assert stat.S_IMODE((keys / name).stat().st_mode) == 0o600
    assert stat.S_IMODE(keys.stat().st_mode) == 0o700
    assert secure_engine_port("0.0.0.0", str(keys))[1] == note           # the same keys again


def test_the_default_keys_folder_is_in_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CONVEYOR_CACHE", str(tmp_path))
    with pytest.raises(ValueError, match=str(tmp_path / "zmq-keys" / "clients")):
        secure_engine_port("0.0.0.0", None)


@needs_model
@pytest.mark.slow
def test_a_server_refuses_to_open_the_port_to_all_without_client_keys(tmp_path):
    r = subprocess.run([sys.executable, "-m", "conveyor.cli", "serve", "--zmq-host", "0.0.0.0",
                        "--zmq-curve-keys", str(tmp_path / "keys"), "--port", "0"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "beyond this host" in r.stderr and "clients/" in r.stderr, r
    assert "Traceback" not in r.stderr


@needs_model
@pytest.mark.slow
def test_started_as_the_manifest_starts_it_the_engine_port_is_closed_to_other_hosts():
    ip = _outside_address()
    if ip is None:
        pytest.skip("this machine has no address beyond loopback")
    server = start_server("--host", "0.0.0.0")            # the manifest's flags
    try:
        assert _plain_request_answered(server.addresses[0])
        assert not _plain_request_answered(_elsewhere(server.addresses[0], ip))
    finally:
        server.kill_all()


@needs_model
@pytest.mark.slow
def test_opened_to_other_hosts_only_admitted_clients_get_anything(tmp_path):
    ip = _outside_address()
    if ip is None:
        pytest.skip("this machine has no address beyond loopback")
    keys, own = tmp_path / "keys", tmp_path / "client-side"
    (keys / "clients").mkdir(parents=True)
    own.mkdir()
    zmq.auth.create_certificates(own, "alice")
    (keys / "clients" / "alice.key").write_bytes((own / "alice.key").read_bytes())
    zmq.auth.create_certificates(own, "mallory")
    server = start_server("--zmq-host", "0.0.0.0", "--zmq-curve-keys", str(keys), "--port", "-1")
    try:
        address = _elsewhere(server.addresses[0], ip)
        assert not _plain_request_answered(address)                      # no CurveZMQ at all
        with Client(address, server_public_key=keys / "server.key",
                    client_key=own / "mallory.key_secret", timeout=15) as c:
            with pytest.raises(ServerError, match="lost the connection"):
                c.generate("Hi", GREEDY)
        with Client(address, server_public_key=keys / "server.key",
                    client_key=own / "alice.key_secret", timeout=60) as c:
            assert c.generate("Hi", GREEDY).outputs[0].finish_reason == "length"
    finally:
        server.kill_all()
