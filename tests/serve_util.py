"""Start `conveyor serve` in a subprocess for tests, find its children, and always clean up."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass

from benchmarks.stresskit.harness import child_pids, serving_line
from benchmarks.stresskit.harness import pid_alive as alive  # noqa: F401  (for the tests)

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
        http = re.search(r"https?://[\d.]+:\d+", line)
        return Server(proc, addresses, http and http.group(0), child_pids(proc.pid))
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
        raise


def served_outputs(prompts, params, *args: str) -> list:
    """`conveyor serve *args` (no HTTP), then each prompt's first completion through the ZMQ
    client; the server is killed afterwards."""
    from conveyor.client import Client

    server = start_server(*args, "--port", "-1")
    try:
        with Client(server.addresses[0], timeout=60) as client:
            return [r.outputs[0] for r in client.generate(prompts, params)]
    finally:
        server.kill_all()


def assert_top5_close(reference: list, other: list) -> list[int | None]:
    """STYLE.md's rule between two runs' completions (in-process or served, with top-5
    logprobs): greedy tokens equal or, at the first divergence, each side's token in the
    other's top 5. Returns each completion's first differing position (None: all equal)."""
    first = []
    for n, (one, two) in enumerate(zip(reference, other, strict=True)):
        assert len(one.token_ids) == len(two.token_ids)
        first.append(None)
        for i, (a, b) in enumerate(zip(one.token_ids, two.token_ids)):
            if a != b:
                assert a in two.logprobs[i], f"completion {n}, token {i}: {a} vs {b}"
                assert b in one.logprobs[i], f"completion {n}, token {i}: {a} vs {b}"
                first[-1] = i
                break
    return first
