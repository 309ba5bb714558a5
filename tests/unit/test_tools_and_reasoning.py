"""Tool choice and its JSON-schema constraint (checked with jsonschema), reasoning parsers, and
one chat choice's output read whole and streamed."""
import json
from pathlib import Path

import jsonschema
import msgspec
import pytest

from conveyor.frontend.chat_output import ChatReader
from conveyor.frontend.core import FrontendCore
from conveyor.frontend.reasoning import (
    REASONING_PARSERS,
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
)
from conveyor.frontend.tokenizer import apply_chat_template, load_tokenizer
from conveyor.frontend.tools import constraint_schema, tool_mode
from conveyor.shared.messages.client import GenerateRequest
from conveyor.shared.model_files import default_model_path, resolve_model
from conveyor.shared.sampling_params import SamplingParams
from conveyor.shared.structured_outputs import StructuredOutputs

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "array", "items": {"type": "integer"}, "maxItems": 3}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time"}}      # no parameters
TOOLS = [WEATHER, TIME]


def _validator(schema):
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def test_tool_choice_rules():
    assert tool_mode(None, None, True, None).choice == "none"
    assert tool_mode(TOOLS, "none", True, None).choice == "none"
    assert tool_mode(TOOLS, None, True, "hermes").choice == "auto"
    with pytest.raises(ValueError, match="--enable-auto-tool-choice"):
        tool_mode(TOOLS, None, True, None)
    with pytest.raises(ValueError, match="--enable-auto-tool-choice"):
        tool_mode(TOOLS, "auto", True, None)
    assert tool_mode(TOOLS, "required", False, None).choice == "required"
    named = tool_mode(TOOLS, {"type": "function", "function": {"name": "get_time"}}, True, None)
    assert (named.choice, named.name) == ("named", "get_time")
    for bad, needle in [("sometimes", "tool_choice"), ({"type": "function"}, "tool_choice"),
                        ({"type": "function", "function": {"name": "nope"}}, "not in tools")]:
        with pytest.raises(ValueError, match=needle):
            tool_mode(TOOLS, bad, True, None)
    with pytest.raises(ValueError, match="needs tools"):
        tool_mode(None, "required", True, None)
    for tools, needle in [([{"type": "code"}], r"tools\[0\]"),
                          ([WEATHER, {"type": "function", "function": {}}], r"tools\[1\]"),
                          ([{"type": "function", "function": {"name": "f", "parameters": 3}}],
                           "parameters")]:
        with pytest.raises(ValueError, match=needle):
            tool_mode(tools, "required", True, None)


def test_required_schema_accepts_calls_and_rejects_the_rest():
    schema = constraint_schema(tool_mode(TOOLS, "required", True, None))
    v = _validator(schema)
    good = [[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}],
            [{"name": "get_time", "parameters": {}},
             {"name": "get_weather", "parameters": {"city": "Oslo", "unit": "fahrenheit",
                                                    "days": [1, 2]}}]]
    bad = [[], {"name": "get_time", "parameters": {}},
           [{"name": "get_weather", "parameters": {"city": "Paris"}}],            # unit missing
           [{"name": "get_weather", "parameters": {"city": "Paris", "unit": "kelvin"}}],
           [{"name": "get_weather", "parameters": {"city": "P", "unit": "celsius", "x": 1}}],
           [{"name": "nope", "parameters": {}}], [{"name": "get_time"}],
           [{"name": "get_time", "parameters": {}, "extra": 1}]]
    assert all(v.is_valid(x) for x in good)
    assert not any(v.is_valid(x) for x in bad)
    single = _validator(constraint_schema(tool_mode(TOOLS, "required", False, None)))
    assert single.is_valid(good[0]) and not single.is_valid(good[1])


def test_named_schema_is_the_functions_parameters():
    named = tool_mode(TOOLS, {"type": "function", "function": {"name": "get_weather"}}, True,
                      None)
    v = _validator(constraint_schema(named))
    assert v.is_valid({"city": "Rome", "unit": "celsius"}) and not v.is_valid({"city": "Rome"})
    free = tool_mode(TOOLS, {"type": "function", "function": {"name": "get_time"}}, True, None)
    assert constraint_schema(free) == {"type": "object"}
    assert constraint_schema(tool_mode(TOOLS, None, True, "hermes")) is None


