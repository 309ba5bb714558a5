"""The tool-call parsers on outputs in each model family's own format: whole, streamed split at
every position (and a character at a time), and malformed (plain content, no crash)."""
import json

import pytest

from conveyor.frontend.tool_parsers import (
    TOOL_PARSERS,
    Glm45Parser,
    HermesParser,
    JsonArrayParser,
    Llama3JsonParser,
    MiniMaxM2Parser,
    MistralParser,
    NamedCallParser,
    PythonicParser,
    Qwen3CoderParser,
)
from conveyor.frontend.tools import tool_mode

WEATHER = {"location": "San Francisco, CA, USA", "unit": "celsius"}
NESTED = {"query": "a \"quoted\" } ] brace", "filters": [{"k": "year", "v": [2023, 2024]}],
          "deep": {"x": {"y": None, "z": True, "w": -1.5e3}}, "emoji": "héllo ✓"}

# (parser, output as the model writes it, content, [(name, arguments object)])
VALID = [
    # Qwen2.5 / Qwen3: calls in <tool_call> tags, each on its own lines
    (HermesParser, '<tool_call>\n{"name": "get_current_temperature", "arguments": '
                   '{"location": "San Francisco, CA, USA", "unit": "celsius"}}\n</tool_call>',
     "", [("get_current_temperature", WEATHER)]),
    (HermesParser, "Let me check both.\n\n<tool_call>\n"
                   + json.dumps({"name": "search", "arguments": NESTED}, ensure_ascii=False)
                   + '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n'
                   '</tool_call>', "Let me check both.", [("search", NESTED), ("get_time", {})]),
    (HermesParser, '<tool_call>\n{"arguments": {"a": 1}, "name": "later_name"}\n</tool_call>',
     "", [("later_name", {"a": 1})]),
    (HermesParser, '<tool_call>{"name": "no_args"}</tool_call>', "", [("no_args", {})]),
    (HermesParser, "The answer is 4. No tools needed, <tool_ is not a tag.\n",
     "The answer is 4. No tools needed, <tool_ is not a tag.\n", []),
    # Llama 3.1 / 3.2: a JSON object (parameters), after <|python_tag|> when special tokens stay
    (Llama3JsonParser, '{"name": "get_current_conditions", "parameters": {"location": '
                       '"San Francisco, CA, USA", "unit": "celsius"}}',
     "", [("get_current_conditions", WEATHER)]),
    (Llama3JsonParser, '<|python_tag|>{"name": "search", "parameters": '
                       + json.dumps(NESTED) + '}; {"name": "get_time", "parameters": {}}',
     "", [("search", NESTED), ("get_time", {})]),
    (Llama3JsonParser, '{"name": "f", "parameters": {"a": 1}} and then some words',
     "and then some words", [("f", {"a": 1})]),
    (Llama3JsonParser, "Paris is the capital of France.", "Paris is the capital of France.", []),
    (Llama3JsonParser, '  {"result": 4}', '  {"result": 4}', []),
    # Mistral: [TOOL_CALLS] then an array (arguments)
    (MistralParser, '[TOOL_CALLS] [{"name": "get_current_weather", "arguments": '
                    '{"location": "San Francisco, CA, USA", "unit": "celsius"}}]',
     "", [("get_current_weather", WEATHER)]),
    (MistralParser, 'Sure.[TOOL_CALLS][{"name": "search", "arguments": ' + json.dumps(NESTED)
                    + '}, {"name": "get_time", "arguments": {}}]',
     "Sure.", [("search", NESTED), ("get_time", {})]),
    (MistralParser, '[{"name": "get_time", "arguments": {"tz": "UTC"}}]',   # marker skipped
     "", [("get_time", {"tz": "UTC"})]),
    # a complete call stands; what breaks the array after it is content
    (MistralParser, '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}} {"name": "g"}]',
     '{"name": "g"}]', [("f", {"a": 1})]),
    (MistralParser, "[1, 2, 3] are numbers.", "[1, 2, 3] are numbers.", []),
    # pythonic (Llama 3.2, Llama 4): a list of calls with literal keyword arguments
    (PythonicParser, '[get_weather(location="San Francisco, CA, USA", unit=\'celsius\')]',
     "", [("get_weather", WEATHER)]),
    (PythonicParser, """[search(query='a "quoted" } ] brace', filters=[{"k": "year", "v": """
                     """(2023, 2024)}], deep={'x': {'y': None, 'z': True, 'w': -1.5e3}}, """
                     """emoji="héllo ✓"), get_time()]""",
     "", [("search", NESTED), ("get_time", {})]),
    (PythonicParser, "Let me look.\n<|python_start|>[write(path='a, (b).txt', text=\"\"\"one\n"
                     "two, \"2\" ]\"\"\", note='it\\'s\\n', n=-0.5,)]<|python_end|>",
     "Let me look.", [("write", {"path": "a, (b).txt", "text": 'one\ntwo, "2" ]',
                                 "note": "it's\n", "n": -0.5})]),
    (PythonicParser, "[\n  get_time( tz = 'CET' ),\n  get_time(tz='UTC')\n] and then words",
     "and then words", [("get_time", {"tz": "CET"}), ("get_time", {"tz": "UTC"})]),
    (PythonicParser, "Paris is the capital of France.", "Paris is the capital of France.", []),
    (PythonicParser, "[1, 2, 3] are numbers.", "[1, 2, 3] are numbers.", []),
    (PythonicParser, "[Paris](https://paris.fr) is a link.", "[Paris](https://paris.fr) is a link.",
     []),
    (PythonicParser, '<|python_start|>print("hi")<|python_end|>',
     '<|python_start|>print("hi")<|python_end|>', []),
    # qwen3_coder: <tool_call> tags around XML; without tools a value is JSON, else a string
    (Qwen3CoderParser, "<tool_call>\n<function=get_current_temperature>\n<parameter=location>\n"
                       "San Francisco, CA, USA\n</parameter>\n<parameter=unit>\ncelsius\n"
                       "</parameter>\n</function>\n</tool_call>",
     "", [("get_current_temperature", WEATHER)]),
    (Qwen3CoderParser, "Let me check both.\n\n<tool_call>\n<function=search>\n<parameter=query>\n"
                       'a "quoted" } ] brace\n</parameter>\n<parameter=filters>\n'
                       '[{"k": "year", "v": [2023, 2024]}]\n</parameter>\n<parameter=deep>\n'
                       '{"x": {"y": null, "z": true, "w": -1.5e3}}\n</parameter>\n'
                       "<parameter=emoji>\nhéllo ✓\n</parameter>\n</function>\n</tool_call>\n"
                       "<tool_call>\n<function=get_time>\n</function>\n</tool_call>",
     "Let me check both.", [("search", NESTED), ("get_time", {})]),
    (Qwen3CoderParser, "<tool_call>\n<function=write>\n<parameter=code>\ndef f(a, b):\n"
                       '    return "[" + a + "</x>"\n\n</parameter>\n</function>\n</tool_call>',
     "", [("write", {"code": 'def f(a, b):\n    return "[" + a + "</x>"\n'})]),
    (Qwen3CoderParser, "The answer is 4. <tool_ is not a tag.\n",
     "The answer is 4. <tool_ is not a tag.\n", []),
    # glm45: <tool_call> tags around the name and key/value tags (GLM-4.7: no newline first)
    (Glm45Parser, "<tool_call>get_current_temperature\n<arg_key>location</arg_key>\n"
                  "<arg_value>San Francisco, CA, USA</arg_value>\n<arg_key>unit</arg_key>\n"
                  "<arg_value>celsius</arg_value>\n</tool_call>",
     "", [("get_current_temperature", WEATHER)]),
    (Glm45Parser, "Let me check both.\n<tool_call>search<arg_key>query</arg_key>"
                  '<arg_value>a "quoted" } ] brace</arg_value><arg_key>filters</arg_key>'
                  '<arg_value>[{"k": "year", "v": [2023, 2024]}]</arg_value>\n'
                  '<arg_key>deep</arg_key>\n<arg_value>{"x": {"y": null, "z": true, '
                  '"w": -1.5e3}}</arg_value>\n<arg_key> emoji </arg_key>'
                  "<arg_value>héllo ✓</arg_value>\n</tool_call>\n"
                  "<tool_call>get_time\n</tool_call>",
     "Let me check both.", [("search", NESTED), ("get_time", {})]),
    (Glm45Parser, "<tool_call>get_time</tool_call> done.", "done.", [("get_time", {})]),
    (Glm45Parser, "No call: 3 < 4 and <tool_call is not a tag.",
     "No call: 3 < 4 and <tool_call is not a tag.", []),
    # minimax_m2: one block of <invoke> calls with quoted names
    (MiniMaxM2Parser, '<minimax:tool_call>\n<invoke name="get_current_temperature">\n'
                      '<parameter name="location">San Francisco, CA, USA</parameter>\n'
                      '<parameter name="unit">celsius</parameter>\n</invoke>\n'
                      "</minimax:tool_call>", "", [("get_current_temperature", WEATHER)]),
    (MiniMaxM2Parser, 'Let me check both.\n\n<minimax:tool_call>\n<invoke name="search">\n'
                      '<parameter name="query">a "quoted" } ] brace</parameter>\n'
                      '<parameter name="filters">[{"k": "year", "v": [2023, 2024]}]</parameter>'
                      '<parameter name="deep">{"x": {"y": null, "z": true, "w": -1.5e3}}'
                      '</parameter>\n<parameter name="emoji">héllo ✓</parameter>\n</invoke>\n'
                      '<invoke name="get_time">\n</invoke>\n</minimax:tool_call>',
     "Let me check both.", [("search", NESTED), ("get_time", {})]),
    (MiniMaxM2Parser, '<minimax:tool_call><invoke name="get_time"></invoke></minimax:tool_call>'
                      " done.", "done.", [("get_time", {})]),
    (MiniMaxM2Parser, "No call: 3 < 4 and <minimax:tool is not a tag.",
     "No call: 3 < 4 and <minimax:tool is not a tag.", []),
]

