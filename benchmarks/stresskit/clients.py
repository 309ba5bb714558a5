"""Client threads: streamed and whole requests over HTTP and ZMQ, each ending in an Outcome."""
from __future__ import annotations

import itertools
import json
import re
import threading
import time
from collections.abc import Callable

import httpx
import zmq

from benchmarks.stresskit.harness import MAX_MODEL_LEN, PROMPTS, Outcome, Server
from conveyor import SamplingParams
from conveyor.client import Client, ServerError
from conveyor.outputs import RequestOutput
from conveyor.shared.messages import decode, encode
from conveyor.shared.messages.client import CancelRequest, ErrorReply, GenerateRequest

# --- clients ----------------------------------------------------------------------------------

class Worker:
    """What one client thread holds: an HTTP client and one ZMQ Client per frontend."""

    def __init__(self, server: Server, bound: float):
        self.server, self.bound = server, bound
        self.http = httpx.Client(headers=server.headers, timeout=bound) if server.http else None
        self.clients: dict[int, Client] = {}
        self.ctx = zmq.Context()

    def client(self, frontend: int = 0) -> Client:
        if frontend not in self.clients:
            self.clients[frontend] = Client(self.server.zmq[frontend], timeout=self.bound,
                                            server_public_key=self.server.public_key)
        return self.clients[frontend]

    def close(self) -> None:
        if self.http is not None:
            self.http.close()
        for c in self.clients.values():
            c.close()
        self.ctx.destroy(linger=0)


class Live:
    """How many requests have had a token and not ended yet, counted from many threads."""

    def __init__(self):
        self.n = 0
        self._lock = threading.Lock()

    def add(self, k: int) -> None:
        with self._lock:
            self.n += k