@pytest.mark.parametrize("choice,parallel", [("required", True), ("required", False),
                                             ({"type": "function",
                                               "function": {"name": "get_weather"}}, True)])
def test_output_that_satisfies_the_schema_parses_into_calls_that_satisfy_the_tools(
        choice, parallel):
    mode = tool_mode(TOOLS, choice, parallel, None)
    v = _validator(constraint_schema(mode))
    if mode.choice == "named":
        outputs = ['{"city": "Paris", "unit": "celsius"}',
                   '\n{ "unit" : "fahrenheit", "days": [1,2,3], "city": "Lima"}  ']
    else:
        outputs = ['[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}]',
                   '[ {"parameters": {}, "name": "get_time"} ]']
        if parallel:
            outputs.append('[{"name": "get_time", "parameters": {}}, {"name": "get_weather", '
                           '"parameters": {"city": "Oslo", "unit": "celsius", "days": [2]}}]')
    params = {f["function"]["name"]: f["function"].get("parameters") or {"type": "object"}
              for f in TOOLS}
    for text in outputs:
        assert v.is_valid(json.loads(text)), text
        for stream in (False, True):
            reader = ChatReader(None, mode)
            if stream:
                calls = []
                for ch in text:
                    calls += reader.delta(ch, final=False).get("tool_calls", [])
                calls += reader.delta("", final=True).get("tool_calls", [])
                names = [c["function"]["name"] for c in calls if "id" in c]
                args = ["".join(c["function"]["arguments"] for c in calls if c["index"] == i)
                        for i in range(len(names))]
            else:
                message = reader.message(text)
                assert message["content"] is None
                names = [c["function"]["name"] for c in message["tool_calls"]]
                args = [c["function"]["arguments"] for c in message["tool_calls"]]
            assert names and reader.called
            for name, a in zip(names, args):
                jsonschema.validate(json.loads(a), params[name])


THOUGHT = "The user wants 2+2.\nThat is <b>4</b>."
REASONING = [
    (Qwen3ReasoningParser, f"<think>\n{THOUGHT}\n</think>\n\nIt is 4.",
     f"\n{THOUGHT}\n", "It is 4."),
    (Qwen3ReasoningParser, "It is 4, no thinking.", "", "It is 4, no thinking."),
    (Qwen3ReasoningParser, f"<think>{THOUGHT}", THOUGHT, ""),                  # cut off
    (Qwen3ReasoningParser, "<thinking> is a word", "", "<thinking> is a word"),
    (DeepSeekR1ReasoningParser, f"{THOUGHT}\n</think>\n\nIt is 4.", f"{THOUGHT}\n", "It is 4."),
    (DeepSeekR1ReasoningParser, f"<think>{THOUGHT}</think>It is 4.", THOUGHT, "It is 4."),
    (DeepSeekR1ReasoningParser, THOUGHT, THOUGHT, ""),
    (DeepSeekR1ReasoningParser, "", "", ""),
]


@pytest.mark.parametrize("cls,text,thought,answer", REASONING)
def test_reasoning_whole_and_streamed_at_every_split(cls, text, thought, answer):
    assert cls.parse(text) == (thought, answer)
    for pieces in [list(text)] + [[text[:i], text[i:]] for i in range(len(text) + 1)]:
        p = cls()
        parts = [p.feed(x) for x in pieces] + [p.finish()]
        assert ("".join(r for r, _ in parts), "".join(c for _, c in parts)) == (thought, answer)


