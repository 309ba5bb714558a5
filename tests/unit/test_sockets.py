"""The socket helper: typed round trips, malformed frames as ErrorReplies, CurveZMQ, the
private runtime directory."""
import os
import stat

import pytest
import zmq

from conveyor.client import _close_socket, _socket
from conveyor.shared.messages import encode
from conveyor.shared.messages.client import ErrorReply, GenerateRequest
from conveyor.shared.messages.engine import Abort
from conveyor.shared.sockets import (
    Socket,
    ipc,
    load_curve_keys,
    make_runtime_dir,
    remove_runtime_dir,
    remove_stale_runtime_dirs,
)


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


def test_router_dealer_round_trip_and_malformed_frames(ctx, tmp_path):
    server = Socket(ctx, zmq.ROUTER, ipc(tmp_path, "s"), bind=True, allowed=(GenerateRequest,))
    client = Socket(ctx, zmq.DEALER, ipc(tmp_path, "s"), bind=False)
    client.send(GenerateRequest(id="a", prompt="hi"))
    peer, msg = server.recv()
    assert isinstance(msg, GenerateRequest) and msg.prompt == "hi"
    for frames in ([b"junk"], encode(Abort(ids=["x"])), [b"\x0a", b"\x81\xa2id\x01"],
                   [b"\x0a", b"\xc1"]):
        client.send_frames(frames)
        _, msg = server.recv()
        assert isinstance(msg, ErrorReply)
    assert msg.id is None
    client.send_frames([b"\x0a", b"\x82\xa2id\xa1q\xa6stream\xa1x"])   # id readable, stream bad
    assert server.recv()[1].id == "q"


def test_curve_server_accepts_clients_that_know_its_key(ctx, tmp_path):
    keys = load_curve_keys(tmp_path / "keys")
    assert load_curve_keys(tmp_path / "keys") == keys           # created once, then reused
    server = Socket(ctx, zmq.ROUTER, "tcp://127.0.0.1:*", bind=True, curve_keys=keys)
    client, monitor = _socket(ctx, server.address, tmp_path / "keys" / "server.key")
    client.send_multipart(encode(GenerateRequest(id="c", prompt="x")))
    assert server.sock.poll(5000) and server.recv()[1].id == "c"
    _close_socket(client, monitor, 0)


def test_runtime_dir_is_private_and_removed():
    path = make_runtime_dir()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o700
    remove_runtime_dir(path)
    assert not path.exists()


def test_a_shared_http_port_is_never_shared_between_instances():
    import socket

    from conveyor.shared.sockets import reserve_shared_port, tcp_listener

    first = reserve_shared_port("127.0.0.1", 0)
    try:
        port = first.getsockname()[1]
        with pytest.raises(OSError):
            reserve_shared_port("127.0.0.1", port)          # a second instance: refused
        others = [reserve_shared_port("127.0.0.1", 0) for _ in range(20)]
        assert port not in {s.getsockname()[1] for s in others}
        for s in others:
            s.close()
        frontend = tcp_listener("127.0.0.1", port)           # this instance's frontends join
        frontend.listen()
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
        frontend.close()
    finally:
        first.close()


def test_a_flood_of_malformed_frames_logs_one_line_then_the_count(ctx, tmp_path, caplog,
                                                                   monkeypatch):
    from conveyor.shared import sockets

    server = Socket(ctx, zmq.ROUTER, ipc(tmp_path, "s"), bind=True, allowed=(GenerateRequest,))
    client = Socket(ctx, zmq.DEALER, ipc(tmp_path, "s"), bind=False)
    with caplog.at_level("WARNING", logger="conveyor.shared.sockets"):
        for _ in range(50):
            client.send_frames([b"junk"])
            assert isinstance(server.recv()[1], ErrorReply)   # every one still answered
        assert len(caplog.records) == 1
        monkeypatch.setattr(sockets, "WARN_EVERY_S", 0.0)     # the window has passed
        client.send_frames([b"junk"])
        server.recv()
    assert len(caplog.records) == 2
    assert "(49 more since the last warning)" in caplog.records[1].getMessage()


@pytest.mark.timeout(30)
def test_a_client_with_no_connection_left_never_blocks_on_a_send():
    """A DEALER with no connection cannot take a frame (a refused handshake can leave a client
    so): generate and stats wait at most the client's timeout, then raise; close returns."""
    from conveyor.client import Client

    client = Client("tcp://127.0.0.1:9", timeout=0.5)
    client._sock.disconnect("tcp://127.0.0.1:9")           # its one connection, gone
    for call in (lambda: client.generate([1, 2, 3]), client.stats):
        with pytest.raises(TimeoutError, match="could not send"):
            call()
    client.close()


def test_stale_runtime_directories_of_dead_launchers_are_removed(tmp_path, monkeypatch):
    import subprocess
    import sys
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    live = make_runtime_dir()                         # names this (running) process
    dead = make_runtime_dir()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    ns = os.readlink("/proc/self/ns/pid")
    (dead / "launcher.pid").write_text(f"{gone.pid} 12345 {ns}")
    reused = make_runtime_dir()                       # our pid, another start time: reused pid
    (reused / "launcher.pid").write_text(f"{os.getpid()} 1 {ns}")
    (dead / "scheduler").write_text("")              # a socket file left by SIGKILL
    foreign = tmp_path / "conveyor-other"            # no owner file: not ours to judge
    foreign.mkdir()
    container = make_runtime_dir()                   # another PID namespace: not ours either
    (container / "launcher.pid").write_text("1 1 pid:[1]")
    assert sorted(remove_stale_runtime_dirs()) == sorted([dead, reused])
    assert live.is_dir() and foreign.is_dir() and container.is_dir()
    assert not dead.exists() and not reused.exists()
