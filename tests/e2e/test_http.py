"""The OpenAI-compatible HTTP API of `conveyor serve` on CPU, through the official `openai`
client and raw HTTP: results equal the offline API's, every error status comes from a real
request with OpenAI's error shape, a client that disconnects frees its blocks, /metrics parses
and moves, and limits (rate, concurrency, queue, timeout) answer with their status."""
import json
import shutil
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from serve_util import run_serve, start_server

from benchmarks.stresskit.harness import parse_metrics
from conveyor import SamplingParams
from conveyor.client import Client
from conveyor.shared.model_files import default_model_path

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not default_model_path().is_file(),
                                                   reason="default model not fetched")]

KEYS = ("key-one", "key-two")
PROMPTS = ["The capital of France is", "1, 2, 3,", "def fib(n):"]
CHAT = [{"role": "user", "content": "Name the three primary colors."}]


@pytest.fixture(scope="module")
def server():
    s = start_server("--api-key", KEYS[0], "--api-key", KEYS[1], "--served-model-name", "smol",
                     "--max-n", "4", "--max-request-body-bytes", "65536",
                     "--max-concurrent-requests", "3", "--cache-salt-per-api-key",
                     "--prefix-caching-hash-algo", "sha256-keyed")
    yield s
    s.kill_all()


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.http + "/v1", api_key=KEYS[1], max_retries=0,
                         timeout=120)


@pytest.fixture(scope="module")
def llm(small_llm):
    return small_llm


def _post(server, path: str, body, key: str | None = KEYS[0], **kw) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    content = json.dumps(body) if isinstance(body, (dict, list)) else body
    kw.setdefault("timeout", 60)
    return httpx.post(server.http + path, content=content, headers=headers, **kw)


def _error(r: httpx.Response, status: int) -> str:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert err["code"] == status and err["type"] and err["message"]
    return err["message"]


def _metrics(server) -> dict[str, float]:
    return parse_metrics(httpx.get(server.http + "/metrics", timeout=30,
                                   headers={"Authorization": f"Bearer {KEYS[0]}"}).text)


def test_completions_equal_the_offline_api(oai, llm):
    greedy = SamplingParams(temperature=0, max_tokens=12)
    want = [o.outputs[0].text for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]
    r = oai.completions.create(model="smol", prompt=PROMPTS, max_tokens=12, temperature=0)
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == want
    assert r.usage.completion_tokens == 36 and r.object == "text_completion"
    streamed = ["", "", ""]
    for chunk in oai.completions.create(model="smol", prompt=PROMPTS, max_tokens=12,
                                        temperature=0, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == want


def test_chat_equals_the_offline_api_streamed_or_not(oai, llm):
    want = llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)
    want = want[0].outputs[0].text
    r = oai.chat.completions.create(model="smol", messages=CHAT, max_tokens=20, temperature=0)
    assert r.choices[0].message.content == want and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason in ("stop", "length")
    text, usage, roles = "", None, 0
    for chunk in oai.chat.completions.create(model="smol", messages=CHAT, max_tokens=20,
                                             temperature=0, stream=True,
                                             stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            roles += c.delta.role == "assistant"
            text += c.delta.content or ""
    assert text == want and roles == 1
    assert usage.completion_tokens == r.usage.completion_tokens
    assert usage.prompt_tokens == r.usage.prompt_tokens > 10
    # the reply as the client holds it (its null refusal, annotations, ...) goes back as history
    history = CHAT + [r.choices[0].message.model_dump(),
                      {"role": "user", "content": "And the secondary ones?"}]
    again = oai.chat.completions.create(model="smol", messages=history, max_tokens=4)
    assert again.usage.prompt_tokens > r.usage.prompt_tokens + r.usage.completion_tokens


def test_n_seed_and_logprobs(oai):
    r = oai.completions.create(model="smol", prompt="Once upon a time", max_tokens=6, n=2,
                               seed=7, temperature=1.0, logprobs=3)
    again = oai.completions.create(model="smol", prompt="Once upon a time", max_tokens=6, n=2,
                                   seed=7, temperature=1.0, logprobs=3)
    assert [c.text for c in r.choices] == [c.text for c in again.choices]
    assert sorted(c.index for c in r.choices) == [0, 1]
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert all(v <= 0 for v in lp.token_logprobs) and all(len(t) >= 3 for t in lp.top_logprobs)
    assert "".join(lp.tokens) == r.choices[0].text
    c = oai.chat.completions.create(model="smol", messages=CHAT, max_tokens=4, temperature=0,
                                    logprobs=True, top_logprobs=2)
    content = c.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 2 for t in content)
    assert content[0].logprob == pytest.approx(content[0].top_logprobs[0].logprob, abs=1e-4)


