"""The claims of docs/SECURITY.md that a test can check, against a real server with API keys,
CurveZMQ on the client port and three tensor-parallel workers (so torch.distributed runs too):
what listens where, the private runtime directory, keys on every route but /health, keys compared
in full against every key, header and frame caps, CurveZMQ, and no pickle anywhere."""
import ast
import hmac
import os
import pickle
import stat
from pathlib import Path

import httpx
import pytest
import zmq

from benchmarks.stresskit.clients import zmq_exchange
from benchmarks.stresskit.fuzz import oversized_zmq_frame, raw_http
from benchmarks.stresskit.harness import Report, launch, stats
from conveyor.frontend.guard import ROUTES
from conveyor.shared.messages import MESSAGE_TYPES, encode
from conveyor.shared.messages.client import ErrorReply
from conveyor.shared.messages.engine import Stats, StatsRequest
from conveyor.shared.model_files import default_model_path

needs_model = pytest.mark.skipif(not default_model_path().is_file(),
                                 reason="default model not fetched")
KEY = "sk-security-test"
PACKAGE = Path(__file__).resolve().parents[2] / "conveyor"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    keys = tmp_path_factory.mktemp("curve")
    with launch("--tp", "3", "--device", "cpu", "--max-num-seqs", "4", api_key=KEY,
                curve_keys=keys) as s:
        yield s


def _pids(server) -> list[int]:
    return [server.proc.pid, *server.children.values()]


def _socket_inodes(pids: list[int]) -> set[str]:
    inodes = set()
    for pid in pids:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    return inodes


def _address(hex_ip: str) -> str:
    raw = bytes.fromhex(hex_ip)
    if len(raw) == 4:
        return ".".join(str(b) for b in reversed(raw))
    words = [raw[i:i + 4][::-1] for i in range(0, 16, 4)]     # four little-endian words
    ip6 = b"".join(words)
    if ip6[:12] == b"\0" * 10 + b"\xff\xff":
        return ".".join(str(b) for b in ip6[12:])             # IPv4-mapped
    return ":".join(ip6[i:i + 2].hex() for i in range(0, 16, 2))


def _listening(server) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket in LISTEN held by the server's processes."""
    inodes = _socket_inodes(_pids(server))
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:
                    ip, port = fields[1].split(":")
                    found.append((_address(ip), int(port, 16)))
    return found


LOOPBACK = ("127.0.0.1", "0000:0000:0000:0000:0000:0000:0000:0001")


@needs_model
@pytest.mark.slow
def test_client_ports_listen_on_loopback_only_by_default(server):
    ports = {int(a.rsplit(":", 1)[1]) for a in [server.http, *server.zmq]}
    listening = _listening(server)
    mine = [(ip, port) for ip, port in listening if port in ports]
    assert {port for _, port in mine} == ports, listening
    assert all(ip in LOOPBACK for ip, _ in mine), mine


@needs_model
@pytest.mark.slow
def test_nothing_listens_beyond_loopback(server):
    listening = _listening(server)
    assert listening and all(ip in LOOPBACK for ip, _ in listening), listening


@needs_model
@pytest.mark.slow
def test_internal_sockets_live_in_a_private_directory(server):
    inodes = _socket_inodes(_pids(server))
    paths = []
    with open("/proc/net/unix") as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            if len(fields) >= 8 and fields[6] in inodes and not fields[7].startswith("@"):
                paths.append(Path(fields[7]))
    assert {"launcher", "scheduler", "results", "frontend-0", "worker-0", "worker-2"} <= {
        p.name for p in paths}
    [run] = {p.parent for p in paths}            # one folder holds them all
    info = run.stat()
    assert stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == os.getuid(), oct(info.st_mode)
    assert run.name.startswith("conveyor-")


@needs_model
@pytest.mark.slow
def test_every_route_but_the_probes_needs_the_key(server):
    from conveyor.frontend.core import FrontendCore
    from conveyor.frontend.guard import OPEN_PATHS
    from conveyor.frontend.routes import build_app

    app = build_app(FrontendCore(None, 100, 512, "t-", lambda msg: None), ("m",), 4)
    routes = sorted((r.path, m) for r in app.routes for m in r.methods)
    assert {path for path, _ in routes} == ROUTES       # a new route must be classified
    for path, method in routes + [("/admin", "GET"), ("/v1/nothing", "POST")]:
        without, wrong, right = (
            httpx.request(method, server.http + path, json={}, timeout=30,
                          headers={"Authorization": f"Bearer {key}"} if key else {}).status_code
            for key in (None, KEY + "x", KEY))
        if path in OPEN_PATHS:
            assert without != 401 and wrong != 401, path
        else:
            assert without == wrong == 401, (path, without, wrong)
        assert right != 401, (path, right)


