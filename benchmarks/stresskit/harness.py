"""The server under test, what a scenario reports, and how engine state and memory are read."""
from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from conveyor.client import Client, ServerError
from conveyor.shared.messages.engine import Stats

ROOT = Path(__file__).resolve().parents[2]          # the repository
MAX_MODEL_LEN = 512
BASE_ARGS = ("--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory-bytes", str(64 << 20))
PROMPTS = [f"{p}" if i < 8 else f"({i}) {p}" for i, p in enumerate(
    ["The capital of France is", "1, 2, 3,", "Hello, my name is", "The sky is", "def fib(n):",
     "Water boils at", "My favourite food is", "Once upon a time"] * 4)]
FAULT_DEADLINE_S = 10.0                      # a request hit by a fault must end within this
MiB = 1 << 20



# --- the server -------------------------------------------------------------------------------

@dataclass
class Server:
    proc: subprocess.Popen
    zmq: list[str]                           # one address per frontend
    http: str | None                         # base URL of the HTTP API
    children: dict[str, int]                 # process title -> pid
    log: Path                                # the server's stderr
    api_key: str | None = None
    public_key: bytes | None = None          # CurveZMQ: the server's public key

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def stderr(self) -> str:
        return self.log.read_text(errors="replace")

    def alive(self) -> list[str]:
        """The children (of those seen at start) still running."""
        return sorted(name for name, pid in self.children.items() if pid_alive(pid, name))

    def runtime_dir(self) -> Path | None:
        """The launcher's private runtime directory (ipc sockets, metrics), while it runs."""
        from conveyor.shared.sockets import OWNER_FILE, RUNTIME_PREFIX

        for path in Path(tempfile.gettempdir()).glob(f"{RUNTIME_PREFIX}*/{OWNER_FILE}"):
            try:
                if path.read_text().split()[0] == str(self.proc.pid):
                    return path.parent
            except (OSError, IndexError):
                continue
        return None

    def wait(self, timeout: float) -> int | None:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def close(self) -> None:
        """Kill whatever is left of it (its process group) and remove the log."""
        # NOTE: once the launcher is reaped its pid may be reused: signal the group only while
        # the launcher or one of its children is still there
        if self.proc.poll() is None or self.alive():
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(30)
        self.log.unlink(missing_ok=True)

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def launch(*args: str, api_key: str | None = None, curve_keys: str | Path | None = None,
           timeout: float = 300, memory_limit_gib: float = 4.0) -> Server:
    """Start `conveyor serve` on loopback (any free ports) and wait until it serves. With
    curve_keys (a folder), the ZMQ port requires CurveZMQ and every client here uses it.

    NOTE: every process of the server gets at most memory_limit_gib of address space (ulimit
    -v), so a runaway allocation fails there instead of starting the machine's OOM killer."""
    cmd = ["sh", "-c", f'ulimit -v {int(memory_limit_gib * (1 << 20))} && exec "$@"', "sh",
           sys.executable, "-m", "conveyor.cli", "serve", "--port", "0", "--zmq-port", "0",
           *BASE_ARGS, *args] + (["--api-key", api_key] if api_key else []) + (
               ["--zmq-curve-keys", str(curve_keys)] if curve_keys else [])
    fd, log = tempfile.mkstemp(prefix="conveyor-stress-", suffix=".log")
    # NOTE: OpenMP threads that sleep instead of spinning: on a shared machine (other jobs, and
    # our own client threads) spinning workers run up to 10x slower. Export OMP_WAIT_POLICY to
    # choose otherwise. stderr goes to a file: a pipe nobody reads would block a chatty server.
    env = {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=fd, text=True, cwd=ROOT,
                            start_new_session=True, env=env)
    os.close(fd)
    try:
        line = serving_line(proc, timeout)
        if line is None:
            raise RuntimeError(f"the server did not start: {Path(log).read_text()[-3000:]}")
        http = re.search(r"http://[\d.]+:\d+", line)
        server = Server(proc, re.findall(r"tcp://[\d.]+:\d+", line), http and http.group(0),
                        child_pids(proc.pid), Path(log), api_key)
        if curve_keys:
            import zmq.auth
            server.public_key = zmq.auth.load_certificate(Path(curve_keys) / "server.key")[0]
        return server
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
        Path(log).unlink(missing_ok=True)
        raise


