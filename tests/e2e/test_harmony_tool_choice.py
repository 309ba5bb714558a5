"""gpt-oss's tool choices through `conveyor serve --reasoning-parser openai_gptoss
--tool-call-parser openai` and the `openai` client, on a tiny random model whose tokenizer is the
default model's with harmony's markers added as special tokens (no gpt-oss fits here). Its
draws are random, so "required" and a named function show what the call grammar holds: every
output is a harmony call of an offered function with arguments of its schema, read as one tool
call, streamed or not. A bias on `<|end|>` ends a thought the random model would otherwise write
until max_tokens."""
import json

import jsonschema
import openai
import pytest
from models_util import make_tiny_model
from serve_util import start_server

from conveyor.frontend.tokenizer import load_tokenizer
from conveyor.shared.model_files import default_model_path, resolve_model

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not default_model_path().is_file(),
                                                   reason="default model not fetched")]

MARKERS = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|constrain|>",
           "<|return|>"]
# harmony's layout, cut down: the functions in a developer message, then the turns
TEMPLATE = (
    "{%- if tools %}<|start|>developer<|message|># Tools\nnamespace functions {\n"
    "{%- for t in tools %}type {{ t.function.name }} = (_: any) => any;\n{% endfor %}"
    "} // namespace functions<|end|>{%- endif %}"
    "{%- for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>"
    "{%- endfor %}{%- if add_generation_prompt %}<|start|>assistant{%- endif %}")
# bounded: every draw that follows them ends
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"unit": {"enum": ["C", "F"]}, "days": {"enum": [1, 2, 3]}},
    "required": ["unit", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"utc": {"type": "boolean"}}, "required": ["utc"],
    "additionalProperties": False}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from transformers import GenerationConfig

    tok = load_tokenizer(resolve_model(None))
    tok.add_special_tokens({"additional_special_tokens": MARKERS})
    path = make_tiny_model("llama", tmp_path_factory.mktemp("harmony"), vocab_size=len(tok),
                           max_position_embeddings=512)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    ends = [tok.eos_token_id] + tok.convert_tokens_to_ids(["<|call|>", "<|return|>"])
    GenerationConfig(eos_token_id=ends).save_pretrained(path)
    return path, tok


@pytest.fixture(scope="module")
def oai(model):
    server = start_server("--model", str(model[0]), "--served-model-name", "x",
                          "--reasoning-parser", "openai_gptoss",
                          "--enable-auto-tool-choice", "--tool-call-parser", "openai")
    try:
        yield openai.OpenAI(base_url=server.http + "/v1", api_key="none", max_retries=0,
                            timeout=120)
    finally:
        server.kill_all()


def _ask(oai, tok, choice, seed: int, stream: bool = False):
    kw = dict(model="x", messages=ASK, tools=[WEATHER, TIME], tool_choice=choice,
              max_tokens=120, temperature=1, seed=seed,
              logit_bias={str(tok.convert_tokens_to_ids("<|end|>")): 100})
    if not stream:
        m = oai.chat.completions.create(**kw).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in m.message.tool_calls or []]
        extra = m.message.model_extra or {}
        return extra.get("reasoning_content") or "", m.message.content or "", calls, \
            m.finish_reason
    reasoning, content, calls, finish = "", "", [], None
    for chunk in oai.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            reasoning += (c.delta.model_extra or {}).get("reasoning_content") or ""
            content += c.delta.content or ""
            for t in c.delta.tool_calls or []:
                if t.id is not None:
                    calls.append([t.function.name, ""])
                calls[t.index][1] += t.function.arguments or ""
            finish = c.finish_reason or finish
    return reasoning, content, [tuple(c) for c in calls], finish


@pytest.mark.parametrize("choice", ["required",
                                    {"type": "function", "function": {"name": "get_time"}}])
def test_required_and_named_give_one_call_of_the_schema_streamed_or_not(oai, model, choice):
    tok = model[1]
    for seed in range(4):
        whole = _ask(oai, tok, choice, seed)
        reasoning, content, calls, finish = whole
        assert finish == "tool_calls" and len(calls) == 1, whole
        name, arguments = calls[0]
        assert name == "get_time" or choice == "required"
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])
        assert "<|" not in reasoning + content
        assert _ask(oai, tok, choice, seed, stream=True) == whole


def test_auto_and_none_are_not_held(oai, model):
    """Unheld, the random model's first token is anything: no call is forced on it."""
    for choice in ("auto", "none"):
        outs = [_ask(oai, model[1], choice, seed) for seed in range(3)]
        assert not any(calls for _, _, calls, _ in outs), outs