MALFORMED = [
    (MiniMaxM2Parser, "<minimax:tool_call>\nnot a call\n</minimax:tool_call>"),
    (MiniMaxM2Parser, '<minimax:tool_call><invoke name="f"><param name="a">1</param></invoke>'),
    (MiniMaxM2Parser, '<minimax:tool_call><invoke name="f>\n</invoke></minimax:tool_call>'),
    (HermesParser, "<tool_call>\nnot json at all\n</tool_call>"),
    (HermesParser, 'Hi <tool_call>{"nam": "f"}</tool_call>'),
    (HermesParser, '<tool_call>{"name": 42, "arguments": {}}</tool_call>'),
    (HermesParser, '<tool_call>{"arguments": {"a": 1}}</tool_call>'),
    (HermesParser, '<tool_call>{"name": "f", "name": "g"}</tool_call>'),
    (HermesParser, '<tool_call>{"arguments": {"a": 1]}, "name": "f"}</tool_call>'),
    (HermesParser, "<tool_call>"),
    (HermesParser, '<tool_call>{"name": "f", "arguments": {"a": 1}, "x": tru}</tool_call>'),
    (Llama3JsonParser, '{"nme": "f"}'),
    (Llama3JsonParser, "<|python_tag|>brave_search.call(query=\"weather\")"),
    (Llama3JsonParser, '{"name": "f"'),
    (MistralParser, "[TOOL_CALLS] nonsense"),
    (MistralParser, '[TOOL_CALLS][{"name": {"f": 1}, "arguments": {"a": 1}}]'),
    (MistralParser, '[TOOL_CALLS][{"name": "f", "arguments": 7}]'),
    (JsonArrayParser, '[{"name": "f", "parameters": {"a": }}]'),
    (PythonicParser, '[get_weather(city="Paris"'),
    (PythonicParser, '[get_weather(city="Paris")'),                # the list never closes
    (PythonicParser, "[get_weather(city=paris)]"),
    (PythonicParser, '[get_weather(city="Paris", days=1 + x)]'),
    (PythonicParser, '[get_weather(city=open("x"))]'),
    (PythonicParser, '[get_weather("Paris")]'),
    (PythonicParser, "[f(a=1, a=2)]"),
    (PythonicParser, "[f(a={1, 2})]"),
    (PythonicParser, "[f(a=)]"),
    (PythonicParser, "[f(a=1]"),
    (PythonicParser, "[f(a='unclosed)]"),
    (PythonicParser, "[os.system(cmd='ls')]"),
    (Qwen3CoderParser, "<tool_call>\n<function=get_weather\n<parameter=city>\nParis\n</parameter>"
                       "\n</function>\n</tool_call>"),
    (Qwen3CoderParser, "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"),
    (Qwen3CoderParser, "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
                       "</parameter>\n"),
    (Qwen3CoderParser, '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'),
    (Qwen3CoderParser, "<tool_call>\n<function=>\n</function>\n</tool_call>"),
    (Qwen3CoderParser, "<tool_call>\n<function=f>\nstray text\n</function>\n</tool_call>"),
    (Qwen3CoderParser, "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n"
                       "<parameter=a>\n2\n</parameter>\n</function>\n</tool_call>"),
    (Qwen3CoderParser, "<tool_call>"),
    (Glm45Parser, '<tool_call>{"name": "f", "arguments": {}}</tool_call>'),
    (Glm45Parser, "<tool_call>get weather\n</tool_call>"),
    (Glm45Parser, "<tool_call>\n</tool_call>"),
    (Glm45Parser, "<tool_call>f\nstray text\n</tool_call>"),
    (Glm45Parser, "<tool_call>f\n<arg_key>a</arg_key>\nstray<arg_value>1</arg_value>"
                  "</tool_call>"),
    (Glm45Parser, "<tool_call>f\n<arg_key></arg_key>\n<arg_value>1</arg_value></tool_call>"),
    (Glm45Parser, "<tool_call>f\n<arg_key>a</arg_key><arg_value>1</arg_value>"
                  "<arg_key>a</arg_key><arg_value>2</arg_value></tool_call>"),
    (Glm45Parser, "<tool_call>f\n<arg_key>a</arg_key><arg_value>1"),
    (Glm45Parser, "<tool_call>"),
]