def serving_line(proc: subprocess.Popen, timeout: float) -> str | None:
    """The line `conveyor serve` prints once it serves ("serving on ..."), or None if the
    process exits or `timeout` seconds pass first.

    NOTE: reads the pipe's bytes itself: select() on proc.stdout and then readline() misses a
    line that arrived in the same read as the one before it (it waits in the file's buffer,
    where select cannot see it; the quantization report comes just before "serving on").
    """
    fd, text = proc.stdout.fileno(), ""
    deadline = time.monotonic() + timeout
    while "serving on" not in text:
        left = deadline - time.monotonic()
        if left <= 0 or proc.poll() is not None:
            return None
        if select.select([fd], [], [], min(left, 1.0))[0]:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return None
            text += chunk.decode(errors="replace")
    return next(line for line in text.splitlines() if "serving on" in line)


def child_pids(parent: int) -> dict[str, int]:
    """Title -> pid of the children of `parent` (`conveyor::<role>`, else `<argv0>:<pid>`)."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                title = f.read().split(b"\0")[0].decode(errors="replace").strip()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent:
            found[title if title.startswith("conveyor::") else f"{title}:{entry}"] = int(entry)
    return found


def pid_alive(pid: int, title: str | None = None) -> bool:
    """Whether pid runs (not a zombie) and, given its title from child_pids, is still that
    process (not a new one that got the pid)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                return False
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv0 = f.read().split(b"\0")[0].decode(errors="replace").strip()
    except OSError:
        return False
    return title is None or argv0 == title.rsplit(":", 1)[0] or argv0 == title


# --- what a scenario reports ------------------------------------------------------------------

@dataclass
class Report:
    scenario: str
    load: str = ""
    duration_s: float = 0.0
    sent: int = 0
    finished: int = 0
    aborted: int = 0                         # cancelled by us
    failed: int = 0                          # ended with an error (reasons below)
    fail_reasons: dict[str, int] = field(default_factory=dict)
    lost: int = 0                            # sent, never ended (within the bound)
    leaked_blocks: int | None = None         # total - free once idle
    integrity_ok: bool | None = None
    frontend_leftovers: dict[str, int] = field(default_factory=dict)   # open requests
    memory_mib: dict[str, dict[str, float]] = field(default_factory=dict)   # start/peak/final
    max_ttft_s: float | None = None
    latency_p50_s: float | None = None
    latency_p99_s: float | None = None
    notes: dict = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    def check(self, ok: bool, problem: str) -> None:
        if not ok:
            self.problems.append(problem)


@dataclass
class Outcome:
    end: str                                 # "finished" | "aborted" | "failed" | "lost"
    reason: str = ""                         # why it failed: "http 429", "zmq error 503", ...
    ttft: float | None = None
    start: float = 0.0                       # time.monotonic()
    stop: float = 0.0
    ends: int = 0                            # terminal events seen, plus 1 if we cancelled
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    tag: str = ""                            # which interface / frontend / prompt


