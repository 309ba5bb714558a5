"""Tool calling and reasoning through `conveyor serve` and the `openai` client, with the default
model. Its own chat template ignores tools, so the server gets the default model's tokenizer with
a test template (tests/data/tool_chat_template.jinja) that shows tools and renders calls in the
Hermes layout. Given a history of the same question answered by a call, the model (greedy)
writes that call again: a real output, read by the real parsers on the real server path."""
import json
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from serve_util import start_server

from conveyor.frontend.tokenizer import apply_chat_template, load_tokenizer
from conveyor.frontend.tools import history_tool_calls
from conveyor.shared.model_files import default_model_path, resolve_model
from conveyor.shared.sampling_params import SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not default_model_path().is_file(),
                                                   reason="default model not fetched")]

TEMPLATE = Path(__file__).parent.parent / "data" / "tool_chat_template.jinja"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TOOLS = [WEATHER]
WANT_ARGS = {"city": "Paris"}


def _call(i: int, as_text: bool) -> dict:
    args = json.dumps(WANT_ARGS) if as_text else WANT_ARGS
    return {"id": f"call_{i}", "type": "function",
            "function": {"name": "get_weather", "arguments": args}}


def _history(rounds: int = 3) -> list[dict]:
    """The question asked and answered by a call `rounds` times, then asked again. Arguments
    come as JSON text (as OpenAI clients send them) and, once, as an object."""
    messages = []
    for i in range(rounds):
        messages += [{"role": "user", "content": "What is the weather in Paris?"},
                     {"role": "assistant", "content": "", "tool_calls": [_call(i, i != 1)]},
                     {"role": "tool", "tool_call_id": f"call_{i}", "content": "18 C, sunny"},
                     {"role": "assistant", "content": "It is 18 C and sunny."}]
    return messages + [{"role": "user", "content": "What is the weather in Paris?"}]


THINKING = [{"role": "user", "content": "Say hello."},
            {"role": "assistant", "content": "<think>\nA greeting is asked for.\n</think>\n\n"
                                             "Hello!"}] * 3 + [{"role": "user",
                                                                "content": "Say hello."}]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """The default model's tokenizer with the test chat template."""
    tok = load_tokenizer(resolve_model(None))
    folder = tmp_path_factory.mktemp("tool-tokenizer")
    tok.save_pretrained(folder)
    for old in folder.glob("chat_template.*"):
        old.unlink()
    shutil.copy(TEMPLATE, folder / "chat_template.jinja")
    return folder