def test_return_token_ids(server):
    body = {"prompt": "1, 2, 3,", "max_tokens": 5, "temperature": 0, "return_token_ids": True}
    choice = _post(server, "/v1/completions", body).json()["choices"][0]
    assert len(choice["token_ids"]) == 5
    detok = _post(server, "/detokenize", {"tokens": choice["token_ids"]}).json()["prompt"]
    assert detok == choice["text"]


def test_tenants_never_share_prefix_cache_blocks(server):
    """With --cache-salt-per-api-key each key hits only its own cached prefixes."""
    prompt = "Shared system prompt. " * 12 + "Question:"
    body = {"prompt": prompt, "max_tokens": 1}
    with Client(server.addresses[0], timeout=30) as c:
        def hits_after(key: str) -> int:
            assert _post(server, "/v1/completions", body, key=key).status_code == 200
            return c.stats().prefix_cache_hits

        start = c.stats().prefix_cache_hits
        first = hits_after(KEYS[0])                   # tenant one: computes the prompt
        again = hits_after(KEYS[0])                   # tenant one again: hits its blocks
        other = hits_after(KEYS[1])                   # tenant two: must not hit tenant one's
        other_again = hits_after(KEYS[1])
    assert first == start and again > first
    assert other == again and other_again > other


def test_api_keys(server, oai):
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.http + "/v1", api_key="wrong", max_retries=0).models.list()
    _error(httpx.get(server.http + "/v1/models"), 401)
    _error(_post(server, "/v1/completions", {"prompt": "x"}, key="key-one-and-more"), 401)
    assert [m.id for m in oai.models.list().data] == ["smol"]
    for probe in ("/health", "/ping", "/version", "/metrics"):          # no key needed
        assert httpx.get(server.http + probe).status_code == 200, probe
    r = _post(server, "/v1/completions", {"prompt": "x", "model": "gpt-4"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert r.json()["error"]["param"] == "model" and "gpt-4" in r.json()["error"]["message"]


@pytest.mark.parametrize("body,needle", [
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "top_p": 1.5}, "top_p"),
    ({"prompt": "x", "max_tokens": "many"}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 600}, "context length"),
    ({"prompt": "x" * 3000}, "context length"),
    ({"prompt": ""}, "empty"),
    ({"prompt": [1, 2, 10 ** 9]}, "vocabulary"),
    ({"prompt": "x", "n": 5}, "must be at most 4"),
    ({"prompt": ["x", "y", "z"], "n": 2}, "must be at most 4 (--max-n), got 2 x 3"),
    ({"prompt": "x", "seed": 2 ** 64}, "seed must fit in 64 bits"),
    ({"prompt": "x", "priority": -2 ** 63 - 1}, "priority must fit in 64 bits"),
    ({"prompt": "x", "priority": 1}, "--scheduling-policy priority"),    # fcfs ignores it
    ({"prompt": "x", "stop_token_ids": [2 ** 64]}, "stop_token_ids must fit in 64 bits"),
    (b'{"prompt": "x", "guided_json": {"a": ' + b"[" * 1000 + b"]" * 1000 + b"}}",
     "nested too deeply"),
    ({"prompt": "x", "suffix_tokens": 3}, "unknown field `suffix_tokens`"),       # not honoured
    ({"prompt": "x", "stream_options": {"include_usage": True, "x": 1}},
     "unknown field `x` - at `$.stream_options`"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream"),
    ({"max_tokens": 3}, "prompt"),
    (b"{not json", "JSON"),
])
def test_invalid_requests_are_400(server, body, needle):
    assert needle in _error(_post(server, "/v1/completions", body), 400)