def _stream(parser, pieces):
    """(content, [(id, name, arguments text)]) as a client assembles a stream's deltas."""
    content, calls = "", []
    deltas = [parser.feed(p) for p in pieces] + [parser.finish()]
    for d in deltas:
        content += d.content
        for c in d.tool_calls:
            if "id" in c:
                assert c["index"] == len(calls) and c["type"] == "function"
                assert c["function"]["arguments"] == ""
                calls.append([c["id"], c["function"]["name"], ""])
            else:
                assert set(c) == {"index", "function"} and set(c["function"]) == {"arguments"}
                assert c["index"] == len(calls) - 1 and c["function"]["arguments"]
                calls[-1][2] += c["function"]["arguments"]
    return content, [(name, args) for _, name, args in calls]


def _splits(text):
    yield [text]
    yield list(text)
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]


@pytest.mark.parametrize("cls,text,content,calls", VALID)
def test_whole_output(cls, text, content, calls):
    parsed = cls.parse(text)
    assert parsed.content == content
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == calls
    assert len({c.id for c in parsed.tool_calls}) == len(calls)


@pytest.mark.parametrize("cls,text,content,calls", VALID)
def test_a_stream_split_anywhere_gives_the_whole_outputs_result(cls, text, content, calls):
    whole = cls.parse(text)
    want = (whole.content, [(c.name, c.arguments) for c in whole.tool_calls])
    for pieces in _splits(text):
        assert _stream(cls(), pieces) == want, pieces