@pytest.fixture(scope="module")
def tok(tokenizer_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.fixture(scope="module")
def server(tokenizer_dir):
    s = start_server("--tokenizer", str(tokenizer_dir), "--max-model-len", "1024",
                     "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                     "--reasoning-parser", "qwen3", "--served-model-name", "x")
    yield s
    s.kill_all()


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.http + "/v1", api_key="none", max_retries=0,
                         timeout=120)


def _template_messages(messages):
    return [{**m, "tool_calls": history_tool_calls(m["tool_calls"], "m")} if "tool_calls" in m
            else m for m in messages]


def _prompt_len(tok, messages, **kwargs) -> int:
    return len(apply_chat_template(tok, _template_messages(messages), **kwargs))


def _streamed(oai, **kw):
    """(reasoning, content, [(id, name, arguments, pieces)], finish_reason) of a stream."""
    reasoning, content, calls, finish = "", "", [], None
    for chunk in oai.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            d = c.delta
            reasoning += (d.model_extra or {}).get("reasoning_content") or ""
            content += d.content or ""
            for t in d.tool_calls or []:
                if t.id is not None:
                    assert t.index == len(calls) and t.type == "function"
                    calls.append([t.id, t.function.name, "", 0])
                calls[t.index][2] += t.function.arguments or ""
                calls[t.index][3] += bool(t.function.arguments)
            finish = c.finish_reason or finish
    return reasoning, content, calls, finish


def test_tools_and_tool_history_reach_the_template(oai, tok):
    messages = _history()
    r = oai.chat.completions.create(model="x", messages=messages, tools=TOOLS, tool_choice="none",
                                    max_tokens=1, temperature=0)
    with_tools = _prompt_len(tok, messages, tools=TOOLS)
    assert r.usage.prompt_tokens == with_tools > _prompt_len(tok, messages) + 20
    rendered = tok.decode(apply_chat_template(tok, _template_messages(messages), tools=TOOLS))
    assert '"description": "Current weather in a city"' in rendered
    assert rendered.count('<tool_call>\n{"name": "get_weather", "arguments": {"city": '
                          '"Paris"}}') == 3 and rendered.count("<|im_start|>tool\n18 C") == 3


def test_auto_tool_choice_reads_the_models_call_streamed_or_not(oai):
    kw = {"model": "x", "messages": _history(), "tools": TOOLS, "max_tokens": 60,
          "temperature": 0}
    r = oai.chat.completions.create(**kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == WANT_ARGS and call.id.startswith("call_")
    reasoning, content, calls, finish = _streamed(oai, **kw)
    assert (reasoning, content, finish) == ("", "", "tool_calls")
    [(_, name, arguments, pieces)] = calls
    assert (name, arguments) == ("get_weather", call.function.arguments)
    assert pieces > 1                              # the arguments grew over several chunks


def test_tool_choice_none_leaves_the_call_as_text(oai):
    r = oai.chat.completions.create(model="x", messages=_history(), tools=TOOLS,
                                    tool_choice="none", max_tokens=60, temperature=0)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content.startswith('<tool_call>\n{"name": "get_weather"')


def test_reasoning_is_split_off_streamed_or_not(oai):
    r = oai.chat.completions.create(model="x", messages=THINKING, max_tokens=30, temperature=0)
    message = r.choices[0].message
    assert message.model_extra["reasoning_content"] == "\nA greeting is asked for.\n"
    assert message.content == "Hello!"
    reasoning, content, calls, finish = _streamed(oai, model="x", messages=THINKING,
                                                  max_tokens=30, temperature=0)
    assert (reasoning, content, calls) == (message.model_extra["reasoning_content"], "Hello!", [])
    # vLLM's include_reasoning: false: the thought is split off and not sent
    hidden = {"include_reasoning": False}
    r = oai.chat.completions.create(model="x", messages=THINKING, max_tokens=30, temperature=0,
                                    extra_body=hidden)
    assert r.choices[0].message.content == "Hello!"
    assert "reasoning_content" not in (r.choices[0].message.model_extra or {})
    assert _streamed(oai, model="x", messages=THINKING, max_tokens=30, temperature=0,
                     extra_body=hidden)[:3] == ("", "Hello!", [])


def test_chat_template_kwargs_reach_the_template(oai, tok):
    r = oai.chat.completions.create(model="x", messages=THINKING, max_tokens=30, temperature=0,
                                    extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    closed = _prompt_len(tok, THINKING, enable_thinking=False)
    assert r.usage.prompt_tokens == closed > _prompt_len(tok, THINKING)
    # the thought is closed in the prompt: the output has none
    assert r.choices[0].message.model_extra["reasoning_content"] is None
    assert r.choices[0].message.content


@pytest.mark.parametrize("body,needle", [
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0]"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "not in tools"),
    ({"tool_choice": "required"}, "needs tools"),
    ({"messages": [{"role": "user", "content": "Hi"},
                   {"role": "assistant", "tool_calls": [
                       {"type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
])
def test_bad_tool_requests_are_400(server, body, needle):
    body = {"model": "x", "messages": [{"role": "user", "content": "Hi"}], **body}
    r = httpx.post(server.http + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text


@pytest.mark.skipif("structured_outputs" not in SamplingParams.__struct_fields__,
                    reason="tool_choice required and named need structured output")
@pytest.mark.parametrize("choice", ["required",
                                    {"type": "function", "function": {"name": "get_weather"}}])
def test_required_and_named_calls_always_parse(oai, choice):
    """Thinking off (the prompt closes the thought): the call is constrained from the first
    token; with thinking on this model may open a thought it never closes. One call
    (parallel_tool_calls off) of a bounded schema (no other properties, a city of at most 40
    characters) ends inside max_tokens whatever is drawn: with WEATHER's open schema and calls
    in parallel a draw at temperature 1 could go on until max_tokens cut the call short, as one
    seed of five did on an H200."""
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    parameters = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
                  "required": ["city"], "additionalProperties": False}
    tool = {"type": "function", "function": {**WEATHER["function"], "parameters": parameters}}

    def ask(seed: int):
        return oai.chat.completions.create(model="x", messages=messages, tools=[tool],
                                           tool_choice=choice, parallel_tool_calls=False,
                                           max_tokens=200, temperature=1, seed=seed,
                                           extra_body={"chat_template_kwargs": {
                                               "enable_thinking": False}})

    with ThreadPoolExecutor(5) as pool:                  # five seeds, batched by the server
        responses = list(pool.map(ask, range(5)))
    for r in responses:
        calls = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls"
        assert len(calls) == 1 and calls[0].function.name == "get_weather"
        jsonschema.validate(json.loads(calls[0].function.arguments), parameters)


def test_a_constraint_holds_the_answer_after_a_free_thought(oai):
    """The thought the history taught is written freely; the regex holds what follows
    `</think>` (a constraint from the first token would allow no `<think>` at all), streamed or
    not. With the thought closed in the prompt, the constraint holds from the first token."""
    kw = {"model": "x", "messages": THINKING, "max_tokens": 30, "temperature": 0,
          "extra_body": {"guided_regex": "[0-9]{1,4}"}}
    r = oai.chat.completions.create(**kw)
    message = r.choices[0].message
    assert message.model_extra["reasoning_content"] == "\nA greeting is asked for.\n"
    assert re.fullmatch("[0-9]{1,4}", message.content), message.content
    assert _streamed(oai, **kw) == (message.model_extra["reasoning_content"], message.content,
                                    [], r.choices[0].finish_reason)
    kw["extra_body"]["chat_template_kwargs"] = {"enable_thinking": False}
    message = oai.chat.completions.create(**kw).choices[0].message
    assert message.model_extra["reasoning_content"] is None
    assert re.fullmatch("[0-9]{1,4}", message.content), message.content


def test_an_output_that_does_not_think_is_held_from_its_first_token(oai, tok):
    """qwen3's thought is optional: thinking on, an output that does not open with `<think>`
    (its first token pushed away here) is held by the constraint from the first token; it
    waited for a `</think>` this model never writes, and came out unconstrained. The same
    call with `<` pushed up thinks first (the free thought); its answer is still held."""
    lt = tok.encode("<", add_special_tokens=False)[0]
    kw = {"model": "x", "max_tokens": 40, "temperature": 0,
          "messages": [{"role": "user", "content": "Tell me about Paris."}]}
    for bias in (-100, 100):
        r = oai.chat.completions.create(**kw, extra_body={
            "guided_regex": "[0-9]{1,4}", "logit_bias": {str(lt): bias}})
        message = r.choices[0].message
        if bias < 0:
            assert message.model_extra.get("reasoning_content") is None
            assert re.fullmatch("[0-9]{1,4}", message.content), message.content
        else:
            assert message.model_extra["reasoning_content"]
            assert message.content is None or re.fullmatch("[0-9]{1,4}", message.content)


# --- the Responses API (POST /v1/responses): the same requests as Responses items -------------

def _as_items(messages: list[dict]) -> list[dict]:
    """Chat messages as Responses input items: an assistant's calls become function_call
    items, tool messages function_call_output items."""
    items = []
    for m in messages:
        if m.get("tool_calls"):
            items += [{"type": "function_call", "call_id": c["id"], "name": c["function"]["name"],
                       "arguments": c["function"]["arguments"] if isinstance(
                           c["function"]["arguments"], str) else json.dumps(
                           c["function"]["arguments"])} for c in m["tool_calls"]]
        elif m["role"] == "tool":
            items.append({"type": "function_call_output", "call_id": m["tool_call_id"],
                          "output": m["content"]})
        else:
            items.append({"role": m["role"], "content": m["content"]})
    return items


RESPONSES_TOOLS = [{"type": "function", **WEATHER["function"]}]


def _stream_events(oai, **kw) -> list:
    events = list(oai.responses.create(stream=True, **kw))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    assert events[0].response.output == [] and events[0].response.status == "in_progress"
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert all(getattr(i, "arguments", "") == "" for i in added)
    assert all(p.text == "" for i in added for p in getattr(i, "content", None) or [])
    return events


def test_responses_give_chats_answer_streamed_or_not(oai):
    chat = oai.chat.completions.create(model="x", messages=THINKING, max_tokens=30,
                                       temperature=0)
    r = oai.responses.create(model="x", input=_as_items(THINKING), max_output_tokens=30,
                             temperature=0)
    assert r.status == "completed" and r.object == "response"
    assert [item.type for item in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == chat.choices[0].message.model_extra[
        "reasoning_content"]
    assert r.output_text == chat.choices[0].message.content == "Hello!"
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens,
                                                             chat.usage.completion_tokens)
    events = _stream_events(oai, model="x", input=_as_items(THINKING), max_output_tokens=30,
                            temperature=0)
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert (thought, text) == (r.output[0].content[0].text, r.output_text)
    done = events[-1].response
    assert [item.type for item in done.output] == ["reasoning", "message"]
    assert done.output_text == r.output_text and done.usage.output_tokens == r.usage.output_tokens
    # instructions go first, as a system message; a short budget leaves the response incomplete
    short = oai.responses.create(model="x", input=_as_items(THINKING), max_output_tokens=3,
                                 instructions="Answer briefly.", temperature=0)
    assert short.status == "incomplete"
    assert short.incomplete_details.reason == "max_output_tokens"
    assert short.usage.input_tokens > r.usage.input_tokens


@pytest.mark.parametrize("choice", ["auto", "required",
                                    {"type": "function", "name": "get_weather"}])
def test_responses_call_functions_streamed_or_not(oai, choice):
    """The model's call as a function_call item (read by the hermes parser, or held to the
    grammar of a required or named choice, with the thought closed in the prompt as in
    test_required_and_named_calls_always_parse); its arguments grow by deltas in the stream."""
    kw = dict(model="x", input=_as_items(_history()), tools=RESPONSES_TOOLS, tool_choice=choice,
              temperature=0, max_output_tokens=60)
    if choice != "auto":               # a city of at most 40 characters ends inside the budget
        bounded = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
                   "required": ["city"], "additionalProperties": False}
        kw.update(tools=[{**RESPONSES_TOOLS[0], "parameters": bounded}], max_output_tokens=200,
                  extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    r = oai.responses.create(**kw)
    calls = [item for item in r.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    assert "city" in json.loads(calls[0].arguments) and calls[0].call_id.startswith("call_")
    assert choice != "auto" or json.loads(calls[0].arguments) == WANT_ARGS
    events = _stream_events(oai, **kw)
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and "".join(pieces) == done[0].arguments == calls[0].arguments
    streamed = [i for i in events[-1].response.output if i.type == "function_call"]
    assert [(c.name, c.arguments) for c in streamed] == [(c.name, c.arguments) for c in calls]


@pytest.mark.parametrize("body,needle", [
    ({"store": True}, "store is not supported"),
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type 'web_search'"),
    ({"reasoning": {"effort": "high"}}, "reasoning_effort is not supported"),   # its template
    ({"reasoning": {"effort": "max"}}, "reasoning.effort must be"),
    ({"reasoning": {"summary": "auto"}}, "reasoning.summary is not supported"),
    ({"input": [{"type": "image", "image_url": "x"}]}, "input[0].type 'image'"),
    ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "only text parts"),
    ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"modalities": ["text"]}, "unknown field `modalities`"),
])
def test_bad_responses_requests_are_400(server, body, needle):
    r = httpx.post(server.http + "/v1/responses", json={"input": "Hi", **body}, timeout=60)
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text


def test_responses_text_format_holds_the_answer_to_a_schema(oai):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
              "required": ["city"], "additionalProperties": False}
    kw = dict(model="x", input="Name a city.", max_output_tokens=40, temperature=0,
              text={"format": {"type": "json_schema", "name": "city", "schema": schema,
                               "strict": True}},
              extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    r = oai.responses.create(**kw)
    jsonschema.validate(json.loads(r.output_text), schema)
    # the thought closed in the prompt, text comes from the first piece: the stream's first
    # events (sent with it) still show the response and the message as they opened
    events = _stream_events(oai, **kw)
    assert events[-1].response.output_text == r.output_text
