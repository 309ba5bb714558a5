"""`conveyor serve` start-up failures print one line and leave no process behind. (A scheduler,
worker or frontend killed while it serves: test_faults.py, under load.)"""
import os
import signal
import socket

import pytest
from serve_util import SMALL, alive, run_serve

from conveyor.shared.model_files import default_model_path

needs_model = pytest.mark.skipif(not default_model_path().is_file(),
                                 reason="default model not fetched")


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
    assert "attention heads" in _one_line_failure("--tp", "2", "--device", "cpu")


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