def test_arguments_grow_as_the_model_writes_them():
    text = VALID[1][1]
    parser, sent = HermesParser(), []
    args_at = text.index('"arguments"') + len('"arguments": ')
    for i, ch in enumerate(text):
        d = parser.feed(ch)
        sent += [(i, c) for c in d.tool_calls if "id" not in c]
    first = [i for i, c in sent if c["index"] == 0]
    # every character of the first call's arguments goes out as soon as it is written
    assert first[0] == args_at and len(first) == len(json.dumps(NESTED, ensure_ascii=False))


@pytest.mark.parametrize("cls,text", MALFORMED)
def test_malformed_is_content_and_never_crashes(cls, text):
    parsed = cls.parse(text)
    assert parsed.tool_calls == [] and parsed.content == text
    for pieces in _splits(text):
        content, calls = _stream(cls(), pieces)
        # a stream may have sent a call whose name was complete before the JSON broke;
        # otherwise it is the text, as content
        if not calls:
            assert content == text, pieces


def test_a_call_cut_off_after_its_name_streams_but_is_content_whole():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    assert HermesParser.parse(text).tool_calls == []
    assert _stream(HermesParser(), [text]) == ("", [("get_weather", '{"city": "Par')])


def test_named_function_output_is_its_arguments():
    parsed = NamedCallParser.parse('  {"city": "Paris"}\n', "get_weather")
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [("get_weather",
                                                                   '{"city": "Paris"}')]
    for pieces in _splits('  {"city": "Paris"}\n'):
        assert _stream(NamedCallParser("get_weather"), pieces) == (
            "", [("get_weather", '{"city": "Paris"}')])


