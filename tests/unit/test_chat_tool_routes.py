"""The chat route's tool checks and the one request path's template, with the default model's
real tokenizer and no engine: what is refused never reaches the engine, and tools, tool calls
and tool results are rendered by the template."""
import json
from pathlib import Path

import msgspec
import pytest
from fastapi.testclient import TestClient

from conveyor.frontend import openai_protocol as oai
from conveyor.frontend.core import READY, FrontendCore
from conveyor.frontend.http import ApiError
from conveyor.frontend.routes import Routes, build_app
from conveyor.frontend.tokenizer import load_tokenizer
from conveyor.shared.messages import through_wire
from conveyor.shared.messages.client import GenerateRequest
from conveyor.shared.model_files import default_model_path, resolve_model

pytestmark = pytest.mark.skipif(not default_model_path().is_file(),
                                reason="default model not fetched (make model)")
TEMPLATE = Path(__file__).parent.parent / "data" / "tool_chat_template.jinja"
TOOLS = [{"type": "function", "function": {"name": "get_time", "description": "The time now",
                                           "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def tok():
    tok = load_tokenizer(resolve_model(None))
    tok.chat_template = TEMPLATE.read_text()
    return tok


def _client(tok, sent, **kw):
    core = FrontendCore(tok, len(tok), 2048, "f-", sent.append, state=READY)
    return TestClient(build_app(core, ("m",), 4, **kw))


def test_auto_tool_choice_needs_the_server_flag(tok):
    sent = []
    body = {"messages": [{"role": "user", "content": "Time?"}], "tools": TOOLS}
    for choice in (None, "auto"):
        r = _client(tok, sent).post("/v1/chat/completions",
                                    json={**body, **({"tool_choice": choice} if choice else {})})
        assert r.status_code == 400 and "--enable-auto-tool-choice" in r.json()["error"]["message"]
    assert sent == []


def test_tools_and_tool_messages_are_rendered_on_the_request_path(tok):
    core = FrontendCore(tok, len(tok), 2048, "f-", lambda m: None, state=READY)
    messages = [{"role": "user", "content": "Time?"},
                {"role": "assistant", "content": "",
                 "tool_calls": [{"id": "c1", "type": "function",
                                 "function": {"name": "get_time", "arguments": {"tz": "UTC"}}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "12:00"}]
    # the request crosses the wire (msgpack) as a ZMQ client's would
    req = through_wire(GenerateRequest(id="a", messages=messages, tools=TOOLS,
                                       chat_template_kwargs={"enable_thinking": False}))
    _, ids, _ = core.preparer.prepare(req, fit_context=False)
    text = tok.decode(ids)
    assert json.dumps(TOOLS[0], ensure_ascii=False) in text
    assert '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}' in text
    assert "<|im_start|>tool\n12:00<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")



def test_harmony_chats_keep_their_special_tokens_and_thinking_reaches_the_template(tok):
    """gpt-oss's parsers read the format's markers (special tokens): its chats are decoded with
    them kept (other servers keep the request's setting). A history's reasoning_content reaches
    the template as `thinking` too, the name gpt-oss's template reads."""
    history = [{"role": "user", "content": "Hi"},
               {"role": "assistant", "content": "Hello", "reasoning_content": "Greet back."},
               {"role": "user", "content": "Time?"}]
    req = msgspec.convert({"messages": history, "tools": TOOLS}, oai.ChatRequest)
    core = FrontendCore(tok, len(tok), 2048, "f-", lambda m: None, state=READY)
    harmony = Routes(core, ("m",), 4, tool_parser="openai", reasoning_parser="openai_gptoss")
    plain = Routes(core, ("m",), 4, tool_parser="hermes", reasoning_parser="qwen3")
    assert harmony._chat(None, req, "m")[0].sampling.skip_special_tokens is False
    assert plain._chat(None, req, "m")[0].sampling.skip_special_tokens is True
    tok2 = load_tokenizer(resolve_model(None))
    tok2.chat_template = ("{% for m in messages %}{{ m.role }}:{{ m.get('thinking', '') }}|"
                          "{{ m.content }};{% endfor %}")
    core2 = FrontendCore(tok2, len(tok2), 2048, "f-", lambda m: None, state=READY)
    _, ids, _ = core2.preparer.prepare(GenerateRequest(id="a", messages=oai.chat_messages(req)),
                                       fit_context=False)
    assert "assistant:Greet back.|Hello;" in tok2.decode(ids)


def test_harmony_tool_choices_on_the_route(tok):
    """On a harmony server "required" is held by a call grammar from the first token (the
    thought is in it), "none" shows the model no functions, "auto" shows them unheld."""
    core = FrontendCore(tok, len(tok), 2048, "f-", lambda m: None, state=READY)
    harmony = Routes(core, ("m",), 4, tool_parser="openai", reasoning_parser="openai_gptoss")
    ask = {"messages": [{"role": "user", "content": "Time?"}], "tools": TOOLS}
    gens = {choice: harmony._chat(None, msgspec.convert({**ask, "tool_choice": choice},
                                                        oai.ChatRequest), "m")[0]
            for choice in ("required", "none", "auto")}
    so = gens["required"].sampling.structured_outputs
    assert "<|channel|>" in so.grammar and "functions.get_time" in so.grammar
    _, _, params = core.preparer.prepare(gens["required"], fit_context=False)
    assert params.structured_outputs.start_after is None
    assert gens["none"].tools is None and gens["none"].sampling.structured_outputs is None
    assert gens["auto"].tools == TOOLS and gens["auto"].sampling.structured_outputs is None


def test_reasoning_effort_reaches_a_template_that_reads_it_and_is_refused_elsewhere(tok):
    """OpenAI's reasoning_effort is a variable of gpt-oss's template; with a template that does
    not read it the request is a 400 naming it (the field would do nothing)."""
    req = msgspec.convert({"messages": [{"role": "user", "content": "Hi"}],
                           "reasoning_effort": "low"}, oai.ChatRequest)
    core = FrontendCore(tok, len(tok), 2048, "f-", lambda m: None, state=READY)
    with pytest.raises(ApiError, match="reasoning_effort is not supported"):
        Routes(core, ("m",), 4)._chat(None, req, "m")
    reads = load_tokenizer(resolve_model(None))
    reads.chat_template = ("Reasoning: {{ reasoning_effort | default('medium') }}|"
                           "{% for m in messages %}{{ m.content }}{% endfor %}")
    core = FrontendCore(reads, len(reads), 2048, "f-", lambda m: None, state=READY)
    gen = Routes(core, ("m",), 4)._chat(None, req, "m")[0]
    assert gen.chat_template_kwargs == {"reasoning_effort": "low"}
    _, ids, _ = core.preparer.prepare(gen, fit_context=False)
    assert reads.decode(ids) == "Reasoning: low|Hi"
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"messages": [], "reasoning_effort": "max"}, oai.ChatRequest)


def test_continue_final_message_and_add_generation_prompt_shape_the_prompt():
    """vLLM's add_generation_prompt and continue_final_message, with the default model's own
    template: the prompt ends inside the assistant's last message, or without the assistant's
    opening; a combination that cannot hold is a 400 naming it."""
    tok = load_tokenizer(resolve_model(None))
    core = FrontendCore(tok, len(tok), 2048, "f-", lambda m: None, state=READY)
    routes = Routes(core, ("m",), 4)

    def prompt(**fields):
        req = msgspec.convert({"messages": [{"role": "user", "content": "Hi"},
                                            {"role": "assistant", "content": "Hello, I am"}],
                               **fields}, oai.ChatRequest)
        _, ids, _ = core.preparer.prepare(routes._chat(None, req, "m")[0], fit_context=False)
        return tok.decode(ids)

    assert prompt().endswith("Hello, I am<|im_end|>\n<|im_start|>assistant\n")
    assert prompt(add_generation_prompt=False).endswith("Hello, I am<|im_end|>\n")
    assert prompt(add_generation_prompt=False,
                  continue_final_message=True).endswith("<|im_start|>assistant\nHello, I am")
    with pytest.raises(ApiError, match="add_generation_prompt: false"):
        prompt(continue_final_message=True)
    req = msgspec.convert({"messages": [{"role": "user", "content": "Hi"}],
                           "add_generation_prompt": False, "continue_final_message": True},
                          oai.ChatRequest)
    with pytest.raises(ApiError, match="the assistant's"):
        routes._chat(None, req, "m")


def test_add_special_tokens_adds_the_tokenizers_own_as_vllm_does():
    """vLLM's add_special_tokens: a completion's prompt gets the tokenizer's BOS unless it is
    false; a chat's template text gets it only when it is true (the template writes its own).
    The default model's tokenizer adds none, so one that adds a BOS stands in."""
    tok = load_tokenizer(resolve_model(None))
    tok.add_bos_token = True
    bos = tok.bos_token_id
    core = FrontendCore(tok, len(tok), 2048, "f-", lambda m: None, state=READY)
    routes = Routes(core, ("m",), 4)

    def chat(**fields):
        req = msgspec.convert({"messages": [{"role": "user", "content": "Hi"}], **fields},
                              oai.ChatRequest)
        return core.preparer.prepare(routes._chat(None, req, "m")[0], fit_context=False)[1]

    def completion(**fields):
        gen = through_wire(GenerateRequest(id="a", prompt="Hi there", **fields))
        return core.preparer.prepare(gen, fit_context=False)[1]

    assert chat(add_special_tokens=True) == [bos] + chat()      # (its template opens with it)
    assert completion()[0] == bos and completion(add_special_tokens=False) == completion()[1:]
    assert completion(add_special_tokens=True) == completion()
    # the HTTP fields, with vLLM's defaults (they were refused as unknown before)
    assert msgspec.convert({"prompt": "x"}, oai.CompletionRequest).add_special_tokens
    assert not msgspec.convert({"prompt": "x", "add_special_tokens": False},
                               oai.CompletionRequest).add_special_tokens
    assert not msgspec.convert({"messages": []}, oai.ChatRequest).add_special_tokens
