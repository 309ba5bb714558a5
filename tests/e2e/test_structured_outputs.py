"""Structured outputs end to end with the default model: through the `openai` client against
`conveyor serve` (response_format with a Pydantic model, json_schema, vLLM's structured_outputs
and guided_* fields, streaming, n > 1, bad constraints refused with 400), through the ZMQ
client, and offline through LLM (with a KV pool so small that sequences are preempted and
recomputed mid-output). Every sampled output must satisfy its constraint."""
import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from serve_util import start_server

from conveyor import SamplingParams
from conveyor.shared.model_files import default_model_path
from conveyor.shared.structured_outputs import StructuredOutputs

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not default_model_path().is_file(),
                                                   reason="default model not fetched")]

# nested objects, enums, arrays and required fields, bounded so that 60 tokens always suffice
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "role": {"type": "string", "enum": ["admin", "editor", "viewer"]},
        "ok": {"type": "boolean"},
        "home": {
            "type": "object",
            "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["zip"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]},
                 "maxItems": 2},
    },
    "required": ["name", "role", "ok", "home", "tags"],
    "additionalProperties": False,
}
PROMPT = [{"role": "user", "content": "Give me a user record as JSON."}]
PHONE = r"\(\d{3}\) \d{3}-\d{4}"
CHOICES = ["positive", "negative", "neutral"]


class City(BaseModel):
    name: str = Field(max_length=16)
    country: Literal["France", "Japan", "Peru"]
    population_millions: int = Field(ge=0, le=99)


@pytest.fixture(scope="module")
def server():
    s = start_server("--max-n", "8")
    yield s
    s.kill_all()


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.http + "/v1", api_key="none", max_retries=0,
                         timeout=300)


def test_parse_returns_a_pydantic_object(oai):
    r = oai.chat.completions.parse(
        model=None, messages=[{"role": "user", "content": "Describe Paris."}],
        response_format=City, max_tokens=80, temperature=0)
    city = r.choices[0].message.parsed
    assert isinstance(city, City), r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"


@pytest.mark.timeout(1200)   # 50 x ~45 tokens at once: ~20 s on two idle cores, more if busy
def test_sampled_json_always_validates(oai):
    """50 samples at temperature 1 (four requests of n=8 plus single ones, all at once)."""
    fmt = {"type": "json_schema", "json_schema": {"name": "user", "schema": SCHEMA,
                                                  "strict": True}}

    def ask(n):
        return oai.with_options(timeout=1100).chat.completions.create(
            model=None, messages=PROMPT, response_format=fmt, temperature=1.0, max_tokens=60, n=n)

    with ThreadPoolExecutor(22) as pool:
        responses = list(pool.map(ask, [8] * 4 + [1] * 18))
    choices = [c for r in responses for c in r.choices]
    assert len(choices) == 50
    for c in choices:
        assert c.finish_reason == "stop", c.message.content
        jsonschema.validate(json.loads(c.message.content), SCHEMA)


