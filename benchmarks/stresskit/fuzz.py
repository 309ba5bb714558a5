"""Bad input: malformed, huge and hostile requests on the HTTP API and the ZMQ client port."""
from __future__ import annotations

import json
import math
import random
import re
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import httpx
import msgspec
import zmq

from benchmarks.stresskit.clients import (
    Worker,
    completion_body,
    dealer,
    drive,
    greedy,
    http_whole,
    offline_greedy,
    warm_up,
    zmq_exchange,
    zmq_stream,
)
from benchmarks.stresskit.harness import (
    MAX_MODEL_LEN,
    PROMPTS,
    MemorySampler,
    Outcome,
    Report,
    Server,
    pid_alive,
    settle,
    tally,
)
from conveyor import SamplingParams
from conveyor.outputs import RequestOutput
from conveyor.shared.messages import MESSAGE_TYPES, decode, encode
from conveyor.shared.messages.client import CancelRequest, ErrorReply, GenerateRequest
from conveyor.shared.messages.control import Drain, EngineDead, Ready, Shutdown
from conveyor.shared.messages.engine import Abort, Stats

# --- bad-input --------------------------------------------------------------------------------

# JSON texts put in place of one field of a valid request (NaN and Infinity are not JSON; a
# number beyond 64 bits is, and so are deep nesting and lone surrogates)
JSON_VALUES = (
    "null", "true", "false", "0", "-1", "1", "2147483648", "9223372036854775808",
    "18446744073709551615", "18446744073709551616", "-9223372036854775809", "1e30", "-1e30",
    "1.5", "1e999", "-1e999", "NaN", "Infinity", "-Infinity", '""', '"x"', '"\\u0000"',
    '"\\ud800"', '"\\udfff\\ud800"', "[]", "[1]", '["a"]', "[-1]", "[18446744073709551616]",
    "{}", '{"a": 1}', '{"role": 1}', "[" * 1000 + "]" * 1000, '"' + "x" * 100_000 + '"',
)
COMPLETION_FIELDS = (
    "model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "stop",
    "seed", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
    "stream", "stream_options", "logprobs", "echo", "suffix", "best_of", "user", "min_tokens",
    "ignore_eos", "stop_token_ids", "skip_special_tokens", "include_stop_str_in_output",
    "priority", "cache_salt", "return_token_ids",
)
CHAT_FIELDS = (
    "messages", "max_tokens", "max_completion_tokens", "logprobs", "top_logprobs", "tools",
    "tool_choice", "response_format", "n", "seed", "priority", "stop", "temperature",
    "cache_salt",
)
# values put in place of one field of a valid GenerateRequest (msgpack can carry NaN and inf)
MSGPACK_VALUES = (
    None, True, 0, -1, 1, 2 ** 31, 2 ** 63 - 1, 2 ** 64 - 1, -2 ** 63, 1.5, math.nan, math.inf,
    -math.inf, "", "x", b"\xff\xfe", [], [1], [-1], ["a"], [2 ** 64 - 1], {}, {"a": 1},
    {"role": 1}, [[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]], "x" * 100_000,
)
SAMPLING_FIELDS = tuple(f.name for f in msgspec.structs.fields(SamplingParams))
REQUEST_FIELDS = tuple(f.name for f in msgspec.structs.fields(GenerateRequest)) + ("unknown",)


def _label(json_value: str) -> str:
    """A short name for a value of JSON_VALUES."""
    if json_value.startswith("[[["):
        return "deep list"
    return json_value if len(json_value) <= 24 else f"{json_value[:12]}... ({len(json_value)} B)"


@dataclass
class Probe:
    name: str
    send: Callable[[Worker], tuple[str, bool]]   # -> (what came back, acceptable?)


def _http_probe(name: str, route: str, body: bytes, headers: dict | None = None) -> Probe:
    """Only the status is read: a streamed answer is cancelled once it has started."""
    def send(w: Worker) -> tuple[str, bool]:
        with w.http.stream("POST", w.server.http + route, content=body,
                           headers={"Content-Type": "application/json", **(headers or {})}) as r:
            return f"http {r.status_code}", r.status_code < 500
    return Probe(name, send)


def _raw_http_probe(name: str, data: bytes, pace: float = 0.0) -> Probe:
    """Raw bytes on a fresh connection (byte by byte every `pace` s when pace > 0)."""
    def send(w: Worker) -> tuple[str, bool]:
        status = raw_http(w.server, data, w.bound, pace)
        return f"http {status}", status is None or status < 500
    return Probe(name, send)


