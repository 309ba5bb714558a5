"""`conveyor serve` failures: a scheduler or worker killed with SIGKILL fails every open request
within 10 s and ends the launcher non-zero with nothing left behind; a killed frontend loses only
its own requests (their blocks are freed) while the other serves on; start-up failures print
one line."""
import os
import signal
import socket
import time

import pytest
from serve_util import SMALL, alive, run_serve, start_server

from conveyor import SamplingParams
from conveyor.client import Client, ServerError
from conveyor.shared.model_files import default_model_path

needs_model = pytest.mark.skipif(not default_model_path().is_file(),
                                 reason="default model not fetched")
LONG = SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True)


def _fails(stream) -> str:
    try:
        for d in stream:
            if d.finish_reason == "error":
                return d.error
    except ServerError as e:
        return str(e)
    return "no error"


@needs_model
@pytest.mark.slow
@pytest.mark.parametrize("victim", ["scheduler", "worker-0"])
def test_killing_an_engine_child_fails_requests_and_stops_everything(victim):
    server = start_server("--frontends", "2")
    try:
        clients = [Client(a, timeout=10) for a in server.addresses]
        streams = [c.stream("Tell me a long story", LONG) for c in clients]
        for s in streams:
            next(s)
        start = time.monotonic()
        os.kill(server.children[f"conveyor::{victim}"], signal.SIGKILL)
        errors = [_fails(s) for s in streams]
        assert time.monotonic() - start < 10
        assert all(victim in e for e in errors), errors
        for c in clients:
            c.close()
        assert server.proc.wait(20) != 0
        assert victim in server.proc.stderr.read()
        time.sleep(0.5)
        assert not [n for n, pid in server.children.items() if alive(pid)]
    finally:
        server.kill_all()


@needs_model
@pytest.mark.slow
def test_a_dead_frontend_loses_only_its_own_requests():
    server = start_server("--frontends", "2")
    try:
        survivor, victim = (Client(a, timeout=60) for a in server.addresses)
        doomed = victim.stream("Tell me a long story", LONG)
        next(doomed)
        os.kill(server.children["conveyor::frontend-1"], signal.SIGKILL)
        assert _fails(doomed) != "no error"
        out = survivor.generate("The capital of France is", SamplingParams(max_tokens=8))
        assert out.finish_reason == "length" and len(out.token_ids) == 8
        deadline = time.monotonic() + 10
        while (s := survivor.stats()).num_running or s.num_free_blocks != s.num_total_blocks:
            assert time.monotonic() < deadline, s              # the dead one's blocks are freed
            time.sleep(0.1)
        assert s.integrity_ok and server.proc.poll() is None
        survivor.close()
        victim.close()
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(30) == 0
        assert "frontend-1" in server.proc.stderr.read()
    finally:
        server.kill_all()


def _one_line_failure(*args: str) -> str:
    proc = run_serve(*args)
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert not [pid for pid in _descendants(proc.pid) if alive(pid)]
    return lines[0]


def _descendants(pid: int) -> list[int]:
    from serve_util import child_pids
    return list(child_pids(pid).values())


def test_missing_model(tmp_path):
    assert "no model at" in _one_line_failure("--model", str(tmp_path / "nope"))


@needs_model
def test_tp_not_dividing_heads():
    assert "attention heads" in _one_line_failure("--tp", "2")


@needs_model
@pytest.mark.slow
def test_port_in_use_and_too_little_kv_memory():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        line = _one_line_failure(*SMALL, "--zmq-port", str(port))
        assert "cannot listen" in line and str(port) in line
    line = _one_line_failure("--max-num-seqs", "64", "--num-kv-blocks", "8")
    assert "fewer than max_num_seqs" in line
