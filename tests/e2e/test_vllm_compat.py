"""`conveyor serve MODEL` as a vLLM user drives it, on CPU with the default model: the model as a
positional argument, --generation-config defaults, an inline --chat-template, several served
names; the completions API as lm-eval and the OpenAI spec use it (echo + logprobs with the
prompt's logprobs, max_tokens 0, prompt_logprobs, logit_bias, allowed_token_ids, bad_words, refusals
naming the field)."""
import json

import httpx
import pytest
from serve_util import start_server

from benchmarks.stresskit.harness import parse_metrics
from conveyor.shared.model_files import default_model_path

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not default_model_path().is_file(),
                                                   reason="default model not fetched")]

KEY = "compat-key"
TEMPLATE = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    gen = tmp_path_factory.mktemp("generation")
    (gen / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.0, "max_new_tokens": 5, "bos_token_id": 0}))
    s = start_server(str(default_model_path()), "--generation-config", str(gen),
                     "--chat-template", TEMPLATE, "--served-model-name", "smol", "other",
                     "--api-key", KEY)
    yield s
    s.kill_all()


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.http + path, json=body, timeout=120,
                      headers={"Authorization": f"Bearer {KEY}"})


def ok(server, path: str, body: dict) -> dict:
    r = post(server, path, body)
    assert r.status_code == 200, r.text
    return r.json()


def test_echo_with_logprobs_gives_the_prompt_logprobs(server):
    gen = ok(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "temperature": 0,
                                         "logprobs": 1, "return_token_ids": True})
    choice = gen["choices"][0]
    ids = ok(server, "/tokenize", {"prompt": PROMPT})["tokens"]

    body = {"prompt": [ids + choice["token_ids"]], "max_tokens": 0, "echo": True,
            "logprobs": 2, "temperature": 0}
    echo = ok(server, "/v1/completions", body)
    c = echo["choices"][0]
    lp = c["logprobs"]
    n = len(ids) + 3
    assert echo["usage"] == {"prompt_tokens": n, "completion_tokens": 0, "total_tokens": n}
    assert c["text"] == PROMPT + choice["text"] and c["finish_reason"] == "length"
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == n
    assert "".join(lp["tokens"]) == c["text"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["text_offset"] == [sum(map(len, lp["tokens"][:i])) for i in range(n)]
    for token, value, top in zip(lp["tokens"][1:], lp["token_logprobs"][1:],
                                 lp["top_logprobs"][1:]):
        assert top[token] == value <= 0 and 1 <= len(top) <= 3     # chosen + top 2
        assert max(top.values()) >= value
    # the prompt path's logprobs of the generated tokens equal the sampler's, when generated
    assert lp["token_logprobs"][-3:] == pytest.approx(
        choice["logprobs"]["token_logprobs"], abs=1e-4)

    # lm-eval's loglikelihood request: one more token, its logprob after the prompt's
    body.update(max_tokens=1, logprobs=1)
    one = ok(server, "/v1/completions", body)["choices"][0]
    assert one["logprobs"]["token_logprobs"][:n] == pytest.approx(lp["token_logprobs"], abs=1e-5)
    assert len(one["logprobs"]["tokens"]) == n + 1

    # streamed: the same text and tokens, the prompt's first
    stream = httpx.post(server.http + "/v1/completions", timeout=120,
                        headers={"Authorization": f"Bearer {KEY}"},
                        json={"prompt": PROMPT, "max_tokens": 3, "temperature": 0,
                              "logprobs": 1, "echo": True, "stream": True})
    chunks = [json.loads(line[6:]) for line in stream.text.splitlines()
              if line.startswith("data: {")]
    text = "".join(ch["choices"][0]["text"] for ch in chunks)
    tokens = [t for ch in chunks for t in ch["choices"][0]["logprobs"]["tokens"]]
    assert text == PROMPT + choice["text"] and "".join(tokens) == text


def test_prompt_logprobs_for_completions_and_chat(server):
    c = ok(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "prompt_logprobs": 1,
                                       "temperature": 0})
    ids = ok(server, "/tokenize", {"prompt": PROMPT})["tokens"]
    plp = c["choices"][0]["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    for token, entry in zip(ids[1:], plp[1:]):
        assert str(token) in entry and len(entry) <= 2
        assert all(v["logprob"] <= 0 and v["rank"] >= 1 for v in entry.values())
    chat = ok(server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
        "prompt_logprobs": 0})
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    assert chat["prompt_logprobs"][0] is None
    r = post(server, "/v1/completions", {"prompt": "x", "prompt_logprobs": 1, "stream": True})
    assert r.status_code == 400 and "prompt_logprobs" in r.json()["error"]["message"]


