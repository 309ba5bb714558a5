"""gpt-oss's harmony output (`--reasoning-parser openai_gptoss`, `--tool-call-parser openai`) on
recorded outputs in the format OpenAI documents: channels split into thought, content and calls,
whole and streamed split at every position, malformed output as content, and the server's
refusal of the tool parser without the reasoning parser."""
import json

import pytest

from conveyor.frontend.chat_output import ChatReader
from conveyor.frontend.reasoning import HarmonyReasoningParser
from conveyor.frontend.tools import constraint, tool_mode
from conveyor.shared.config import HttpConfig
from conveyor.shared.grammar import check as check_grammar
from conveyor.shared.structured_outputs import from_json_schema

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"location": {"type": "string"}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}

# output as the model writes it (after the prompt's <|start|>assistant), with the stop token
# where the engine keeps it -> (reasoning_content, content, [(name, arguments)])
CASES = [
    ("<|channel|>analysis<|message|>User asks for the weather in Tokyo. Use the tool.<|end|>"
     "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
     '<|message|>{"location":"Tokyo"}<|call|>',
     "User asks for the weather in Tokyo. Use the tool.", None,
     [("get_weather", {"location": "Tokyo"})]),
    ("<|channel|>analysis<|message|>Simple greeting.<|end|><|start|>assistant<|channel|>final"
     "<|message|>Hello! How can I help you today?<|return|>",
     "Simple greeting.", "Hello! How can I help you today?", []),
    # the stop token's text left out (the engine's default); no thought at all
    ("<|channel|>final<|message|>2 + 2 = 4.", None, "2 + 2 = 4.", []),
    # a preamble on the commentary channel, then two calls; the recipient before the channel
    ("<|channel|>analysis<|message|>Need both.<|end|><|start|>assistant<|channel|>commentary"
     "<|message|>Checking the weather and the time.<|end|><|start|>assistant to=functions."
     'get_weather<|channel|>commentary json<|message|>{"location": "Paris, \\"FR\\""}<|call|>'
     '<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{}<|call|>',
     "Need both.", "Checking the weather and the time.",
     [("get_weather", {"location": 'Paris, "FR"'}), ("get_time", {})]),
    # markers in the thought's text are the format's; braces and <| in a final answer are text
    ("<|channel|>analysis<|message|>x < y and {a}<|end|><|start|>assistant<|channel|>final"
     "<|message|>Use `<|` carefully: {\"k\": [1, 2]}<|return|>",
     "x < y and {a}", 'Use `<|` carefully: {"k": [1, 2]}', []),
    # not harmony at all (another model, or no markers): content as it is
    ("Plain text, no channels.", None, "Plain text, no channels.", []),
]
MALFORMED = [
    "<|channel|>analysis<|message|>cut off in the thought",
    "<|channel|>analysis",                                   # a header the output never ends
    "<|channel|>commentary to=functions.get_weather<|message|>{\"location\": \"Tok",
    "<|channel|>commentary to=functions.get_weather<|message|>not json<|call|>",
    "<|channel|>commentary to=browser.search<|message|>{\"q\": 1}<|call|>",
    "<|start|><|start|><|message|><|end|><|return|><|call|>",
    "<|message|>x<|end|>",
]


def reader() -> ChatReader:
    return ChatReader(HarmonyReasoningParser, tool_mode([WEATHER, TIME], "auto", True, "openai"))


def whole(text: str) -> dict:
    return reader().message(text)


def streamed(pieces: list[str]) -> dict:
    r, out = reader(), {"reasoning_content": "", "content": "", "calls": {}}
    for i, piece in enumerate(pieces):
        d = r.delta(piece, final=i == len(pieces) - 1)
        out["reasoning_content"] += d.get("reasoning_content", "")
        out["content"] += d.get("content", "")
        for c in d.get("tool_calls", []):
            call = out["calls"].setdefault(c["index"], {"name": None, "arguments": ""})
            if "id" in c:
                call["name"] = c["function"]["name"]
            call["arguments"] += c["function"]["arguments"]
    return out


def calls_of(message: dict) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in message.get("tool_calls", [])]