def test_api_keys_are_compared_in_full_against_every_key(monkeypatch):
    from conveyor.frontend.guard import Guard

    calls = []
    real = hmac.compare_digest
    monkeypatch.setattr(hmac, "compare_digest",
                        lambda a, b: calls.append((len(a), len(b))) or real(a, b))
    keys = ("short", "a-much-longer-key-" * 8, "third")
    guard = Guard(None, keys)
    for candidate, ok in (("short", True), ("third", True), ("", False), ("shor", False),
                          ("x" * 5000, False), (keys[1], True)):
        calls.clear()
        scope = {"headers": [(b"authorization", f"Bearer {candidate}".encode())]}
        assert (guard._check(scope, "/v1/models") is None) == ok, candidate
        assert calls == [(32, 32)] * len(keys), candidate      # every key, digests only


@needs_model
@pytest.mark.slow
def test_headers_over_the_limit_are_refused_and_the_server_survives(server):
    head = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
    # NOTE: h11 refuses a header block still incomplete past 16 KiB; one that arrives whole in
    # a single read is parsed (a read is at most 256 KiB), so the big ones come in two parts
    for big, rest in ((b"\r\nX-Big: " + b"a" * 20_000, b"\r\n\r\n"),
                      (b"\r\nX-Big: " + b"a" * 1_000_000, b"\r\n\r\n"),
                      (b"".join(b"\r\nX-%d: %s" % (i, b"b" * 100) for i in range(300)),
                       b"\r\n\r\n")):
        try:
            status = raw_http(server, head + big, 30, then=rest)
        except ConnectionError:
            status = None                        # cut before it could answer: also a refusal
        assert status in (None, 400, 431), status
    r = httpx.get(server.http + "/v1/models", headers=server.headers, timeout=30)
    assert r.status_code == 200 and server.proc.poll() is None


@needs_model
@pytest.mark.slow
def test_the_zmq_port_drops_a_65_mib_frame_and_keeps_serving(server):
    report = Report("oversized")
    oversized_zmq_frame(server, report)
    assert report.problems == []
    assert stats(server).integrity_ok and server.proc.poll() is None


@needs_model
@pytest.mark.slow
def test_curve_refuses_a_client_without_the_server_key(server):
    ctx = zmq.Context()
    try:
        plain = ctx.socket(zmq.DEALER)
        plain.setsockopt(zmq.LINGER, 0)
        plain.connect(server.zmq[0])
        plain.send_multipart(encode(StatsRequest()))
        assert not plain.poll(2000)              # the handshake never completes
        plain.close()
        replies, answered = zmq_exchange(ctx, server, encode(StatsRequest()), 30)
        assert answered and isinstance(replies[0], Stats)
    finally:
        ctx.destroy(linger=0)


class _Marker:
    """Unpickling this creates the file `path` (open(path, "w")): proof that it was unpickled."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return open, (str(self.path), "w")


@needs_model
@pytest.mark.slow
def test_pickle_payloads_on_every_public_socket_are_never_unpickled(server, tmp_path):
    marker = tmp_path / "unpickled"
    payloads = [pickle.dumps(_Marker(marker), protocol=p)
                for p in range(pickle.HIGHEST_PROTOCOL + 1)]
    for path in sorted(ROUTES):
        for payload in payloads:
            for kind in ("application/json", "application/python-pickle"):
                r = httpx.post(server.http + path, content=payload, timeout=30,
                               headers={**server.headers, "Content-Type": kind})
                # POST /ping is a probe (as vLLM's): it reads no body and answers 200
                assert r.status_code < 500 and (r.status_code != 200 or path == "/ping"), (
                    path, r.status_code)
    ctx = zmq.Context()
    try:
        for payload in payloads:
            for frames in ([payload], [payload, payload],
                           *([bytes([t]), payload] for t in range(1, len(MESSAGE_TYPES) + 1))):
                replies, answered = zmq_exchange(ctx, server, frames, 30, whole=False)
                assert answered and isinstance(replies[0], ErrorReply), (frames[0], replies)
                assert replies[0].code == 400
    finally:
        ctx.destroy(linger=0)
    assert not marker.exists()
    assert server.proc.poll() is None and stats(server).integrity_ok
    pickle.loads(pickle.dumps(_Marker(tmp_path / "control")))      # the payload does work
    assert (tmp_path / "control").exists()


def test_no_module_of_the_package_can_unpickle():
    banned = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "marshal", "shelve",
              "joblib"}
    found = []
    for file in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(file.read_text(), str(file))):
            if isinstance(node, ast.Import):
                names = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [(node.module or "").split(".")[0]]
            elif isinstance(node, ast.Attribute) and node.attr == "load" and isinstance(
                    node.value, ast.Name) and node.value.id in ("torch", "np", "numpy"):
                names = [f"{node.value.id}.load"]          # both can unpickle
            else:
                continue
            found += [f"{file.relative_to(PACKAGE)}: {n}" for n in names
                      if n in banned or n.endswith(".load")]
    assert found == []