def test_guided_regex_and_choice(oai):
    r = oai.completions.create(model=None, prompt="Call me at", max_tokens=20, temperature=1,
                               n=4, extra_body={"guided_regex": PHONE})
    for c in r.choices:
        assert re.fullmatch(PHONE, c.text), c.text
    r = oai.chat.completions.create(
        model=None, messages=[{"role": "user", "content": "Is this review good? 'Loved it'"}],
        max_tokens=10, temperature=1, n=4, extra_body={"guided_choice": CHOICES})
    for c in r.choices:
        assert c.message.content in CHOICES
    r = oai.chat.completions.create(
        model=None, messages=PROMPT, max_tokens=10, temperature=1,
        extra_body={"structured_outputs": {"grammar": 'start: "yes" | "no" | "maybe"'}})
    assert r.choices[0].message.content in ("yes", "no", "maybe")
    r = oai.chat.completions.create(
        model=None, max_tokens=60, temperature=0, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": 'Reply {"ok": true} and nothing else.'}])
    c = r.choices[0]   # any JSON object: unbounded, so max_tokens may cut it
    assert c.message.content.startswith("{")
    if c.finish_reason == "stop":
        assert isinstance(json.loads(c.message.content), dict)


def test_a_complete_output_ends_before_min_tokens(oai):
    """min_tokens past what the constraint allows: the grammar wins, the output ends once it is
    complete (an end token is banned only where something else is allowed), greedy and sampled;
    the end token of a choice is drawn, never a token the grammar forbids."""
    for temperature in (0, 1):
        r = oai.completions.create(model=None, prompt="Is the sky blue? Answer:", max_tokens=20,
                                   temperature=temperature, n=2,
                                   extra_body={"guided_choice": ["yes", "no"], "min_tokens": 10,
                                               "return_token_ids": True})
        for c in r.choices:
            assert c.text in ("yes", "no") and c.finish_reason == "stop", c
            assert len(c.model_extra["token_ids"]) <= 3, c

def test_constraints_that_leave_no_token_end_the_output(oai):
    """allowed_token_ids none of which the regex allows: the output ends at once (EOS), where
    it drew token 0 to max_tokens."""
    for temperature in (0, 1):
        r = oai.completions.create(model=None, prompt="Digits:", max_tokens=8,
                                   temperature=temperature, extra_body={
                                       "guided_regex": "[a-z]{5}", "allowed_token_ids": [35, 36],
                                       "return_token_ids": True})
        c = r.choices[0]
        assert (c.text, c.finish_reason, r.usage.completion_tokens) == ("", "stop", 1), c


def test_streaming_agrees_with_whole(oai):
    body = dict(model=None, messages=PROMPT, max_tokens=60, temperature=1.0, seed=7,
                extra_body={"guided_json": SCHEMA})
    whole = oai.chat.completions.create(**body).choices[0].message.content
    parts = [c.choices[0].delta.content or "" for c in
             oai.chat.completions.create(stream=True, **body) if c.choices]
    assert "".join(parts) == whole
    jsonschema.validate(json.loads(whole), SCHEMA)


@pytest.mark.parametrize("extra,words", [
    ({"guided_json": {"type": "object", "properties": {"a": {"type": "strnig"}}}}, "JSON schema"),
    ({"guided_json": "{not json"}, "not valid JSON"),
    ({"guided_regex": "a(b"}, "regex"),
    ({"guided_grammar": "start: missing_rule"}, "grammar"),
    ({"guided_choice": []}, "choice"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "at most one"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "whitespace_pattern"),
    ({"structured_outputs": {}}, "exactly one"),
    ({"response_format": {"type": "json_schema"}}, "json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
])
def test_bad_constraints_are_400(server, extra, words):
    for path, body in (("/v1/chat/completions", {"messages": PROMPT}),
                       ("/v1/completions", {"prompt": "hi"})):
        r = httpx.post(server.http + path, json={**body, "max_tokens": 5, **extra}, timeout=60)
        assert r.status_code == 400, r.text
        assert words in r.json()["error"]["message"]


def test_zmq_client(server):
    from conveyor.client import Client

    params = SamplingParams(temperature=1.0, max_tokens=20, n=3,
                            structured_outputs=StructuredOutputs(regex=PHONE))
    with Client(server.addresses[0], timeout=120) as client:
        out = client.generate("My number is", params)
    assert len(out.outputs) == 3
    for c in out.outputs:
        assert re.fullmatch(PHONE, c.text), c.text


def test_offline_with_preemption():
    """A pool of 12 blocks of 16 tokens for 4 sequences of ~80 tokens: they preempt one
    another and are recomputed; the replayed matchers keep every output valid."""
    from conveyor import LLM

    llm = LLM(max_model_len=512, num_kv_blocks=12, max_num_batched_tokens=64)
    so = StructuredOutputs(json=SCHEMA)
    outs = llm.chat([PROMPT] * 2, SamplingParams(temperature=1.0, max_tokens=60, n=2, seed=3,
                                                 structured_outputs=so), use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    for o in outs:
        for c in o.outputs:
            assert c.finish_reason == "stop", c.text
            jsonschema.validate(json.loads(c.text), SCHEMA)


@pytest.mark.parametrize("n", [1, 2])
def test_both_orders_of_a_constrained_step_give_the_same_tokens(monkeypatch, n):
    """A constrained step either reads the previous step's tokens before launching its forward
    pass (its bitmask fills during the launch; taken when the device is idle, always on the
    CPU) or after (when the device is busy). Forced each way, a greedy mixed batch (JSON,
    regex, free; and with n = 2, a request's samples side by side) gives the same tokens and
    logprobs."""
    from conveyor import LLM
    from conveyor.worker.model_runner import ModelRunner

    greedy = dict(temperature=0, max_tokens=40, logprobs=3, n=n)
    params = [SamplingParams(**greedy, structured_outputs=StructuredOutputs(json=SCHEMA)),
              SamplingParams(**greedy, structured_outputs=StructuredOutputs(regex=PHONE)),
              SamplingParams(**greedy)]
    prompts = ["A user record as JSON:", "My phone number is", "The three primary colors are"]
    llm = LLM(max_model_len=512)
    runs = {}
    for first in (True, False):
        monkeypatch.setattr(ModelRunner, "_reads_first", lambda self, first=first: first)
        outs = llm.generate(prompts, params, use_tqdm=False)
        runs[first] = [[(c.token_ids, c.logprobs, c.text) for c in o.outputs] for o in outs]
    assert runs[True] == runs[False]
    for _, _, text in runs[True][1]:
        assert re.fullmatch(PHONE, text), text


def test_tp3_mixed_batch_equals_one_process():
    """At TP 3 (gloo on the CPU) rank 0 fills a constrained step's bitmask on its fill thread
    while every rank holds back that step's sampling to the next submit: greedy JSON, regex and
    unconstrained requests in one batch give the in-process engine's tokens (STYLE.md's top-5
    rule) and each constrained one validates."""
    import asyncio

    from serve_util import assert_top5_close

    from conveyor import LLM
    from conveyor.client import AsyncClient

    greedy = dict(temperature=0, max_tokens=60, logprobs=5)
    params = [SamplingParams(**greedy, structured_outputs=StructuredOutputs(json=SCHEMA)),
              SamplingParams(**greedy, structured_outputs=StructuredOutputs(regex=PHONE)),
              SamplingParams(**greedy)]
    prompts = ["A user record as JSON:", "My phone number is", "The three primary colors are"]
    reference = [o.outputs[0] for o in
                 LLM(max_model_len=512, device="cpu").generate(prompts, params, use_tqdm=False)]

    async def served(address):
        client = AsyncClient(address)
        try:
            outs = await asyncio.gather(*(client.generate(p, s) for p, s in zip(prompts, params)))
        finally:
            client.close()
        return [o.outputs[0] for o in outs]

    server = start_server("--tp", "3", "--device", "cpu", "--max-model-len", "512",
                          "--port", "-1")
    try:
        got = asyncio.run(served(server.addresses[0]))
    finally:
        server.kill_all()
    assert_top5_close(reference, got)
    jsonschema.validate(json.loads(got[0].text), SCHEMA)
    assert re.fullmatch(PHONE, got[1].text), got[1].text