def raw_http(server: Server, data: bytes, timeout: float, pace: float = 0.0,
             then: bytes = b"") -> int | None:
    """The status code answering `data` (and `then`, sent 0.3 s later); None if the server
    closed the connection without one. TimeoutError if it never answers."""
    host, port = server.http.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        try:
            if pace:
                for i in range(len(data)):
                    s.sendall(data[i:i + 1])
                    time.sleep(pace)
            else:
                s.sendall(data)
            if then:
                time.sleep(0.3)
                s.sendall(then)
        except (BrokenPipeError, ConnectionResetError):
            pass                                 # it may answer and close before we finish
        buf = b""
        try:
            while b"\r\n" not in buf:
                chunk = s.recv(4096)
                if not chunk:
                    break
                buf += chunk
        except ConnectionResetError:
            pass
        except TimeoutError:
            raise TimeoutError("no answer") from None
    m = re.match(rb"HTTP/1\.[01] (\d{3})", buf)
    return int(m.group(1)) if m else None


def _zmq_probe(name: str, frames: list[bytes], whole: bool = True) -> Probe:
    def send(w: Worker) -> tuple[str, bool]:
        replies, answered = zmq_exchange(w.ctx, w.server, frames, w.bound, whole)
        if not answered:
            raise TimeoutError("no reply")
        last = replies[-1]
        if isinstance(last, ErrorReply):
            return f"zmq ErrorReply {last.code}", last.code < 500
        if isinstance(last, RequestOutput):
            codes = [c.error_code for out in replies for c in out.outputs if c.error_code]
            return f"zmq output {codes[0] if codes else 'ok'}", all(c < 500 for c in codes)
        return f"zmq {type(last).__name__}", True
    return Probe(name, send)


