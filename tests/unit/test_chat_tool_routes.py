"""The chat route's tool checks and the one request path's template, with the default model's
real tokenizer and no engine: what is refused never reaches the engine, and tools, tool calls
and tool results are rendered by the template."""
import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from conveyor.frontend.core import READY, FrontendCore
from conveyor.frontend.routes import build_app
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