def test_required_output_is_an_array_of_calls():
    text = '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {}}]'
    for pieces in _splits(text):
        assert _stream(JsonArrayParser(), pieces) == ("", [("a", '{"x": 1}'), ("b", "{}")])


def test_every_server_parser_name_is_registered():
    assert set(TOOL_PARSERS) >= {"hermes", "llama3_json", "mistral", "pythonic", "qwen3_coder",
                                 "glm45", "glm47", "minimax_m2"}


def test_pythonic_arguments_go_out_one_by_one():
    text = '[get_weather(city="Paris", days=3)]'
    parser, sent = PythonicParser(), {}
    for i, ch in enumerate(text):
        for c in parser.feed(ch).tool_calls:
            sent[i] = sent.get(i, "") + c["function"].get("name", "") + c["function"]["arguments"]
    # the name goes out with the first argument, each argument once its value is complete
    assert sent == {text.index(","): 'get_weather{"city": "Paris"',
                    text.index(")"): ', "days": 3}'}


QWEN_TOOLS = ({"name": "plan", "parameters": {"type": "object", "properties": {
    "title": {"type": "string"}, "count": {"type": "integer"}, "ratio": {"type": "number"},
    "flag": {"type": "boolean"}, "opts": {"type": "object"}, "tags": {"type": "array"},
    "note": {"type": ["string", "null"]}}}},)
TYPED = ("<tool_call>\n<function=plan>\n" + "".join(
    f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in [
        ("title", "3"), ("count", "3"), ("ratio", "0.5"), ("flag", "True"),
        ("opts", '{"a": [1, {"b": null}]}'), ("tags", "['x', \"y, z\"]"), ("note", "null"),
        ("extra", "[1, 2]"), ("other", "not json"), ("count2", "many")])
    + "</function>\n</tool_call>")


def test_qwen3_coder_types_values_by_the_tools_schema():
    (call,) = Qwen3CoderParser.parse(TYPED, QWEN_TOOLS).tool_calls
    assert json.loads(call.arguments) == {
        "title": "3", "count": 3, "ratio": 0.5, "flag": True, "opts": {"a": [1, {"b": None}]},
        "tags": ["x", "y, z"], "note": "null", "extra": [1, 2], "other": "not json",
        "count2": "many"}
    # without its schema, "3" is a number and True is not JSON
    untyped = json.loads(Qwen3CoderParser.parse(TYPED).tool_calls[0].arguments)
    assert (untyped["title"], untyped["flag"]) == (3, "True")
    for pieces in _splits(TYPED):
        assert _stream(Qwen3CoderParser(QWEN_TOOLS), pieces) == ("", [("plan", call.arguments)])