def http_probes(server: Server, rng: random.Random, values=JSON_VALUES) -> list[Probe]:
    """Malformed and hostile HTTP requests; each must get an answer below 500."""
    probes = []
    # NOTE: streamed, so that a valid but long request (max_tokens null: the whole context)
    # is cancelled once it has started instead of running for a minute on a CPU
    cmpl = {"prompt": "Hi", "max_tokens": 2, "temperature": 0, "stream": True}
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0,
            "stream": True}
    routes = ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize")
    for route in routes:
        for size in (0, 1, 17, 1000, 100_000):
            probes.append(_http_probe(f"random {size} B {route}", route, rng.randbytes(size)))
        for name, text in (("null", "null"), ("1", "1"), ("string", '"s"'), ("list", "[]"),
                           ("NaN", "NaN"), ("Infinity", "Infinity"), ("1e999", "1e999"),
                           ("open lists", "[" * 100_000),
                           ("deep list", "[" * 100_000 + "]" * 100_000),
                           ("deep object", '{"a":' * 10_000 + "1" + "}" * 10_000),
                           ("deep list in an unknown field",
                            '{"prompt": "Hi", "zz": ' + "[" * 1000 + "]" * 1000 + "}"),
                           ("cut", '{"prompt": "Hi"')):
            probes.append(_http_probe(f"top-level {name} {route}", route, text.encode()))
        probes.append(_http_probe(f"invalid UTF-8 {route}", route, b'{"prompt": "\xff\xfe"}'))
    for base, route, fields in ((cmpl, "/v1/completions", COMPLETION_FIELDS),
                                (chat, "/v1/chat/completions", CHAT_FIELDS)):
        for name in fields:
            for value in values:
                text = json.dumps({**base, name: "@@"}).replace('"@@"', value)
                probes.append(_http_probe(f"{route} {name}={_label(value)}", route,
                                          text.encode()))
    for name, value in (("role", "1"), ("content", "1"), ("content", '[{"type": "image"}]'),
                        ("content", '[{"type": "text", "text": 5}]'), ("content", '"\\ud800"')):
        text = json.dumps({**chat, "messages": [{"role": "user", "content": "@@"}]})
        if name == "role":
            text = json.dumps({**chat, "messages": [{"role": "@@", "content": "x"}]})
        probes.append(_http_probe(f"chat message {name}={value}", "/v1/chat/completions",
                                  text.replace('"@@"', value).encode()))
    huge = [
        ("n huge", {**cmpl, "n": 10 ** 9}), ("n at the cap", {**cmpl, "n": 64, "max_tokens": 1}),
        ("max_tokens huge", {**cmpl, "max_tokens": 10 ** 18}),
        ("prompt at the context", {"prompt": [100] * (MAX_MODEL_LEN - 1), "max_tokens": 1}),
        ("prompt at the context + 1", {"prompt": [100] * (MAX_MODEL_LEN - 1), "max_tokens": 2}),
        ("prompt of the context", {"prompt": [100] * MAX_MODEL_LEN, "max_tokens": 1}),
        ("prompt beyond the context", {"prompt": [100] * (MAX_MODEL_LEN + 1)}),
        ("prompt far beyond", {"prompt": [100] * 100_000}),
        ("text beyond", {"prompt": "word " * 5000}),
        ("chat beyond", {"messages": [{"role": "user", "content": "word " * 5000}]}),
        ("many prompts", {"prompt": ["Hi"] * 1000, "max_tokens": 1}),
    ]
    for name, body in huge:
        route = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        probes.append(_http_probe(name, route, json.dumps(body).encode()))
    big = b'{"prompt": "' + b"x" * (9 << 20) + b'"}'
    probes.append(_http_probe("body over the cap", "/v1/completions", big))

    def chunked(w: Worker) -> tuple[str, bool]:
        r = w.http.post(w.server.http + "/v1/completions",
                        content=(b"x" * 65536 for _ in range(150)))
        return f"http {r.status_code}", r.status_code == 413
    probes.append(Probe("chunked body over the cap", chunked))
    key = (server.api_key or "k").encode()
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + key +
               b"\r\nContent-Type: application/json\r\n")
    body = b'{"prompt": "Hi", "max_tokens": 1}'
    length = b"Content-Length: %d\r\n\r\n" % len(body)
    for name, data in (
            ("header over 16 KiB", request + b"X-Big: " + b"a" * 20_000 + b"\r\n" + length + body),
            ("1000 headers", request + b"".join(b"X-%d: y\r\n" % i for i in range(1000)) + length
             + body),
            ("invalid UTF-8 header", request + b"X-Junk: \xff\xfe\x80\r\n" + length + body),
            ("invalid UTF-8 key", request.replace(key, b"\xff\xfe") + length + body),
            ("invalid UTF-8 path", b"GET /v1/\xff\xfe HTTP/1.1\r\nHost: x\r\n\r\n"),
            ("percent-encoded junk path", b"GET /v1/%ff%fe%00 HTTP/1.1\r\nHost: x\r\n\r\n"),
            ("not HTTP", rng.randbytes(200) + b"\r\n\r\n"),
            ("negative length", request + b"Content-Length: -5\r\n\r\n"),
            ("length beyond the body", request + b"Content-Length: 99999999999999999999\r\n\r\n"
             + body),
            ("two lengths", request + b"Content-Length: 3\r\n" + length + body),
            ("bad chunk size",
             request + b"Transfer-Encoding: chunked\r\n\r\nzz\r\nab\r\n0\r\n\r\n"),
    ):
        probes.append(_raw_http_probe(name, data))
    return probes