def test_continuous_usage_stats_count_every_chunk(oai):
    """vLLM's stream_options.continuous_usage_stats: each chunk carries the usage so far (the
    prompt's tokens, the completion's growing), the last one the final count."""
    chunks = list(oai.chat.completions.create(
        model="smol", messages=CHAT, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counted = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert counted and all(c.usage is not None for c in counted)
    done = [c.usage.completion_tokens for c in counted]
    assert done == sorted(done) and done[-1] <= chunks[-1].usage.completion_tokens
    assert {c.usage.prompt_tokens for c in chunks if c.usage} == {chunks[-1].usage.prompt_tokens}
    plain = list(oai.chat.completions.create(model="smol", messages=CHAT, max_tokens=12,
                                             temperature=0, stream=True,
                                             stream_options={"include_usage": True}))
    assert all(c.usage is None for c in plain[:-1])

def test_continue_final_message_equals_the_offline_api(oai, llm):
    """vLLM's continue_final_message: the prompt ends inside the assistant's last message (as
    transformers' template renders it) and the model goes on from there, over HTTP as offline."""
    started = CHAT + [{"role": "assistant", "content": "The capital of France is"}]
    want = llm.chat(started, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False,
                    add_generation_prompt=False, continue_final_message=True)[0]
    text = llm.tokenizer.apply_chat_template(started, tokenize=False,
                                             continue_final_message=True)
    assert text.endswith("The capital of France is")
    assert want.prompt_token_ids == llm.tokenizer.encode(text, add_special_tokens=False)
    r = oai.chat.completions.create(model="smol", messages=started, max_tokens=8,
                                    temperature=0, extra_body={"add_generation_prompt": False,
                                                               "continue_final_message": True})
    assert r.choices[0].message.content == want.outputs[0].text
    assert r.usage.prompt_tokens == len(want.prompt_token_ids)

def test_chat_errors_and_other_statuses(server):
    assert "messages" in _error(_post(server, "/v1/chat/completions", {"messages": []}), 400)
    zero = {"messages": CHAT, "max_completion_tokens": 0}     # not "unset": the whole context
    assert "max_tokens" in _error(_post(server, "/v1/chat/completions", zero), 400)
    legacy = {"messages": CHAT, "functions": [{"name": "f", "parameters": {}}]}
    assert "unknown field `functions`" in _error(_post(server, "/v1/chat/completions",
                                                        legacy), 400)
    audio = {"messages": [{"role": "assistant", "content": "hi", "audio": {"id": "a"}}]}
    assert "messages[0].audio" in _error(_post(server, "/v1/chat/completions", audio), 400)
    tools = {"messages": CHAT, "tools": [{"type": "function"}]}
    assert "tools" in _error(_post(server, "/v1/chat/completions", tools), 400)
    _error(_post(server, "/v1/completions", {"prompt": "x" * 70000}), 413)
    chunked = (b"x" * 10000 for _ in range(10))          # no content-length: counted as read
    _error(_post(server, "/v1/completions", chunked), 413)
    _error(_post(server, "/v1/nothing-here", {}), 404)
    _error(httpx.get(server.http + "/v1/completions",
                     headers={"Authorization": f"Bearer {KEYS[0]}"}), 405)


def test_tokenize_detokenize_version(server):
    r = _post(server, "/tokenize", {"prompt": "Hello world"}).json()
    assert r["count"] == len(r["tokens"]) > 0 and r["max_model_len"] == 512
    assert _post(server, "/detokenize", {"tokens": r["tokens"]}).json()["prompt"].endswith(
        "Hello world")
    chat = _post(server, "/tokenize", {"messages": CHAT}).json()
    assert chat["count"] > r["count"]
    # a chat's prompt as the chat route makes it: the same count as its usage
    started = {"messages": CHAT + [{"role": "assistant", "content": "Red,"}],
               "add_generation_prompt": False, "continue_final_message": True,
               "chat_template_kwargs": {"enable_thinking": False}}
    counted = _post(server, "/tokenize", {**started, "return_token_strs": True}).json()
    used = _post(server, "/v1/chat/completions", {**started, "max_tokens": 1}).json()["usage"]
    assert counted["count"] == used["prompt_tokens"] == len(counted["token_strs"])
    assert "Red," in _post(server, "/detokenize", {"tokens": counted["tokens"]}).json()["prompt"]
    _error(_post(server, "/tokenize", {**started, "add_generation_prompt": True}), 400)
    _error(_post(server, "/detokenize", {"tokens": [-1]}), 400)
    version = httpx.get(server.http + "/version", headers={"Authorization": "Bearer key-one"})
    assert version.json()["version"]


def _stream(server, tokens: int = 200, key: str | None = KEYS[0]):
    """A long streamed completion, open once its headers arrive: (context, response)."""
    body = {"prompt": "Tell me a story", "max_tokens": tokens, "ignore_eos": True,
            "stream": True}
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    cm = httpx.stream("POST", server.http + "/v1/completions", json=body, timeout=60,
                      headers=headers)
    return cm, cm.__enter__()


def test_concurrency_cap_gives_429(server):
    streams = [_stream(server) for _ in range(3)]
    try:
        assert [r.status_code for _, r in streams] == [200] * 3
        r = _post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2})
        assert "open requests" in _error(r, 429)
    finally:
        for cm, _ in streams:
            cm.__exit__(None, None, None)