@pytest.mark.parametrize("text,thought,content,calls", CASES)
def test_channels_split_into_thought_content_and_calls(text, thought, content, calls):
    message = whole(text)
    assert message["reasoning_content"] == thought
    assert message["content"] == content
    assert calls_of(message) == calls
    assert "<|" not in (message["content"] or "").replace("`<|`", "")


@pytest.mark.parametrize("text,thought,content,calls", CASES)
def test_a_stream_split_anywhere_agrees_with_the_whole(text, thought, content, calls):
    message = whole(text)
    splits = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text) + [""]]
    for pieces in splits:
        got = streamed(pieces)
        assert got["reasoning_content"] == (message["reasoning_content"] or "")
        assert got["content"] == (message["content"] or "")
        assert [(c["name"], json.loads(c["arguments"])) for c in got["calls"].values()] == calls


@pytest.mark.parametrize("text", MALFORMED)
def test_malformed_output_is_content_or_thought_and_never_crashes(text):
    message = whole(text)
    for i in range(len(text) + 1):
        streamed([text[:i], text[i:]])
    for c in message.get("tool_calls", []):
        json.loads(c["function"]["arguments"])               # a call that went out parses


def test_a_cut_call_is_no_call_and_a_non_function_recipient_is_content():
    cut = whole(MALFORMED[2])
    assert "tool_calls" not in cut
    builtin = whole(MALFORMED[4])
    assert "tool_calls" not in builtin and builtin["content"] == '{"q": 1}'


def test_a_constraint_starts_at_the_final_channel_unless_it_is_written_in_harmony():
    class Tok:
        def encode(self, text, add_special_tokens):
            assert not add_special_tokens
            return [ord(ch) for ch in text]
    start = HarmonyReasoningParser.constraint_start(Tok(), [1, 2, 3], from_json_schema({}))
    assert "".join(map(chr, start)) == "<|channel|>final<|message|>"
    call = constraint(tool_mode([WEATHER], "required", True, None, harmony=True))
    assert HarmonyReasoningParser.constraint_start(Tok(), [1, 2, 3], call) is None


def test_the_openai_tool_parser_and_the_harmony_reasoning_parser_go_together():
    """The openai tool parser brings the harmony reader (vLLM's gpt-oss flags name only the
    tool parser); another reasoning parser with it, or another tool parser with harmony, is
    refused."""
    assert HttpConfig(enable_auto_tool_choice=True,
                      tool_call_parser="openai").reasoning_parser == "openai_gptoss"
    with pytest.raises(ValueError, match="reasoning_parser openai_gptoss"):
        HttpConfig(enable_auto_tool_choice=True, tool_call_parser="openai",
                   reasoning_parser="qwen3")
    with pytest.raises(ValueError, match="tool_call_parser openai"):
        HttpConfig(enable_auto_tool_choice=True, tool_call_parser="hermes",
                   reasoning_parser="openai_gptoss")
    HttpConfig(enable_auto_tool_choice=True, tool_call_parser="openai",
               reasoning_parser="openai_gptoss")
    HttpConfig(reasoning_parser="openai_gptoss")


# --- tool_choice "required" and named: the output is held to a harmony call by a grammar ----

TYPED = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"location": {"type": "string"},
                                     "unit": {"enum": ["C", "F"]}},
    "required": ["location", "unit"], "additionalProperties": False}}}
THOUGHT = "<|channel|>analysis<|message|>The user wants Paris's weather.<|end|><|start|>assistant"
CALL = ('<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
        '{"location": "Paris", "unit": "C"}<|call|>')


@pytest.fixture(scope="module")
def harmony_tok():
    """The default model's tokenizer with harmony's markers added as special tokens."""
    from conveyor.frontend.tokenizer import load_tokenizer
    from conveyor.shared.model_files import default_model_path, resolve_model
    if not default_model_path().is_file():
        pytest.skip("default model not fetched (make model)")
    tok = load_tokenizer(resolve_model(None))
    tok.add_special_tokens({"additional_special_tokens": list(MARKERS)})
    return tok


MARKERS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|constrain|>",
           "<|return|>")


