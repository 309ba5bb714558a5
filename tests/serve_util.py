"""Start `conveyor serve` in a subprocess for tests, find its children, and always clean up."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass

from stresskit.harness import child_pids, serving_line
from stresskit.harness import pid_alive as alive  # noqa: F401  (for the tests)

SMALL = ["--max-num-seqs", "64", "--kv-cache-memory-bytes", str(64 << 20),
         "--max-model-len", "512"]


@dataclass
class Server:
    proc: subprocess.Popen
    addresses: list[str]                     # ZMQ, one per frontend
    http: str | None                         # the HTTP API's base URL
    children: dict[str, int]                 # process title -> pid

    def kill_all(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(30)


def run_serve(*args: str, timeout: float = 240) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "conveyor.cli", "serve", "--zmq-port", "0", "--port", "0", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def start_server(*args: str, timeout: float = 240) -> Server:
    proc = run_serve(*SMALL, *args)
    try:
        line = serving_line(proc, timeout)
        if line is None:
            os.killpg(proc.pid, signal.SIGKILL)     # so that its stderr ends
            raise RuntimeError(f"server did not start: {proc.stderr.read()[-2000:]}")
        addresses = re.findall(r"tcp://[\d.]+:\d+", line)
        http = re.search(r"http://[\d.]+:\d+", line)
        return Server(proc, addresses, http and http.group(0), child_pids(proc.pid))
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
        raise