def zmq_probes(rng: random.Random, values=MSGPACK_VALUES) -> list[Probe]:
    """Malformed and hostile ZMQ frames; each must be answered (not with a 5xx), except a
    frame over ZMQ_MAXMSGSIZE, which the server drops with the connection."""
    probes = []
    pack = msgspec.msgpack.encode
    for i in range(8):
        frames = [rng.randbytes(rng.choice((0, 1, 2, 40, 5000))) for _ in range(rng.randint(1, 4))]
        probes.append(_zmq_probe(f"random frames {i}", frames, whole=False))
    for frames in ([b""], [b"", b""], [b"\x0a"], [b"\x0a", b"", b""], [b"\x0a\x0a", b"\x80"],
                   [b"\x00", b"\x80"], [b"\xff", b"\x80"], [b"\x0a", b"\xc1"],
                   [b"\x0a", pack([1, 2, 3])], [b"\x0a", b"\xa2\xff\xfe"],
                   [b"\x0a", b"\x81\xa2id\xa2\xff\xfe"],
                   [b"\x0a", b"\x82\xa2id\xa1u\xa6prompt\xa2\xff\xfe"],       # invalid UTF-8
                   [b"\x0a", b"\x82\xa2id\xa1u\xa6prompt\xa3\xed\xa0\x80"]):  # a surrogate
        probes.append(_zmq_probe(f"frames {frames!r:.40}", frames, whole=False))
    internal = [Abort(ids=["f0-0/0"]), Shutdown("bye"), EngineDead("fake"), Drain(0.0),
                Ready("frontend-0"), Stats(num_total_blocks=-1)]
    for msg in internal:
        probes.append(_zmq_probe(f"internal {type(msg).__name__}", encode(msg), whole=False))
    for tag in range(1, len(MESSAGE_TYPES) + 3):
        probes.append(_zmq_probe(f"tag {tag} with junk", [bytes([tag]), pack({"x": [1]})],
                                 whole=False))
    probes.append(Probe("cancel of nothing", _expect_silence(encode(CancelRequest("nothing")))))
    probes.append(_zmq_probe("stats with junk", [bytes([12]), pack({"junk": 1})], whole=False))
    base = {"id": "p", "prompt": "Hi", "sampling": {"temperature": 0, "max_tokens": 2},
            "stream": True}                      # read the first reply, then cancel
    for name in REQUEST_FIELDS + tuple(f"sampling.{f}" for f in SAMPLING_FIELDS):
        for value in values:
            body = json.loads(json.dumps(base))
            if name.startswith("sampling."):
                body["sampling"][name.split(".")[1]] = value
            else:
                body[name] = value
            probes.append(_zmq_probe(f"request {name}={str(value)[:20]}",
                                     [bytes([10]), pack(body)], whole=False))
    L = MAX_MODEL_LEN
    for name, ids, max_tokens in (("prompt at the context", L - 1, 4),
                                  ("prompt of the context", L, 1),
                                  ("prompt far beyond", 100_000, 1)):
        probes.append(_zmq_probe(name, encode(GenerateRequest(
            id="c", prompt_token_ids=[100] * ids, sampling=greedy(max_tokens)))))
    for name, sampling in (("zmq n huge", {"n": 2 ** 63 - 1}), ("zmq max_tokens huge",
                                                            {"max_tokens": 2 ** 64 - 1})):
        probes.append(_zmq_probe(name, [bytes([10]), pack({**base, "sampling": sampling})],
                                 whole=False))
    probes.append(Probe("duplicate id", _duplicate_id))
    probes.append(_zmq_probe("zmq deep msgpack", [bytes([10]), deep_msgpack_request()]))
    probes.append(_zmq_probe("zmq seed overflow", [bytes([10]), pack(
        {**base, "sampling": {"seed": 2 ** 64 - 1, "n": 2, "max_tokens": 2}})], whole=False))
    return probes


def deep_msgpack_request(depth: int = 1000) -> bytes:
    """A GenerateRequest body whose sampling holds an unknown field nested `depth` lists deep."""
    pack = msgspec.msgpack.encode
    return (b"\x83" + pack("id") + pack("deep") + pack("prompt") + pack("Hi") + pack("sampling")
            + b"\x81" + pack("zz") + b"\x91" * depth + b"\x90")


def _expect_silence(frames: list[bytes]) -> Callable[[Worker], tuple[str, bool]]:
    """A frame that gets no reply by design (CancelRequest): the server must stay responsive."""
    def send(w: Worker) -> tuple[str, bool]:
        replies, _ = zmq_exchange(w.ctx, w.server, frames, 0.5, whole=False)
        return ("zmq silence" if not replies else "zmq a reply"), not replies
    return send


def _duplicate_id(w: Worker) -> tuple[str, bool]:
    sock = dealer(w.ctx, w.server)
    try:
        request = GenerateRequest(id="dup", prompt="Hi", sampling=greedy(8))
        sock.send_multipart(encode(request))
        sock.send_multipart(encode(request))
        kinds = []
        while sock.poll(int(w.bound * 1000)):
            reply = decode(sock.recv_multipart())
            kinds.append(type(reply).__name__)
            if isinstance(reply, RequestOutput) and reply.finished:
                break
        else:
            raise TimeoutError("no reply")
        ok = kinds.count("ErrorReply") == 1 and kinds[-1] == "RequestOutput"
        return ("zmq duplicate refused" if ok else f"zmq duplicate: {kinds}"), ok
    finally:
        sock.close(0)