def _follows(tok, grammar: str, text: str) -> bool:
    """Whether the grammar lets the model write `text` (as the tokenizer cuts it) and stop."""
    import llguidance

    from conveyor.shared.grammar import build_tokenizer
    ends = (tok.eos_token_id, tok.convert_tokens_to_ids("<|return|>"))
    matcher = llguidance.LLMatcher(build_tokenizer(tok, len(tok), ends),
                                   llguidance.grammar_from("lark", grammar))
    assert not matcher.get_error()
    return (all(matcher.consume_token(t) for t in tok.encode(text, add_special_tokens=False))
            and matcher.is_accepting())


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "get_weather"}}])
def test_required_and_named_hold_a_harmony_output_to_a_call(harmony_tok, choice):
    """The grammar lets gpt-oss think, then call a function in its own header with arguments
    of the function's schema; nothing else (an answer, another function, bad arguments, a call
    not ended). What it lets through the reader gives as one tool call."""
    mode = tool_mode([TYPED, TIME], choice, True, None, harmony=True)
    so = constraint(mode)
    check_grammar(so)
    time_call = ('<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{}'
                 '<|call|>')
    assert _follows(harmony_tok, so.grammar, THOUGHT + CALL)
    assert _follows(harmony_tok, so.grammar, CALL)
    assert _follows(harmony_tok, so.grammar, time_call) == (choice == "required")
    for wrong in ["<|channel|>final<|message|>It is sunny.<|return|>",
                  CALL.replace('"C"', '"K"'), CALL.replace('"unit": "C"', '"unit":"C"'),
                  CALL.replace("<|call|>", ""), THOUGHT + THOUGHT + CALL,
                  CALL.replace("functions.get_weather", "functions.get_news")]:
        assert not _follows(harmony_tok, so.grammar, wrong), wrong
    message = ChatReader(HarmonyReasoningParser, mode).message(THOUGHT + CALL)
    assert message["reasoning_content"] == "The user wants Paris's weather."
    assert calls_of(message) == [("get_weather", {"location": "Paris", "unit": "C"})]
    assert not message["content"]


def test_tool_choice_none_leaves_a_harmony_call_as_content_without_markers():
    """Under "none" nothing is read as a call: what the model sends a function anyway is
    content (its arguments), and no marker reaches the client."""
    mode = tool_mode([WEATHER], "none", True, "openai", harmony=True)
    assert constraint(mode) is None and mode.new_parser() is None
    reader = ChatReader(HarmonyReasoningParser, mode)
    message = reader.message(THOUGHT + CALL)
    assert "tool_calls" not in message
    assert message["content"] == '{"location": "Paris", "unit": "C"}'
    text = THOUGHT + CALL
    for i in range(len(text) + 1):
        r, got = ChatReader(HarmonyReasoningParser, mode), ""
        for j, piece in enumerate([text[:i], text[i:]]):
            got += r.delta(piece, final=j == 1).get("content", "")
        assert got == message["content"]


def test_a_gpt_oss_server_reads_harmony_without_the_flag(tmp_path):
    """As vLLM does: a gpt-oss model's chats are read as harmony with no --reasoning-parser
    (its thought would otherwise run into its answer); a given parser is kept, and a tool
    parser that cannot read harmony is refused."""
    from models_util import make_tiny_model

    from conveyor.launcher import model_parsers
    from conveyor.shared.model_files import read_model_config, resolve_model

    def model(arch):
        return read_model_config(resolve_model(str(make_tiny_model(arch, tmp_path / arch,
                                                                   weights=False))))
    gpt_oss, llama = model("gpt-oss"), model("llama")
    assert model_parsers(gpt_oss, HttpConfig()).reasoning_parser == "openai_gptoss"
    assert model_parsers(llama, HttpConfig()).reasoning_parser is None
    with pytest.raises(ValueError, match="go together"):
        model_parsers(gpt_oss, HttpConfig(enable_auto_tool_choice=True,
                                          tool_call_parser="hermes"))
    tools = HttpConfig(enable_auto_tool_choice=True, tool_call_parser="openai",
                       reasoning_parser="openai_gptoss")
    assert model_parsers(gpt_oss, tools) == tools