def test_qwen3_coder_sends_the_name_then_each_parameter_as_it_closes():
    text = TYPED[:TYPED.index("<parameter=ratio>")]
    parser, sent = Qwen3CoderParser(QWEN_TOOLS), []
    for i, ch in enumerate(text):
        sent += [(i, c) for c in parser.feed(ch).tool_calls]
    ends = [i for i in range(len(text)) if text.startswith("</parameter>", i - 11)]
    assert [i for i, _ in sent] == [text.index("<function=plan>") + 14] + ends
    assert [c["function"].get("name") for _, c in sent] == ["plan", None, None]


GLM_TYPED = ("<tool_call>plan\n" + "".join(
    f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n" for k, v in [
        ("title", "3"), ("count", "3"), ("ratio", " 0.5 "), ("flag", "true"), ("note", "null"),
        ("tags", "['x', \"y, z\"]"), ("other", "not json")])
    + "</tool_call>")


def test_glm45_types_values_by_the_tools_schema_and_sends_each_as_it_closes():
    (call,) = Glm45Parser.parse(GLM_TYPED, QWEN_TOOLS).tool_calls
    assert json.loads(call.arguments) == {
        "title": "3", "count": 3, "ratio": 0.5, "flag": True, "note": "null",
        "tags": ["x", "y, z"], "other": "not json"}
    assert json.loads(Glm45Parser.parse(GLM_TYPED).tool_calls[0].arguments)["title"] == 3
    for pieces in _splits(GLM_TYPED):
        assert _stream(Glm45Parser(QWEN_TOOLS), pieces) == ("", [("plan", call.arguments)])
    parser, sent = Glm45Parser(QWEN_TOOLS), []
    for i, ch in enumerate(GLM_TYPED):
        sent += [i for c in parser.feed(ch).tool_calls]
    ends = [i for i in range(len(GLM_TYPED)) if GLM_TYPED.startswith("</arg_value>", i - 11)]
    # the name once a character follows its line's end (whitespace ahead of a call's text is
    # held until it ends), each argument at its tag's end, the object's "}" at the call's end
    assert sent == [GLM_TYPED.index("\n") + 1] + ends + [len(GLM_TYPED) - 1]


MINIMAX_TYPED = ('<minimax:tool_call>\n<invoke name="plan">\n' + "".join(
    f'<parameter name="{k}">{v}</parameter>\n' for k, v in [
        ("title", "3"), ("count", "3"), ("ratio", "0.5"), ("flag", "true"), ("note", "null"),
        ("tags", "['x', \"y, z\"]"), ("other", "not json")])
    + "</invoke>\n</minimax:tool_call>")


def test_minimax_m2_types_values_by_the_tools_schema_and_sends_each_as_it_closes():
    (call,) = MiniMaxM2Parser.parse(MINIMAX_TYPED, QWEN_TOOLS).tool_calls
    assert json.loads(call.arguments) == {
        "title": "3", "count": 3, "ratio": 0.5, "flag": True, "note": "null",
        "tags": ["x", "y, z"], "other": "not json"}
    for pieces in _splits(MINIMAX_TYPED):
        assert _stream(MiniMaxM2Parser(QWEN_TOOLS), pieces) == ("", [("plan", call.arguments)])
    parser, sent = MiniMaxM2Parser(QWEN_TOOLS), []
    for i, ch in enumerate(MINIMAX_TYPED):
        sent += [i for c in parser.feed(ch).tool_calls]
    name_end = MINIMAX_TYPED.index('"plan">') + 6
    ends = [i for i in range(len(MINIMAX_TYPED))
            if MINIMAX_TYPED.startswith("</parameter>", i - 11)]
    # the name at its tag's end, each argument at its closing tag's end, the object's "}" at
    # the invoke's end
    assert sent == [name_end] + ends + [MINIMAX_TYPED.index("</invoke>") + 8]


def test_the_auto_tool_mode_gives_its_parser_the_tools():
    tools = [{"type": "function", "function": f} for f in QWEN_TOOLS]
    parser = tool_mode(tools, "auto", True, "qwen3_coder").new_parser()
    assert isinstance(parser, Qwen3CoderParser) and parser.tools == QWEN_TOOLS
    assert json.loads(parser.parse_all(TYPED).tool_calls[0].arguments)["title"] == "3"
    assert isinstance(tool_mode(tools, "auto", True, "pythonic").new_parser(), PythonicParser)