def slow_clients(server: Server, report: Report, seconds: float = 5.0, count: int = 20) -> None:
    """Slowloris connections (headers a byte at a time) and streams nobody reads, while a
    normal request must still be answered promptly; then the readers go away."""
    stop = threading.Event()
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
            + (server.api_key or "k").encode() + b"\r\nX-Slow: " + b"a" * 4000)
    pace = seconds / len(head)
    lorises = [threading.Thread(target=_slowloris, args=(server, head, pace, stop), daemon=True)
               for _ in range(count)]
    for t in lorises:
        t.start()
    mute = []
    body = {"prompt": "Tell me a story", "max_tokens": 100, "ignore_eos": True, "n": 2,
            "logprobs": 5, "stream": True}
    for _ in range(2):                           # 4 sequences: the others must still run
        host, port = server.http.removeprefix("http://").split(":")
        s = socket.create_connection((host, int(port)), timeout=10)
        data = json.dumps(body).encode()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                  b"\r\nContent-Length: %d\r\n" % len(data) + "".join(
                      f"{k}: {v}\r\n" for k, v in server.headers.items()).encode() + b"\r\n"
                  + data)
        mute.append(s)                           # never read
    worker = Worker(server, 60)
    try:
        time.sleep(seconds / 2)
        o = http_whole(worker, completion_body(PROMPTS[0], 4))
        report.notes["latency_beside_slow_clients_s"] = round(o.stop - o.start, 2)
        report.check(o.end == "finished", f"a request beside slow clients: {o.end} {o.reason}")
    finally:
        worker.close()
        stop.set()
        for t in lorises:
            t.join(seconds * 2)
        for s in mute:
            s.close()


def _slowloris(server: Server, head: bytes, pace: float, stop: threading.Event) -> None:
    host, port = server.http.removeprefix("http://").split(":")
    try:
        with socket.create_connection((host, int(port)), timeout=10) as s:
            for i in range(len(head)):
                if stop.is_set():
                    return
                s.sendall(head[i:i + 1])
                time.sleep(pace)
    except OSError:
        pass                                     # the server may cut it: that is fine


def oversized_zmq_frame(server: Server, report: Report) -> None:
    """A 65 MiB frame is dropped (ZMQ_MAXMSGSIZE) and the port keeps serving."""
    ctx = zmq.Context()
    try:
        sock = dealer(ctx, server)
        sock.send_multipart([b"\x0a", b"\0" * (65 << 20)])
        report.check(not sock.poll(2000), "a 65 MiB frame got a reply")
        sock.close(0)
    finally:
        ctx.destroy(linger=0)


def bad_input(server: Server, *, duration: float | None = None, seed: int = 0,
              concurrency: int = 8, sample: float = 1.0, bound: float = 60.0) -> Report:
    """Fuzz the HTTP API and the ZMQ port: random bytes, every field of a valid request set to
    wrong types, huge and negative numbers, NaN/Infinity, deep nesting, invalid UTF-8, oversized
    bodies, headers and frames, frames with wrong counts and tags, internal message types, slow
    and non-reading clients, huge n and max_tokens, prompts at and beyond the context. Each
    probe must be answered within `bound` and never with a 5xx; every process stays alive; the
    greedy answers to the requests sent right after equal the offline API's; nothing is left
    held. With `duration`, rounds of fresh random probes repeat until it has passed. `sample` < 1
    keeps that share of the one-field mutations (a fixed choice for a given seed)."""
    report = Report("bad-input", f"{concurrency} fuzzers")
    report.notes["seed"] = seed
    warm_up(server)
    rng = random.Random(seed)
    keep = random.Random(seed + 1)
    probes = [p for p in http_probes(server, rng) + zmq_probes(rng)
              if not p.name.startswith(("/v1/", "request ")) or keep.random() < sample]
    statuses: Counter = Counter()
    bad: list[str] = []
    stop = threading.Event()

    def job(i: int, w: Worker) -> Outcome:
        p = probes[i] if i < len(probes) else _fresh_probe(i)
        o = Outcome("lost", start=time.monotonic(), tag=p.name)
        try:
            what, ok = p.send(w)
            o.end, o.ends = ("finished" if ok else "failed"), 1
            o.reason = "" if ok else f"{what}"
            statuses[what] += 1
            if not ok:
                bad.append(f"{p.name}: {what}")
        except (TimeoutError, httpx.TimeoutException):
            o.end = "lost"
            bad.append(f"{p.name}: no answer within {w.bound:g} s")
            if sum(b.endswith(" s") for b in bad) >= 5:
                stop.set()                       # it stopped answering: no use going on
        except (httpx.HTTPError, OSError) as e:
            o.end, o.ends, o.reason = "finished", 1, ""
            statuses[f"closed {type(e).__name__}"] += 1
        o.stop = time.monotonic()
        return o

    watchdog = threading.Thread(target=_watch, args=(server, stop), daemon=True)
    start = time.monotonic()
    with MemorySampler(server) as memory:
        watchdog.start()
        outcomes = drive(server, concurrency, job, count=None if duration else len(probes),
                         duration=duration, stop=stop, bound=bound)
        report.check(not stop.is_set(), "the fuzzing stopped early: a process died or the "
                                        "server stopped answering")
        stop.set()
        report.notes["probes_s"] = round(time.monotonic() - start, 1)
        slow_clients(server, report)
        oversized_zmq_frame(server, report)
        report.duration_s = round(time.monotonic() - start, 1)
        dead = [name for name, pid in server.children.items() if not pid_alive(pid, name)]
        report.check(not dead and server.proc.poll() is None,
                     f"processes died: {dead}, launcher exit code {server.proc.poll()}")
        if not dead:
            checked = time.monotonic()
            _check_answers(server, report)
            settle(server, report)
            report.notes["answers_checked_s"] = round(time.monotonic() - checked, 1)
    tally(report, outcomes)
    memory.fill(report)
    report.notes["answers"] = dict(statuses.most_common())
    report.notes["wrong"] = bad
    report.check(not bad, f"{len(bad)} probe(s) answered wrongly or not at all: {bad[:8]}")
    return report