def test_disconnect_mid_stream_frees_blocks_and_metrics_move(server):
    before = _metrics(server)
    body = {"prompt": "Tell me a long story", "max_tokens": 400, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", server.http + "/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEYS[0]}"}) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = [line for line, _ in zip(lines, range(6)) if line.startswith("data:")]
        assert len(got) >= 3
    with Client(server.addresses[0], timeout=30) as c:
        deadline = time.monotonic() + 15
        while True:
            s = c.stats()
            if s.num_running == 0 and s.num_free_blocks == s.num_total_blocks:
                break
            assert time.monotonic() < deadline, s
            time.sleep(0.1)
        assert s.integrity_ok
    after = _metrics(server)
    key = 'conveyor:request_success_total{finished_reason=abort}'
    assert after[key] == before.get(key, 0) + 1
    assert after["conveyor:kv_cache_usage_perc"] == 0
    assert after["conveyor:generation_tokens_total"] > before["conveyor:generation_tokens_total"]
    ok = 'conveyor:http_requests_total{route=/v1/completions,status=200}'
    assert after[ok] > before.get(ok, 0)
    assert after["conveyor:time_to_first_token_seconds_count"] > 0
    assert after["conveyor:inter_token_latency_seconds_count"] >= 2


# --- limits -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def limited():
    s = start_server("--max-num-seqs", "2", "--max-queued-requests", "1",
                     "--max-concurrent-requests", "4", "--rate-limit", "5",
                     "--rate-limit-burst", "30", "--shutdown-timeout", "60",
                     "--http-read-timeout", "1.5")
    yield s
    s.kill_all()


def _trickle(server, parts: list[bytes], pause: float) -> bytes:
    """Send parts with pauses between them; the first bytes of the answer (b"" if the server
    closed the connection instead)."""
    host, port = server.http.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as s:
        try:
            for part in parts:
                s.sendall(part)
                time.sleep(pause)
        except OSError:
            pass                             # closed by the server meanwhile
        try:
            return s.recv(65536)
        except ConnectionResetError:
            return b""


def test_a_request_that_trickles_in_is_cut_off_and_a_prompt_one_is_served(limited):
    body = json.dumps({"prompt": "x", "max_tokens": 1}).encode()
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body))
    # the whole request, sent in 2 s: cut off at 1.5 s with no answer
    assert _trickle(limited, [head[:20], head[20:40], head[40:] + body], 1.0) == b""
    assert _trickle(limited, [head, body[:5], body[5:]], 1.0) == b""
    # the same in 0.6 s: answered
    assert _trickle(limited, [head, body[:5], body[5:]], 0.3).startswith(b"HTTP/1.1 200")


def test_queue_cap_gives_429(limited):
    """2 running, 1 waiting (a streamed response starts once the request runs), then one more."""
    body = {"prompt": "Tell me a story", "max_tokens": 20, "ignore_eos": True}
    with ThreadPoolExecutor(3) as pool, Client(limited.addresses[0], timeout=30) as c:
        futures = [pool.submit(_post, limited, "/v1/completions", body, None) for _ in range(3)]
        deadline = time.monotonic() + 30
        while (c.stats().num_waiting, c.stats().num_running) != (1, 2):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        r = _post(limited, "/v1/completions", {"prompt": "x", "max_tokens": 2}, key=None)
        assert "waiting" in _error(r, 429)
        assert [f.result().status_code for f in futures] == [200] * 3


def test_request_timeout_gives_408_and_frees_blocks():
    server = start_server("--request-timeout", "1")
    try:
        body = {"prompt": "Tell me a story", "max_tokens": 480, "ignore_eos": True}
        assert "longer than 1 s" in _error(_post(server, "/v1/completions", body, None), 408)
        with Client(server.addresses[0], timeout=30) as c:
            out = c.generate("Tell me a story", SamplingParams(max_tokens=480, ignore_eos=True))
            assert out.finish_reason == "error" and "longer than 1 s" in out.error
            s = c.stats()
            assert s.num_running == 0 and s.num_free_blocks == s.num_total_blocks
    finally:
        server.kill_all()


def test_rate_limit_gives_429(limited):
    start = time.monotonic()
    with httpx.Client() as client:
        codes = [client.get(limited.http + "/v1/models").status_code for _ in range(60)]
    allowed = 30 + 5 * (time.monotonic() - start)      # burst + rate x elapsed
    assert codes[0] == 200 and 429 in codes and codes.count(200) <= allowed + 1
    assert httpx.get(limited.http + "/health").status_code == 200      # never limited