def test_reasoning_then_a_hermes_call_streamed_and_whole_agree():
    mode = tool_mode(TOOLS, "auto", True, "hermes")
    text = ("<think>\nI should call the weather tool.\n</think>\n\nChecking.\n<tool_call>\n"
            '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
            "</tool_call>")
    whole = ChatReader(Qwen3ReasoningParser, mode).message(text)
    assert whole["reasoning_content"] == "\nI should call the weather tool.\n"
    assert whole["content"] == "Checking."
    assert [c["function"]["name"] for c in whole["tool_calls"]] == ["get_weather"]
    for size in (1, 3, 7, 1000):
        reader, got = ChatReader(Qwen3ReasoningParser, mode), {}
        pieces = [text[i:i + size] for i in range(0, len(text), size)]
        for i, piece in enumerate(pieces):
            for key, value in reader.delta(piece, final=i == len(pieces) - 1).items():
                if key == "tool_calls":
                    for c in value:
                        got.setdefault("args", "")
                        got["args"] += c["function"]["arguments"]
                else:
                    got[key] = got.get(key, "") + value
        assert got == {"reasoning_content": whole["reasoning_content"],
                       "content": "Checking.",
                       "args": whole["tool_calls"][0]["function"]["arguments"]}


def test_parallel_tool_calls_false_keeps_the_first_call():
    mode = tool_mode(TOOLS, "auto", False, "hermes")
    text = ('<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
            '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>')
    assert len(ChatReader(None, mode).message(text)["tool_calls"]) == 1
    reader = ChatReader(None, mode)
    assert {c["index"] for c in reader.delta(text, final=True)["tool_calls"]} == {0}


@pytest.mark.skipif(not default_model_path().is_file(), reason="default model not fetched")
def test_the_constraint_starts_after_the_thought():
    tok = load_tokenizer(resolve_model(None))
    prompt = [{"role": "user", "content": "Hi"}]
    open_prompt = apply_chat_template(tok, prompt)
    closed_prompt = open_prompt + tok.encode("<think>\n\n</think>\n\n", add_special_tokens=False)
    end = Qwen3ReasoningParser.constraint_start(tok, open_prompt, None)
    assert tok.decode(end) == "</think>"
    assert Qwen3ReasoningParser.constraint_start(tok, closed_prompt, None) is None
    assert set(REASONING_PARSERS) == {"qwen3", "deepseek_r1", "glm45", "minimax_m2",
                                      "openai_gptoss"}


@pytest.mark.skipif(not default_model_path().is_file(), reason="default model not fetched")
def test_prepare_starts_a_chats_constraint_after_the_thought():
    """With a reasoning parser, FrontendCore.prepare gives a chat's constraint the end of the
    thought as its start (none when the prompt closed the thought, nor for a plain prompt, nor
    without a parser); a client's own start_after is kept, checked against the vocabulary."""
    template = Path(__file__).parent.parent / "data" / "tool_chat_template.jinja"
    tok = load_tokenizer(resolve_model(None), chat_template=str(template))
    end = tok.encode("</think>", add_special_tokens=False)
    params = SamplingParams(structured_outputs=StructuredOutputs(regex="[0-9]+"))
    chat = GenerateRequest(id="a", messages=[{"role": "user", "content": "A number?"}],
                           sampling=params)

    def start_after(req, reasoning=Qwen3ReasoningParser):
        core = FrontendCore(tok, len(tok), 2048, "f-", lambda m: None, reasoning=reasoning)
        return core.preparer.prepare(req, False)[2].structured_outputs.start_after

    assert start_after(chat) == end
    assert start_after(chat, DeepSeekR1ReasoningParser) == end
    assert start_after(chat, None) is None
    closed = msgspec.structs.replace(chat, chat_template_kwargs={"enable_thinking": False})
    assert start_after(closed) is None
    assert start_after(GenerateRequest(id="b", prompt="A number?", sampling=params)) is None
    own = msgspec.structs.replace(params, structured_outputs=StructuredOutputs(
        regex="[0-9]+", start_after=[7]))
    assert start_after(msgspec.structs.replace(chat, sampling=own)) == [7]
    huge = msgspec.structs.replace(params, structured_outputs=StructuredOutputs(
        regex="[0-9]+", start_after=[len(tok) + 5]))
    with pytest.raises(ValueError, match="structured_outputs.start_after out of the vocabulary"):
        start_after(msgspec.structs.replace(chat, sampling=huge))
