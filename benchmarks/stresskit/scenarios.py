"""The load and fault scenarios: each drives a server and returns a Report of what held."""
from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections import Counter

import httpx
import zmq

from benchmarks.stresskit.clients import (
    Live,
    Worker,
    completion_body,
    drive,
    greedy,
    http_stream,
    http_whole,
    offline_greedy,
    warm_up,
    zmq_exchange,
    zmq_generate,
    zmq_stream,
)
from benchmarks.stresskit.harness import (
    FAULT_DEADLINE_S,
    PROMPTS,
    MemorySampler,
    Outcome,
    Report,
    Server,
    requests_total,
    scrape,
    settle,
    stats,
    tally,
)
from conveyor.shared.messages import encode
from conveyor.shared.messages.client import ErrorReply, GenerateRequest

# --- abort-storm ------------------------------------------------------------------------------

def abort_storm(server: Server, *, requests: int | None = None, duration: float | None = None,
                concurrency: int = 16, max_tokens: int = 8, cancel_share: float = 0.5,
                seed: int = 0, max_growth_mib: float | None = 64, bound: float = 120.0
                ) -> Report:
    """Streamed requests, alternately HTTP SSE and ZMQ `Client.stream`; `cancel_share` of them
    are left at a random point (closing the HTTP stream, even right after its headers; breaking
    out of the ZMQ stream). Afterwards every block is free, integrity holds, each request ended
    exactly once (one finish or one cancel seen by its client; the server's
    conveyor:request_success_total grew by exactly the number sent), no frontend keeps any state,
    and
    memory is back near its start (growth over max_growth_mib is a problem)."""
    report = Report("abort-storm", f"{concurrency} streams, max_tokens {max_tokens}, "
                                   f"{cancel_share:.0%} cancelled")
    warm_up(server)

    def job(i: int, w: Worker) -> Outcome:
        rng = random.Random(seed * 1_000_003 + i)
        prompt = PROMPTS[i % len(PROMPTS)]
        cancel = rng.randrange(max_tokens) if rng.random() < cancel_share else None
        if i % 2:
            return http_stream(w, completion_body(prompt, max_tokens), cancel)
        return zmq_stream(w, prompt, greedy(max_tokens), cancel and max(1, cancel),
                          frontend=i // 2 % len(server.zmq))

    before = requests_total(scrape(server))
    start = time.monotonic()
    with MemorySampler(server) as memory:
        outcomes = drive(server, concurrency, job, count=requests, duration=duration, bound=bound)
        report.duration_s = round(time.monotonic() - start, 1)
        settle(server, report)
        memory.sample()
    tally(report, outcomes)
    memory.fill(report, max_growth_mib)
    counted = requests_total(scrape(server)) - before
    report.notes["server_counted"] = counted
    report.check(counted == report.sent,
                 f"the server counted {counted:g} ended requests, {report.sent} were sent")
    report.check(report.failed == 0, f"{report.failed} request(s) failed: {report.fail_reasons}")
    return report


# --- kv-pressure ------------------------------------------------------------------------------

def kv_pressure(server: Server, *, requests: int | None = None, duration: float | None = None,
                concurrency: int = 16, max_tokens: int = 48, bound: float = 300.0) -> Report:
    """Greedy streamed requests (HTTP and ZMQ) on a KV pool so small that requests are
    preempted again and again: every output equals the offline API's (text over HTTP, token ids
    over ZMQ), preemptions happen, nothing is lost or starved (the longest wait is reported),
    and every block is free afterwards."""
    report = Report("kv-pressure", f"{concurrency} streams, max_tokens {max_tokens}")
    want = offline_greedy(PROMPTS, max_tokens)
    first = stats(server)
    report.notes["kv_blocks"] = first.num_total_blocks
    mismatches: list[str] = []

    def job(i: int, w: Worker) -> Outcome:
        k = i % len(PROMPTS)
        if i % 2:
            o = http_stream(w, completion_body(PROMPTS[k], max_tokens))
            same = o.text == want[k][0]
        else:
            o = zmq_stream(w, PROMPTS[k], greedy(max_tokens))
            same = o.token_ids == want[k][1]
        if o.end == "finished" and not same:
            mismatches.append(f"{o.tag} prompt {k}: {o.text!r} != {want[k][0]!r}")
        return o

    start = time.monotonic()
    with MemorySampler(server) as memory:
        outcomes = drive(server, concurrency, job, count=requests, duration=duration, bound=bound)
        report.duration_s = round(time.monotonic() - start, 1)
        settle(server, report)
    tally(report, outcomes)
    memory.fill(report)
    preempted = report.notes["preemptions"] - first.num_preemptions
    report.notes["preemptions"] = preempted
    metric = scrape(server).get("conveyor:num_preemptions_total")
    report.notes["conveyor:num_preemptions_total"] = metric
    report.check(preempted > 0 and (metric or 0) >= preempted,
                 f"no preemption seen ({preempted}, metric {metric}): the pool is not small")
    report.check(not mismatches, f"{len(mismatches)} output(s) differ from the offline API's, "
                                 f"e.g. {mismatches[:2]}")
    report.check(report.failed == 0, f"{report.failed} request(s) failed: {report.fail_reasons}")
    return report


# --- faults -----------------------------------------------------------------------------------

def fault(server: Server, victim: str, *, duration: float = 5.0, concurrency: int = 8,
          max_tokens: int = 256, bound: float = 30.0) -> Report:
    """SIGKILL one process (`worker-0`, `scheduler`, `frontend-1`, ...) while long streamed
    requests run on every frontend (HTTP and ZMQ). Every request it hits ends with an error
    within 10 s; nothing is lost. A dead worker or scheduler ends the launcher non-zero, naming
    it, with no process left behind. A dead frontend fails only its own requests: the other
    frontends' requests finish normally, the server keeps serving through them, and the dead
    frontend's blocks are freed (problems about that start with "survival:")."""
    report = Report(f"faults:{victim}", f"{concurrency} streams, kill {victim} after "
                                        f"{duration:g} s")
    warm_up(server)
    stop = threading.Event()
    live = Live()

    def job(i: int, w: Worker) -> Outcome:
        prompt = PROMPTS[i % len(PROMPTS)]
        if i % 3 == 2:
            return http_stream(w, completion_body(prompt, max_tokens), live=live)
        return zmq_stream(w, prompt, greedy(max_tokens), frontend=i % len(server.zmq),
                          live=live)

    box: dict = {}
    loader = threading.Thread(target=lambda: box.setdefault(
        "outcomes", drive(server, concurrency, job, stop=stop, bound=bound)), daemon=True)
    start = time.monotonic()
    with MemorySampler(server, every=0.5) as memory:
        loader.start()
        time.sleep(duration)
        deadline = time.monotonic() + 60
        while live.n < concurrency // 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        pid = server.children[f"conveyor::{victim}"]
        stop.set()
        os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        report.notes["streaming_at_kill"] = live.n
        loader.join(bound + 30)
    outcomes = box.get("outcomes", [])
    report.duration_s = round(time.monotonic() - start, 1)
    tally(report, outcomes)
    memory.fill(report)
    hit = [o for o in outcomes if o.start < killed_at < o.stop]
    if victim.startswith("frontend-"):
        mine = f"zmq-{victim.split('-')[1]}"
        affected = [o for o in hit if o.tag in (mine, "http") and o.end != "finished"]
        others = [o for o in hit if o.tag not in (mine, "http")]
        report.check(all(o.end == "finished" for o in others),
                     f"survival: {sum(o.end != 'finished' for o in others)} request(s) on the "
                     f"other frontends did not finish normally: "
                     f"{Counter(o.reason for o in others if o.end != 'finished')}")
    else:
        # NOTE: a request whose last token was on its way when the kill came may still finish
        affected = [o for o in hit if o.end != "finished" or o.stop - killed_at > 1.0]
        # the frontends outlive the engine: their streams end with an error event, not cut
        cut = [o.reason for o in affected if o.tag == "http" and o.end == "failed"
               and not o.reason.startswith("http stream error") and not o.reason[5:].isdigit()]
        report.check(not cut, f"{len(cut)} HTTP stream(s) were cut instead of ending with an "
                              f"error event: {Counter(cut)}")
    late = [round(o.stop - killed_at, 1) for o in affected
            if o.end != "failed" or o.stop - killed_at > FAULT_DEADLINE_S]
    report.notes["affected"] = len(affected)
    report.notes["slowest_error_s"] = round(max((o.stop - killed_at for o in affected),
                                                default=0.0), 2)
    report.check(bool(hit), "no request was in flight at the kill")
    report.check(not late, f"{len(late)} affected request(s) did not end with an error within "
                           f"{FAULT_DEADLINE_S:g} s (ended after {late[:5]} s)")
    if victim.startswith("frontend-"):
        _check_survival(server, victim, report)
    else:
        code = server.wait(30)
        report.notes["exit_code"] = code
        report.check(code not in (None, 0), f"the launcher exit code is {code}, not non-zero")
        report.check(victim in server.stderr(), f"the launcher's stderr does not name {victim}")
    _check_no_orphans(server, report)
    return report


def _check_survival(server: Server, victim: str, report: Report) -> None:
    """After a frontend died: the launcher lives and serves through the others."""
    time.sleep(1.0)
    code = server.proc.poll()
    report.notes["exit_code"] = code
    if code is not None:
        report.problems.append(f"survival: the launcher exited with code {code} after {victim} "
                               f"died: {server.stderr().strip().splitlines()[-1:]}")
        return
    survivors = [i for i in range(len(server.zmq)) if f"frontend-{i}" != victim]
    worker = Worker(server, 60)
    try:
        for i in survivors:
            o = zmq_stream(worker, PROMPTS[0], greedy(4), frontend=i)
            report.check(o.end == "finished", f"survival: frontend-{i} does not serve: {o}")
        for _ in range(4):
            o = http_whole(worker, completion_body(PROMPTS[1], 4))
            report.check(o.end == "finished", f"survival: HTTP does not serve: {o.reason}")
    finally:
        worker.close()
    settle(server, report, frontends=survivors)
    server.proc.send_signal(signal.SIGTERM)
    report.notes["exit_code_after_sigterm"] = server.wait(60)


def _check_no_orphans(server: Server, report: Report) -> None:
    if server.proc.poll() is None:
        return                                   # still serving: close() ends it
    deadline = time.monotonic() + 5
    while server.alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    report.check(not server.alive(), f"processes left behind: {server.alive()}")


# --- graceful-stop ----------------------------------------------------------------------------

def graceful_stop(server: Server, *, duration: float = 5.0, concurrency: int = 8,
                  max_tokens: int = 48, shutdown_timeout: float = 60.0,
                  bound: float = 120.0, signum: int = signal.SIGTERM,
                  to_group: bool = False) -> Report:
    """A stop signal under load (to the launcher, or with to_group to its whole process group,
    as Ctrl-C, systemd and `kill -- -PGID` send it): the requests in flight complete normally
    within the shutdown timeout, new ones get 503 (HTTP) or an ErrorReply with code 503 (ZMQ),
    the launcher exits 0 and leaves no process and no runtime directory behind. The server must
    have been started with --shutdown-timeout shutdown_timeout."""
    report = Report("graceful-stop", f"{concurrency} requests, max_tokens {max_tokens}, "
                                     f"{signal.Signals(signum).name} to the "
                                     f"{'process group' if to_group else 'launcher'}")
    runtime_dir = server.runtime_dir()
    warm_up(server)
    stop = threading.Event()

    def job(i: int, w: Worker) -> Outcome:
        prompt = PROMPTS[i % len(PROMPTS)]
        kind = i % 4
        if kind == 0:
            return http_stream(w, completion_body(prompt, max_tokens))
        if kind == 1:
            return http_whole(w, completion_body(prompt, max_tokens))
        if kind == 2:
            return zmq_stream(w, prompt, greedy(max_tokens))
        return zmq_generate(w, GenerateRequest(id=f"g{i}", prompt=prompt,
                                               sampling=greedy(max_tokens)))

    box: dict = {}
    loader = threading.Thread(target=lambda: box.setdefault(
        "outcomes", drive(server, concurrency, job, stop=stop, bound=bound)), daemon=True)
    start = time.monotonic()
    with MemorySampler(server) as memory:
        loader.start()
        time.sleep(duration)
        stop.set()                               # no new request from the load from here on
        if to_group:
            os.killpg(server.proc.pid, signum)
        else:
            server.proc.send_signal(signum)
        signalled = time.monotonic()
        report.notes["refusals"] = _probe_draining(server, report)
        loader.join(shutdown_timeout + 30)
    outcomes = box.get("outcomes", [])
    code = server.wait(shutdown_timeout + 30)
    report.duration_s = round(time.monotonic() - start, 1)
    report.notes["exit_code"] = code
    report.notes["exit_after_s"] = round(time.monotonic() - signalled, 1)
    tally(report, outcomes)
    memory.fill(report)
    in_flight = [o for o in outcomes if o.stop > signalled]
    report.notes["in_flight_at_sigterm"] = len(in_flight)
    report.check(bool(in_flight), "no request was in flight at SIGTERM")
    report.check(report.failed == 0, f"{report.failed} request(s) failed: {report.fail_reasons}")
    slow = [o for o in in_flight if o.stop - signalled > shutdown_timeout]
    report.check(not slow, f"{len(slow)} request(s) took longer than the shutdown timeout")
    report.check(code == 0, f"the launcher exit code is {code}, not 0")
    _check_no_orphans(server, report)
    report.check(runtime_dir is not None and not runtime_dir.exists(),
                 f"the runtime directory {runtime_dir} was left behind")
    return report


def _probe_draining(server: Server, report: Report) -> dict[str, int | None]:
    """Once /health says draining, a new request on each interface must be refused with 503."""
    deadline, health = time.monotonic() + 10, None
    while time.monotonic() < deadline:
        try:
            health = httpx.get(server.http + "/health", timeout=5).status_code
        except httpx.HTTPError:
            health = None
        if health == 503:
            break
        time.sleep(0.02)
    if health != 503:
        report.problems.append(f"/health did not turn 503 while draining (last: {health})")
        return {}
    try:
        http = httpx.post(server.http + "/v1/completions", json=completion_body("x", 2),
                          headers=server.headers, timeout=10).status_code
    except httpx.HTTPError:
        http = None
    ctx = zmq.Context()
    try:
        replies, _ = zmq_exchange(ctx, server, encode(GenerateRequest(
            id="late", prompt="x", sampling=greedy(2))), 10)
    finally:
        ctx.destroy(linger=0)
    refusal = replies[-1] if replies else None
    code = refusal.code if isinstance(refusal, ErrorReply) else None
    report.check(http == 503, f"a new HTTP request while draining got {http}, not 503")
    report.check(code == 503, f"a new ZMQ request while draining got {refusal}, not an "
                              f"ErrorReply with code 503")
    return {"http": http, "zmq": code}


# --- load -------------------------------------------------------------------------------------

def load(server: Server, *, duration: float = 10.0, concurrency: int = 16, max_tokens: int = 16,
         bound: float = 120.0, max_peak_mib: float | None = None) -> Report:
    """A closed loop of `concurrency` clients (meant as 4x --max-num-seqs, with
    --max-queued-requests set), whole and streamed, HTTP and ZMQ: every request finishes or is
    refused with 429 (counted), none is lost, latency is bounded (p50/p99 reported), memory is
    bounded (a process whose peak exceeds max_peak_mib is a problem)."""
    report = Report("load", f"{concurrency} clients, max_tokens {max_tokens}")
    warm_up(server)

    def job(i: int, w: Worker) -> Outcome:
        prompt = PROMPTS[i % len(PROMPTS)]
        kind = i % 3
        if kind == 0:
            o = http_whole(w, completion_body(prompt, max_tokens))
        elif kind == 1:
            o = http_stream(w, completion_body(prompt, max_tokens))
        else:
            o = zmq_generate(w, GenerateRequest(id=f"l{i}", prompt=prompt,
                                                sampling=greedy(max_tokens)))
        if o.reason.endswith("429"):
            time.sleep(0.25)                     # a client backs off before it tries again
        return o

    start = time.monotonic()
    with MemorySampler(server) as memory:
        outcomes = drive(server, concurrency, job, duration=duration, bound=bound)
        report.duration_s = round(time.monotonic() - start, 1)
        settle(server, report)
    tally(report, outcomes)
    memory.fill(report)
    refused = sum(n for reason, n in report.fail_reasons.items() if reason.endswith("429"))
    report.notes["refused_429"] = refused
    others = {r: n for r, n in report.fail_reasons.items() if not r.endswith("429")}
    report.check(not others, f"failures other than 429: {others}")
    report.check(report.finished > 0, "no request finished")
    if max_peak_mib is not None:
        for name, m in report.memory_mib.items():
            report.check(m["peak"] <= max_peak_mib, f"{name} peaked at {m['peak']} MiB")
    return report