def _watch(server: Server, stop: threading.Event) -> None:
    """Set stop as soon as any process of the server has died (or stop is set)."""
    while not stop.wait(0.5):
        if server.proc.poll() is not None or len(server.alive()) < len(server.children):
            stop.set()


def _fresh_probe(i: int) -> Probe:
    """A random probe for the rounds after the fixed set: one field of a valid request set to a
    random bad value, sometimes with a random byte changed."""
    rng = random.Random(i)
    if rng.random() < 0.5:
        route = rng.choice(("/v1/completions", "/v1/chat/completions", "/tokenize"))
        name, value = rng.choice(COMPLETION_FIELDS), rng.choice(JSON_VALUES)
        base = {"prompt": "Hi", "max_tokens": 2, "temperature": 0, "stream": True}
        body = json.dumps({**base, name: "@@"}).replace('"@@"', value)
        if rng.random() < 0.3:
            cut = rng.randrange(len(body))
            body = body[:cut] + chr(rng.randrange(32, 0x2FFF)) + body[cut + 1:]
        return _http_probe(f"random {route} {name}={_label(value)}", route,
                           body.encode("utf-8", "replace"))
    body = {"id": f"m{i}", "prompt": "Hi", "stream": True,
            "sampling": {"temperature": 0, "max_tokens": 2}}
    sampling = rng.random() < 0.6
    name = rng.choice(SAMPLING_FIELDS if sampling else REQUEST_FIELDS)
    value = rng.choice(MSGPACK_VALUES)
    (body["sampling"] if sampling else body)[name] = value
    packed = msgspec.msgpack.encode(body)
    if rng.random() < 0.3 and name not in ("n", "seed"):   # a changed byte: any int
        cut = rng.randrange(len(packed))
        packed = packed[:cut] + bytes([rng.randrange(256)]) + packed[cut + 1:]
    name = f"sampling.{name}" if sampling else name
    return _zmq_probe(f"random request {name}={str(value)[:20]}", [bytes([10]), packed],
                      whole=False)


def _check_answers(server: Server, report: Report) -> None:
    """Right after the fuzzing: greedy answers equal the offline API's, over HTTP (text) and
    ZMQ (token ids), all sent at once."""
    want = offline_greedy(PROMPTS[:4], 12)

    def job(i: int, w: Worker) -> Outcome:
        text, ids = want[i // 2]
        if i % 2:
            o = http_whole(w, completion_body(PROMPTS[i // 2], 12))
            report.check(o.text == text, f"after fuzzing, HTTP answered {o.text!r} "
                                         f"({o.end} {o.reason}), not {text!r}")
        else:
            o = zmq_stream(w, PROMPTS[i // 2], greedy(12))
            report.check(o.token_ids == ids, f"after fuzzing, ZMQ answered {o.token_ids} "
                                             f"({o.end} {o.reason}), not {ids}")
        return o

    drive(server, 2 * len(want), job, count=2 * len(want))


