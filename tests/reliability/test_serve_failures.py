"""`conveyor serve` failures: a child killed with SIGKILL fails every open request within 10 s
and ends the launcher non-zero with nothing left behind; start-up failures print one line."""
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
@pytest.mark.parametrize("victim", ["scheduler", "frontend-1", "worker-0"])
def test_killing_a_child_fails_requests_and_stops_everything(victim):
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
        assert all(e != "no error" for e in errors), errors
        if victim != "frontend-1":
            assert all(victim in e for e in errors), errors
        assert server.proc.wait(20) != 0
        assert victim in server.proc.stderr.read()
        time.sleep(0.5)
        assert not [n for n, pid in server.children.items() if alive(pid)]
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