def test_logit_bias(server):
    base = {"prompt": PROMPT, "max_tokens": 1, "temperature": 0, "return_token_ids": True}
    [first] = ok(server, "/v1/completions", base)["choices"][0]["token_ids"]
    banned = ok(server, "/v1/completions", {**base, "logit_bias": {str(first): -100}})
    assert banned["choices"][0]["token_ids"] != [first]
    forced = ok(server, "/v1/completions", {**base, "logit_bias": {"42": 100}})
    assert forced["choices"][0]["token_ids"] == [42]
    for bias, needle in (({"x": 1}, "logit_bias"), ({"1": 500}, "logit_bias"),
                         ({str(10 ** 7): 1}, "vocabulary")):
        r = post(server, "/v1/completions", {**base, "logit_bias": bias})
        assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text



def test_allowed_token_ids(server):
    """vLLM's allowed_token_ids: greedy and sampled, every drawn token is one of them (the
    greedy one the most likely of them: not the unrestricted choice); ids outside the
    vocabulary or none at all are a 400."""
    base = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "return_token_ids": True,
            "ignore_eos": True}
    free = ok(server, "/v1/completions", base)["choices"][0]["token_ids"]
    allowed = [t for t in range(300, 1300, 7) if t not in free]
    for extra in ({}, {"temperature": 1.0, "n": 3, "seed": 1}):
        r = ok(server, "/v1/completions", {**base, **extra, "allowed_token_ids": allowed})
        for c in r["choices"]:
            assert set(c["token_ids"]) <= set(allowed), c
    for bad, needle in (([10 ** 7], "vocabulary"), ([], "allowed_token_ids")):
        r = post(server, "/v1/completions", {**base, "allowed_token_ids": bad})
        assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text


def test_bad_words(server):
    """vLLM's bad_words: the words the free chat answer writes first are never drawn (as
    their tokens, alone or after a space), in completions and chat; an empty word is a 400."""
    chat = {"messages": [{"role": "user", "content": "Name three colors."}], "max_tokens": 24,
            "temperature": 0}
    free = ok(server, "/v1/chat/completions", chat)["choices"][0]["message"]["content"]
    words = [w.strip(".,:") for w in free.split()[:3] if w.strip(".,:")]
    held = ok(server, "/v1/chat/completions", {**chat, "bad_words": words})
    text = held["choices"][0]["message"]["content"]
    assert text != free and not any(f" {w} " in f" {text} " for w in words), (words, text)
    r = ok(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                                        "bad_words": words})
    assert not any(f" {w} " in f" {r['choices'][0]['text']} " for w in words)
    r = post(server, "/v1/completions", {"prompt": "x", "bad_words": [" "]})
    assert r.status_code == 400 and "bad_words" in r.json()["error"]["message"], r.text


def test_truncate_prompt_tokens(server):
    """vLLM's truncate_prompt_tokens: the prompt's last k tokens only (the same completion as
    sending those ids), in completions and chat; -1 keeps what leaves room for max_tokens, so a
    prompt longer than the context is served; with echo, or 0, it is a 400."""
    ids = ok(server, "/tokenize", {"prompt": "one two three four five six seven eight"})["tokens"]
    base = {"max_tokens": 6, "temperature": 0, "return_token_ids": True}
    cut = ok(server, "/v1/completions", {**base, "prompt": "one two three four five six seven "
                                         "eight", "truncate_prompt_tokens": 3})
    assert cut["usage"]["prompt_tokens"] == 3
    alone = ok(server, "/v1/completions", {**base, "prompt": ids[-3:]})
    assert cut["choices"][0]["token_ids"] == alone["choices"][0]["token_ids"]
    chat = ok(server, "/v1/chat/completions", {**base, "truncate_prompt_tokens": 4,
                                               "messages": [{"role": "user", "content": "hi"}]})
    assert chat["usage"]["prompt_tokens"] <= 4
    long = " ".join(["word"] * 600)                              # more than the 512 context
    r = post(server, "/v1/completions", {**base, "prompt": long})
    assert r.status_code == 400
    r = ok(server, "/v1/completions", {**base, "prompt": long, "truncate_prompt_tokens": -1})
    assert r["usage"]["prompt_tokens"] == 512 - 6
    for extra, needle in (({"echo": True}, "echo"), ({}, "truncate_prompt_tokens")):
        r = post(server, "/v1/completions", {"prompt": "x", "truncate_prompt_tokens":
                                             3 if extra else 0, **extra})
        assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text


