"""Stopping as orchestrators and terminals do it. SIGTERM to the launcher alone or to its whole
process group (systemd, `kill -- -PGID`), under load (streamed and whole requests, HTTP and
ZMQ): the requests in flight complete normally within --shutdown-timeout, a new request gets 503
over HTTP and an ErrorReply with code 503 over ZMQ, and the launcher exits 0 with no process and
no runtime directory left; SIGTERM to the launcher as PID 1 of a PID namespace (a container) the
same. SIGTERM during start-up stops it cleanly too. SIGINT to the group (Ctrl-C) starts the same
drain, which the children outlive, and a second one stops at once. (The launcher takes SIGINT and
SIGTERM in one handler; only the children treat them differently.) Whichever way it stops, its
runtime directory is gone.
Long version: scripts/stress.py --scenario graceful-stop."""
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from benchmarks.stresskit.harness import ROOT, child_pids, launch, pid_alive
from benchmarks.stresskit.scenarios import graceful_stop
from conveyor.shared.model_files import default_model_path
from conveyor.shared.sockets import OWNER_FILE, RUNTIME_PREFIX

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not default_model_path().is_file(),
                                                   reason="default model not fetched")]


@pytest.mark.parametrize("signum, to_group", [(signal.SIGTERM, False), (signal.SIGTERM, True)],
                         ids=["sigterm-launcher", "sigterm-group"])
def test_a_stop_signal_under_load_finishes_in_flight_requests_and_refuses_new_ones(signum,
                                                                                  to_group):
    with launch("--max-num-seqs", "8", "--shutdown-timeout", "60") as server:
        r = graceful_stop(server, duration=2, concurrency=8, max_tokens=32,
                          shutdown_timeout=60, signum=signum, to_group=to_group)
    assert r.problems == [], r
    assert r.notes["in_flight_at_sigterm"] > 0 and r.failed == 0
    assert r.notes["refusals"] == {"http": 503, "zmq": 503}
    assert r.notes["exit_code"] == 0


def _runtime_dirs() -> set[Path]:
    return {p.parent for p in Path(tempfile.gettempdir()).glob(f"{RUNTIME_PREFIX}*/{OWNER_FILE}")}


def _assert_nothing_left(children: dict, runtime_dirs: set[Path]) -> None:
    """No child process of the server alive and its runtime directories gone."""
    time.sleep(0.5)
    assert not [n for n, pid in children.items() if pid_alive(pid, n)]
    assert runtime_dirs and not any(d.exists() for d in runtime_dirs)


def _kill_if_running(proc) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)


def test_sigterm_to_the_group_during_start_up_stops_everything_with_exit_0():
    before = _runtime_dirs()
    proc = subprocess.Popen([sys.executable, "-m", "conveyor.cli", "serve", "--port", "0",
                             "--zmq-port", "0", "--max-model-len", "512"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 60          # until every child runs (still loading)
        while len(children := child_pids(proc.pid)) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        mine = _runtime_dirs() - before
        time.sleep(1.0)
        assert proc.poll() is None, proc.communicate()
        os.killpg(proc.pid, signal.SIGTERM)
        code = proc.wait(30)
        _, err = proc.communicate()
        assert code == 0, err
        assert "stopped during start-up" in err and "Traceback" not in err, err
        _assert_nothing_left(children, mine)
    finally:
        _kill_if_running(proc)


def test_a_second_signal_stops_at_once_failing_what_is_open():
    from benchmarks.stresskit.clients import greedy
    from conveyor.client import Client

    with launch("--max-num-seqs", "8", "--shutdown-timeout", "120") as server:
        runtime_dir = server.runtime_dir()
        client = Client(server.zmq[0], timeout=60)
        stream = client.stream("Once upon a time", greedy(400))
        next(stream)                              # in flight
        os.killpg(server.proc.pid, signal.SIGINT)
        time.sleep(1.0)
        assert server.proc.poll() is None         # draining: up to 120 s
        start = time.monotonic()
        os.killpg(server.proc.pid, signal.SIGINT)
        code = server.wait(15)
        took = time.monotonic() - start
        last = None
        for out in stream:                        # the request's end: an error saying why
            last = out
        failure = last.outputs[0].error if last is not None and last.outputs else None
        client.close()
        assert code == 0 and took < 5, (code, took)
        assert failure is not None and "stopped" in failure, failure
        deadline = time.monotonic() + 5            # multiprocessing's resource tracker ends
        while server.alive() and time.monotonic() < deadline:   # once the launcher is gone
            time.sleep(0.1)
        assert not server.alive()
        assert runtime_dir is not None and not runtime_dir.exists()


def test_sigterm_to_pid_1_drains_the_same_way(tmp_path):
    """The launcher as PID 1 of its own PID namespace (a container without an init): SIGTERM
    lets the request in flight finish, and it exits 0 leaving nothing behind."""
    import shutil

    from benchmarks.stresskit.clients import greedy
    from benchmarks.stresskit.harness import BASE_ARGS, serving_line
    from conveyor.client import Client

    if shutil.which("unshare") is None or subprocess.run(
            ["unshare", "--fork", "--pid", "--mount-proc", "true"],
            capture_output=True).returncode != 0:
        pytest.skip("cannot make a PID namespace here (unshare)")
    before = _runtime_dirs()
    log = (tmp_path / "stderr").open("w")
    proc = subprocess.Popen(["unshare", "--fork", "--pid", "--mount-proc", sys.executable, "-m",
                             "conveyor.cli", "serve", "--port", "0", "--zmq-port", "0",
                             *BASE_ARGS, "--max-num-seqs", "8", "--shutdown-timeout", "120"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=log, text=True,
                            start_new_session=True)
    try:
        line = serving_line(proc, 240)
        assert line is not None, (tmp_path / "stderr").read_text()[-2000:]
        (launcher,) = child_pids(proc.pid).values()    # PID 1 inside, this pid outside
        with open(f"/proc/{launcher}/status") as f:
            assert [ln.split()[-1] for ln in f if ln.startswith("NSpid")] == ["1"]
        children = child_pids(launcher)
        mine = _runtime_dirs() - before
        address = line.split("(HTTP), ")[1].split(" (ZMQ)")[0]
        with Client(address, timeout=60) as client:
            stream = client.stream("Once upon a time", greedy(24))
            next(stream)
            os.kill(launcher, signal.SIGTERM)
            last = None
            for out in stream:
                last = out
        assert last.outputs[0].finish_reason == "length", last
        # unshare exits with its child's code
        assert proc.wait(60) == 0, (tmp_path / "stderr").read_text()[-2000:]
        _assert_nothing_left(children, mine)
    finally:
        _kill_if_running(proc)