def test_sigterm_drains_then_exits_0(limited):
    time.sleep(1)                      # refill the rate-limit bucket: 5 a second, 2 needed
    cm, resp = _stream(limited, tokens=48, key=None)   # in flight at SIGTERM, done well in 60 s
    lines = resp.iter_lines()
    assert next(lines).startswith("data:")
    limited.proc.send_signal(15)
    deadline = time.monotonic() + 10                   # the launcher tells the frontends
    while httpx.get(limited.http + "/health").status_code != 503:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    _error(_post(limited, "/v1/completions", {"prompt": "x"}, key=None), 503)
    rest = [line for line in lines if line]
    cm.__exit__(None, None, None)
    assert rest[-1] == "data: [DONE]"
    events = [json.loads(line[6:]) for line in rest if line.startswith("data: {")]
    assert "error" not in events[-1], events[-1]
    finishes = [e["choices"][0]["finish_reason"] for e in events]
    assert finishes[-1] == "length"
    assert limited.proc.wait(30) == 0


def test_disconnect_while_waiting_for_a_whole_response_frees_blocks(server):
    body = {"prompt": "Tell me a long story", "max_tokens": 400, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        _post(server, "/v1/completions", body, timeout=1.0)
    with Client(server.addresses[0], timeout=30) as c:
        deadline = time.monotonic() + 15
        while (s := c.stats()).num_running or s.num_free_blocks != s.num_total_blocks:
            assert time.monotonic() < deadline, s
            time.sleep(0.1)


def test_bench_serving_against_the_server(server, tmp_path):
    import benchmarks.serving as bench
    out = tmp_path / "serving.json"
    [report] = bench.main(["--base-url", server.http, "--api-key", KEYS[0], "--num-prompts", "6",
                           "--request-rate", "20", "--max-concurrency", "3",
                           "--random-input-len", "32", "--random-output-len", "8",
                           "--output", str(out)])
    assert report["completed"] == 6 and report["failed"] == 0
    assert report["total_output_tokens"] == 48 and report["ttft_ms"]["p50"] > 0
    assert json.loads(out.read_text().splitlines()[-1])["completed"] == 6


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl to make a certificate")
def test_https_and_cors_when_asked(server, tmp_path):
    """--ssl-keyfile/--ssl-certfile serve HTTPS (plain HTTP is refused on that port; a key
    that cannot be read stops the launch, naming the files);
    --allowed-origins answers browsers' preflights from those origins (no key needed for the
    preflight; the request itself still needs one) and no others. Without the flag (the
    module's server) no CORS header is sent."""
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout",
                    str(key), "-out", str(cert), "-days", "2", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    bad = run_serve("--ssl-keyfile", str(tmp_path / "missing.pem"), "--ssl-certfile", str(cert))
    _, err = bad.communicate(timeout=120)
    assert bad.returncode != 0 and "cannot serve HTTPS with --ssl-certfile" in err, err[-2000:]
    origin = "https://app.example.com"
    tls = start_server("--ssl-keyfile", str(key), "--ssl-certfile", str(cert),
                       "--allowed-origins", origin, "--api-key", KEYS[0])
    try:
        assert tls.http.startswith("https://")
        auth = {"Authorization": f"Bearer {KEYS[0]}"}
        r = httpx.get(tls.http + "/v1/models", headers={**auth, "Origin": origin},
                      verify=str(cert), timeout=30)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin
        assert httpx.get(tls.http + "/v1/models", verify=str(cert),
                         timeout=30).status_code == 401
        with pytest.raises(httpx.HTTPError):
            httpx.get(tls.http.replace("https://", "http://") + "/v1/models", headers=auth,
                      timeout=10)
        preflight = {"Origin": origin, "Access-Control-Request-Method": "POST",
                     "Access-Control-Request-Headers": "authorization, content-type"}
        r = httpx.options(tls.http + "/v1/chat/completions", headers=preflight,
                          verify=str(cert), timeout=30)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin
        r = httpx.options(tls.http + "/v1/chat/completions",
                          headers={**preflight, "Origin": "https://evil.example"},
                          verify=str(cert), timeout=30)
        assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    finally:
        tls.kill_all()
    r = httpx.get(server.http + "/v1/models", headers={"Authorization": f"Bearer {KEYS[0]}",
                                                       "Origin": origin}, timeout=30)
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