def drive(server: Server, concurrency: int, job: Callable[[int, Worker], Outcome], *,
          count: int | None = None, duration: float | None = None,
          stop: threading.Event | None = None, bound: float = 120.0) -> list[Outcome]:
    """Run job(i, worker) for i = 0, 1, ... from `concurrency` threads until `count` jobs have
    started, `duration` s have passed or `stop` is set. Returns every Outcome."""
    ids = itertools.count()
    lock = threading.Lock()
    outcomes: list[Outcome] = []
    end = None if duration is None else time.monotonic() + duration

    def loop() -> None:
        worker = Worker(server, bound)
        try:
            while not (stop is not None and stop.is_set()) and (
                    end is None or time.monotonic() < end):
                with lock:
                    i = next(ids)
                if count is not None and i >= count:
                    return
                start = time.monotonic()
                try:
                    o = job(i, worker)
                except Exception as e:               # a bug of ours: visible, not fatal
                    o = Outcome("failed", f"client exception {e!r}"[:120], start=start,
                                stop=time.monotonic(), ends=1)
                with lock:
                    outcomes.append(o)
        finally:
            worker.close()

    threads = [threading.Thread(target=loop, daemon=True) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outcomes


def http_stream(w: Worker, body: dict, cancel_after: int | None = None,
                route: str = "/v1/completions", live: Live | None = None) -> Outcome:
    """A streamed HTTP request; cancel_after: close the stream after that many events (0: right
    after the headers) unless it ended before. Counted in `live` from its first token on."""
    o = Outcome("lost", start=time.monotonic(), tag="http")
    try:
        with w.http.stream("POST", w.server.http + route, json={**body, "stream": True}) as r:
            if r.status_code != 200:
                r.read()
                o.end, o.reason, o.ends = "failed", f"http {r.status_code}", 1
                return o
            if cancel_after == 0:
                o.end, o.ends = "aborted", 1
                return o
            events = 0
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    o.end = "finished" if o.end == "lost" else o.end
                    break
                event = json.loads(line[6:])
                if "error" in event:             # after a finish_reason "error", or alone
                    o.end, o.ends = "failed", max(o.ends, 1)
                    o.reason = f"http stream error {event['error'].get('code')}"
                    continue
                for c in event["choices"]:
                    piece = c.get("text") or (c.get("delta") or {}).get("content") or ""
                    if piece and o.ttft is None:
                        o.ttft = time.monotonic() - o.start
                        if live is not None:
                            live.add(1)
                    o.text += piece
                    o.ends += c.get("finish_reason") is not None
                events += 1
                if cancel_after is not None and events >= cancel_after and not o.ends:
                    o.end, o.ends = "aborted", 1
                    break
            if o.end == "lost":                  # the stream ended without [DONE]
                o.end, o.reason, o.ends = "failed", "http stream cut", o.ends + 1
    except httpx.TimeoutException:
        o.end = "lost"
    except httpx.HTTPError as e:
        o.end, o.reason, o.ends = "failed", f"http {type(e).__name__}", o.ends + 1
    finally:
        o.stop = time.monotonic()
        if live is not None and o.ttft is not None:
            live.add(-1)
    return o


def http_whole(w: Worker, body: dict, route: str = "/v1/completions") -> Outcome:
    o = Outcome("lost", start=time.monotonic(), tag="http")
    try:
        r = w.http.post(w.server.http + route, json=body)
        if r.status_code == 200:
            o.end, o.ends = "finished", 1
            choice = r.json()["choices"][0]
            o.text = choice.get("text") or choice.get("message", {}).get("content") or ""
        else:
            o.end, o.reason, o.ends = "failed", f"http {r.status_code}", 1
    except httpx.TimeoutException:
        o.end = "lost"
    except httpx.HTTPError as e:
        o.end, o.reason, o.ends = "failed", f"http {type(e).__name__}", 1
    o.stop = time.monotonic()
    return o


def zmq_stream(w: Worker, prompt, params: SamplingParams, cancel_after: int | None = None,
               frontend: int = 0, live: Live | None = None) -> Outcome:
    """A streamed request through conveyor.client; cancel_after: leave the stream after that
    many deltas (>= 1) unless it ended before. Counted in `live` from its first token on."""
    o = Outcome("lost", start=time.monotonic(), tag=f"zmq-{frontend}")
    stream = w.client(frontend).stream(prompt, params)
    try:
        for i, d in enumerate(stream, 1):
            if d.token_ids and o.ttft is None:
                o.ttft = time.monotonic() - o.start
                if live is not None:
                    live.add(1)
            o.text += d.text
            o.token_ids += d.token_ids
            if d.finish_reason is not None:
                o.ends += 1
                o.end = "failed" if d.finish_reason == "error" else "finished"
                if d.error:
                    o.reason = f"zmq error: {_short(d.error)}"
            if cancel_after is not None and i >= cancel_after and not o.ends:
                o.end, o.ends = "aborted", 1
                break
        if o.end == "lost":
            o.end, o.reason = "failed", "zmq stream ended without a finish"
    except ServerError as e:
        o.end, o.reason, o.ends = "failed", f"zmq {_short(str(e))}", o.ends + 1
    except TimeoutError:
        o.end = "lost"
    finally:
        stream.close()
        o.stop = time.monotonic()
        if live is not None and o.ttft is not None:
            live.add(-1)
    return o


def dealer(ctx: zmq.Context, server: Server, frontend: int = 0) -> zmq.Socket:
    """A bare client socket to a frontend, as a client in another language would open one."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 1000)
    if server.public_key is not None:
        sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
        sock.curve_serverkey = server.public_key
    sock.connect(server.zmq[frontend])
    return sock


def zmq_exchange(ctx: zmq.Context, server: Server, frames: list[bytes], timeout: float,
                 whole: bool = True, frontend: int = 0) -> tuple[list, bool]:
    """Send frames on a fresh DEALER; (replies, answered). whole: read until a finished
    RequestOutput, an ErrorReply or Stats; else one reply (and cancel the request if that
    reply was not its last)."""
    sock = dealer(ctx, server, frontend)
    replies: list = []
    try:
        sock.send_multipart(frames)
        deadline = time.monotonic() + timeout
        while sock.poll(max(0, int((deadline - time.monotonic()) * 1000))):
            reply = decode(sock.recv_multipart())
            replies.append(reply)
            if isinstance(reply, RequestOutput) and not reply.finished and not whole:
                sock.send_multipart(encode(CancelRequest(reply.request_id)))
            if not whole or not isinstance(reply, RequestOutput) or reply.finished:
                return replies, True
        return replies, False
    finally:
        sock.close()


def zmq_generate(w: Worker, request: GenerateRequest, frontend: int = 0) -> Outcome:
    """A request on a raw socket, so error codes are seen (conveyor.client drops them)."""
    o = Outcome("lost", start=time.monotonic(), tag=f"zmq-{frontend}")
    replies, answered = zmq_exchange(w.ctx, w.server, encode(request), w.bound,
                                     frontend=frontend)
    o.stop = time.monotonic()
    if not answered:
        return o
    last = replies[-1]
    o.ends = 1
    if isinstance(last, ErrorReply):
        o.end, o.reason = "failed", f"zmq {last.code}"
        return o
    o.end = "finished"
    for out in replies:
        for c in out.outputs:
            o.text += c.text
            o.token_ids += c.token_ids
            if c.finish_reason == "error":
                o.end, o.reason = "failed", f"zmq error {c.error_code}"
    return o


def _short(text: str) -> str:
    """An error message without its variable parts, to count reasons."""
    return re.sub(r"\d+", "N", text)[:70]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def completion_body(prompt: str, max_tokens: int) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


_OFFLINE: dict = {}


def offline_greedy(prompts: list[str], max_tokens: int) -> list[tuple[str, list[int]]]:
    """(text, token ids) of each prompt from the offline API, one step at a time (computed
    once per process)."""
    import torch

    from conveyor import LLM

    key = (tuple(prompts), max_tokens)
    if key not in _OFFLINE:
        if "llm" not in _OFFLINE:
            _OFFLINE["llm"] = LLM(max_num_seqs=64, kv_cache_memory_bytes=64 << 20,
                                  max_model_len=MAX_MODEL_LEN, async_scheduling=False)
        # NOTE: one thread: this process also runs the client threads (spinning OpenMP
        # threads beside them, or beside other jobs, run many times slower)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            outs = _OFFLINE["llm"].generate(prompts, greedy(max_tokens), use_tqdm=False)
        finally:
            torch.set_num_threads(threads)
        _OFFLINE[key] = [(o.outputs[0].text, list(o.outputs[0].token_ids)) for o in outs]
    return _OFFLINE[key]


def warm_up(server: Server) -> None:
    with Client(server.zmq[0], timeout=120, server_public_key=server.public_key) as c:
        c.generate(PROMPTS[:4], greedy(4))