def tally(report: Report, outcomes: list[Outcome], exactly_once: bool = True) -> None:
    """Count the outcomes into report; every request must end exactly once and none be lost."""
    report.sent += len(outcomes)
    counts = Counter(o.end for o in outcomes)
    report.finished += counts["finished"]
    report.aborted += counts["aborted"]
    report.failed += counts["failed"]
    report.lost += counts["lost"]
    reasons = Counter(report.fail_reasons)
    reasons.update(o.reason for o in outcomes if o.end == "failed")
    report.fail_reasons = dict(reasons.most_common())
    ttfts = [o.ttft for o in outcomes if o.ttft is not None]
    if ttfts:
        report.max_ttft_s = round(max(ttfts + [report.max_ttft_s or 0.0]), 3)
    done = sorted(o.stop - o.start for o in outcomes if o.end == "finished")
    if done:
        report.latency_p50_s = round(done[len(done) // 2], 3)
        report.latency_p99_s = round(done[min(len(done) - 1, int(len(done) * 0.99))], 3)
    report.check(report.lost == 0, f"{report.lost} request(s) lost (no end within the bound)")
    if exactly_once:
        wrong = [o for o in outcomes if o.end != "lost" and o.ends != 1]
        report.check(not wrong, f"{len(wrong)} request(s) did not end exactly once, e.g. "
                                f"{wrong[:1]}")


# --- memory and engine state ------------------------------------------------------------------

def scrape(server: Server, timeout: float = 10.0) -> dict[str, float]:
    """GET /metrics as {"name{label=value,...}": value}; {} if it cannot be read."""
    try:
        text = httpx.get(server.http + "/metrics", headers=server.headers, timeout=timeout).text
    except httpx.HTTPError:
        return {}
    return parse_metrics(text)


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text as {"name{label=value,...}": value}; the label model_name, the same on
    every series of one server, is left out."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())
                              if k != "model_name")
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def requests_total(metrics: dict[str, float]) -> float:
    return sum(v for k, v in metrics.items() if k.startswith("conveyor:request_success_total{"))


class MemorySampler:
    """Samples `conveyor:process_resident_memory_bytes` every `every` s in a thread."""
    _KEY = "conveyor:process_resident_memory_bytes{process="

    def __init__(self, server: Server, every: float = 1.0):
        self.server, self.every = server, every
        self.seen: dict[str, list[float]] = {}   # process -> [start, peak, last] in bytes
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> MemorySampler:
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(30)

    def sample(self) -> None:
        for key, value in scrape(self.server).items():
            if key.startswith(self._KEY):
                name = key[len(self._KEY):-1].removeprefix("conveyor::")
                s = self.seen.setdefault(name, [value, value, value])
                s[1], s[2] = max(s[1], value), value

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.sample()

    def fill(self, report: Report, max_growth_mib: float | None = None) -> None:
        for name, (start, peak, last) in sorted(self.seen.items()):
            report.memory_mib[name] = {"start": round(start / MiB, 1),
                                       "peak": round(peak / MiB, 1),
                                       "final": round(last / MiB, 1)}
            if max_growth_mib is not None and not name.startswith("python"):
                growth = (last - start) / MiB
                report.check(growth <= max_growth_mib,
                             f"{name} grew by {growth:.0f} MiB (limit {max_growth_mib:g})")


def stats(server: Server, frontend: int = 0, timeout: float = 10.0) -> Stats:
    with Client(server.zmq[frontend], server_public_key=server.public_key,
                timeout=timeout) as c:
        return c.stats()


def settle(server: Server, report: Report, timeout: float = 30.0,
           frontends: list[int] | None = None) -> None:
    """Wait until the engine is idle and record leaked blocks, integrity and frontend leftovers
    (as the frontends in `frontends` see them, default all); a problem for each that is wrong."""
    indices = range(len(server.zmq)) if frontends is None else frontends
    deadline = time.monotonic() + timeout
    while True:
        try:
            seen = {i: stats(server, i) for i in indices}
        except (ServerError, TimeoutError) as e:
            report.problems.append(f"no Stats from the server: {e}")
            return
        first = next(iter(seen.values()))
        idle = (first.num_running == first.num_waiting == 0
                 and first.num_free_blocks == first.num_total_blocks
                 and all(s.frontend_open_requests == 0 for s in seen.values()))
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    report.leaked_blocks = first.num_total_blocks - first.num_free_blocks
    report.integrity_ok = all(s.integrity_ok for s in seen.values())
    report.frontend_leftovers = {f"frontend-{i}": s.frontend_open_requests
                                 for i, s in seen.items()}
    report.notes["preemptions"] = first.num_preemptions
    report.check(report.leaked_blocks == 0 and first.num_running == first.num_waiting == 0,
                 f"not idle after {timeout:g} s: {report.leaked_blocks} block(s) held, "
                 f"{first.num_running} running, {first.num_waiting} waiting")
    report.check(report.integrity_ok, "the block manager's integrity check failed")
    left = {k: v for k, v in report.frontend_leftovers.items() if v}
    report.check(not left, f"frontend requests left open: {left}")