def test_request_id_names_the_response(server):
    """vLLM's request_id: the response's id is cmpl-ID / chatcmpl-ID (whole and streamed);
    two requests naming the same id both complete; an unprintable one is a 400."""
    import concurrent.futures

    body = {"prompt": PROMPT, "max_tokens": 3, "request_id": "mine-1"}
    assert ok(server, "/v1/completions", body)["id"] == "cmpl-mine-1"
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        twice = list(pool.map(lambda _: ok(server, "/v1/completions", body), range(2)))
    assert [r["id"] for r in twice] == ["cmpl-mine-1"] * 2
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
            "request_id": "mine-2"}
    assert ok(server, "/v1/chat/completions", chat)["id"] == "chatcmpl-mine-2"
    with httpx.stream("POST", server.http + "/v1/chat/completions", timeout=60,
                      json={**chat, "stream": True},
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        ids = {json.loads(line[6:])["id"] for line in r.iter_lines()
               if line.startswith("data: {")}
    assert ids == {"chatcmpl-mine-2"}
    r = post(server, "/v1/completions", {**body, "request_id": "a\nb"})
    assert r.status_code == 400 and "request_id" in r.json()["error"]["message"]


def test_chat_echo_starts_the_reply_with_the_last_assistant_message(server):
    """vLLM's chat echo: a last assistant message (continued) starts the reply's content,
    whole and streamed alike; after a user message nothing is echoed."""
    base = {"max_tokens": 5, "temperature": 0, "echo": True}
    go_on = {**base, "add_generation_prompt": False, "continue_final_message": True,
             "messages": [{"role": "user", "content": "Count"},
                          {"role": "assistant", "content": "One, two,"}]}
    whole = ok(server, "/v1/chat/completions", go_on)["choices"][0]["message"]["content"]
    plain = ok(server, "/v1/chat/completions", {**go_on, "echo": False})
    assert whole == "One, two," + plain["choices"][0]["message"]["content"]
    with httpx.stream("POST", server.http + "/v1/chat/completions", timeout=60,
                      json={**go_on, "stream": True},
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        streamed = "".join(
            (c["delta"].get("content") or "") for line in r.iter_lines()
            if line.startswith("data: {") for c in json.loads(line[6:])["choices"])
    assert streamed == whole
    user_last = ok(server, "/v1/chat/completions", {
        **base, "messages": [{"role": "user", "content": "Count"}]})
    no_echo = ok(server, "/v1/chat/completions", {
        **base, "echo": False, "messages": [{"role": "user", "content": "Count"}]})
    assert user_last["choices"][0]["message"] == no_echo["choices"][0]["message"]


@pytest.mark.parametrize("body,field", [
    ({"prompt": "x", "suffix": "y"}, "suffix"),
    ({"prompt": "x", "best_of": 3}, "best_of"),
    ({"prompt": "x", "best_of": 3, "n": 2}, "best_of"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
])
def test_fields_not_honoured_are_refused_by_name(server, body, field):
    r = post(server, "/v1/completions", body)
    assert r.status_code == 400 and field in r.json()["error"]["message"], r.text


def test_unknown_model_is_404_model_not_found(server):
    r = post(server, "/v1/completions", {"prompt": "x", "model": "gpt-4"})
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found" and r.json()["error"]["param"] == "model"


def test_served_names_generation_config_and_chat_template(server):
    models = httpx.get(server.http + "/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    assert [m["id"] for m in models.json()["data"]] == ["smol", "other"]
    messages = [{"role": "user", "content": "Say hi"}]
    # generation_config.json: temperature 0 and 5 new tokens for a request that sets neither
    one = ok(server, "/v1/chat/completions", {"messages": messages, "model": "other"})
    two = ok(server, "/v1/chat/completions", {"messages": messages})
    assert one["usage"]["completion_tokens"] == 5 and one["model"] == "other"
    assert one["choices"][0]["message"] == two["choices"][0]["message"]
    longer = ok(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 7,
                                                 "ignore_eos": True})
    assert longer["usage"]["completion_tokens"] == 7
    # the inline template: the contents in brackets, nothing else
    templated = ok(server, "/tokenize", {"messages": messages})["tokens"]
    assert templated == ok(server, "/tokenize", {"prompt": "[Say hi]",
                                                 "add_special_tokens": False})["tokens"]
    assert one["usage"]["prompt_tokens"] == len(templated)
    text = httpx.get(server.http + "/metrics").text                # no key needed
    assert 'model_name="smol"' in text and "model_name=" in text.splitlines()[-1]
    assert parse_metrics(text)["conveyor:request_success_total{finished_reason=length}"] >= 2
