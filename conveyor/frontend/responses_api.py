"""OpenAI's Responses API (POST /v1/responses), stateless: a request is turned into the chat
request it means (`chat_request`) and runs as one; `ResponsesShape` gives its output as a
response object of output items (a reasoning item, a message, function calls) or, streamed, as
the API's typed events.

Nothing is stored: `store: true`, `previous_response_id` and `background` are refused, as are
the fields the engine does not honour (`reasoning` but its `effort`, which goes to the chat
template as chat's `reasoning_effort` does, `include`, tools other than functions,
`truncation: "auto"`): each a 400 naming it. The conversation goes in `input`: messages (roles
user, assistant, system, developer; text parts), an assistant's `function_call` items and their
`function_call_output`s, and `reasoning` items (given to the next assistant message, as chat's
`reasoning_content`).
"""
from __future__ import annotations

import time
import uuid
from collections.abc import Callable

import msgspec

from conveyor.frontend import openai_protocol as oai
from conveyor.frontend.chat_output import ChatReader
from conveyor.outputs import CompletionOutput, RequestOutput


class TextFormat(oai._Strict, kw_only=True):
    type: str = "text"                       # text, json_object or json_schema
    name: str | None = None
    schema: dict | None = None
    description: str | None = None
    strict: bool | None = None


class ResponseText(oai._Strict, kw_only=True):
    format: TextFormat | None = None


class ResponsesRequest(oai._Strict, kw_only=True):
    input: str | list[dict]
    model: str | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool = True
    text: ResponseText | None = None
    metadata: dict[str, str] | None = None   # returned in the response as given
    user: str | None = None
    # vLLM's extra, as in chat: e.g. {"enable_thinking": false}
    chat_template_kwargs: dict[str, str | int | float | bool | None] | None = None
    # refused unless they ask for nothing (the server stores nothing and reasons as it does)
    store: bool | None = None
    previous_response_id: str | None = None
    background: bool | None = None
    reasoning: dict | None = None
    include: list[str] | None = None
    truncation: str | None = None


def chat_request(req: ResponsesRequest) -> oai.ChatRequest:
    """The chat request `req` means, or ValueError naming what cannot be done."""
    for key, why in (("store", "this server stores no responses (leave it out, or false)"),
                     ("previous_response_id", "this server stores no responses (send the "
                                              "conversation in input)"),
                     ("background", "responses run while the request waits"),
                     ("include", "no extra output is made")):
        if getattr(req, key):
            raise ValueError(f"{key} is not supported: {why}")
    reasoning = dict(req.reasoning or {})
    effort = reasoning.pop("effort", None)
    if effort not in (None, "low", "medium", "high"):
        raise ValueError(f'reasoning.effort must be "low", "medium" or "high", got {effort!r}')
    if any(v is not None for v in reasoning.values()):
        raise ValueError(f"reasoning.{next(k for k, v in reasoning.items() if v is not None)} "
                         f"is not supported (only reasoning.effort, where the chat template "
                         f"reads it)")
    if req.truncation not in (None, "disabled"):
        raise ValueError('truncation "auto" is not supported (a prompt too long is a 400)')
    fmt = req.text.format if req.text is not None and req.text.format is not None else None
    response_format = None
    if fmt is not None and fmt.type != "text":
        if fmt.type not in ("json_object", "json_schema"):
            raise ValueError(f"text.format.type must be text, json_object or json_schema, got "
                             f"{fmt.type!r}")
        response_format = oai.ResponseFormat(type=fmt.type, json_schema=None if fmt.type ==
                                             "json_object" else oai.JsonSchemaFormat(
                                                 name=fmt.name, description=fmt.description,
                                                 schema=fmt.schema, strict=fmt.strict))
    return oai.ChatRequest(
        messages=msgspec.convert(_messages(req), list[oai.ChatMessage]), model=req.model,
        max_tokens=req.max_output_tokens, temperature=req.temperature, top_p=req.top_p,
        stream=req.stream, tools=[_tool(i, t) for i, t in enumerate(req.tools or ())] or None,
        tool_choice=_tool_choice(req.tool_choice), parallel_tool_calls=req.parallel_tool_calls,
        response_format=response_format, user=req.user,
        chat_template_kwargs=req.chat_template_kwargs, reasoning_effort=effort)


def _messages(req: ResponsesRequest) -> list[dict]:
    """input (and instructions) as chat messages."""
    out = [{"role": "system", "content": req.instructions}] if req.instructions else []
    items = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    thought = None                               # a reasoning item, for the next reply
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            role = {"developer": "system"}.get(item.get("role"), item.get("role"))
            if role not in ("user", "assistant", "system"):
                raise ValueError(f"input[{i}].role must be user, assistant, system or "
                                 f"developer, got {item.get('role')!r}")
            message = {"role": role, "content": _text(item.get("content"), f"input[{i}]")}
            if role == "assistant" and thought is not None:
                message["reasoning_content"], thought = thought, None
            out.append(message)
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
            if out and out[-1]["role"] == "assistant" and "tool_calls" in out[-1]:
                out[-1]["tool_calls"].append(call)       # calls made together
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call],
                            **({"reasoning_content": thought} if thought else {})})
                thought = None
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": item.get("call_id"),
                        "content": output if isinstance(output, str) else
                        _text(output, f"input[{i}].output")})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            thought = "".join(p.get("text", "") for p in parts if isinstance(p, dict))
        else:
            raise ValueError(f"input[{i}].type {kind!r} is not supported (message, "
                             f"function_call, function_call_output, reasoning)")
    return out


def _text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or any(
            not isinstance(p, dict) or p.get("type") not in ("input_text", "output_text", "text")
            or not isinstance(p.get("text"), str) for p in content):
        raise ValueError(f"{where}.content: only text parts are supported (input_text, "
                         f"output_text)")
    return "".join(p["text"] for p in content)


def _tool(i: int, tool: dict) -> dict:
    """A Responses function tool ({"type": "function", "name", "parameters", ...}) in chat's
    form."""
    if tool.get("type") != "function":
        raise ValueError(f"tools[{i}].type {tool.get('type')!r} is not supported (function "
                         f"tools only)")
    return {"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}


def _tool_choice(choice: str | dict | None) -> str | dict | None:
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise ValueError('tool_choice must be "none", "auto", "required" or {"type": '
                             '"function", "name": ...}')
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


class ResponsesShape:
    """One response's body, or its events as the stream goes (the interface of
    openai_responses.ResponseShape that http.py drives)."""
    sse_event_names, done_marker = True, False

    def __init__(self, req: ResponsesRequest, model: str,
                 new_reader: Callable[[], ChatReader] | None):
        self.req, self.model = req, model
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.reader = new_reader() if new_reader is not None else None
        self.prompt_tokens = self.completion_tokens = self.cached_tokens = 0
        self.items: list[dict] = []              # output items, the last one maybe open
        self.finish: str | None = None
        self.sequence = 0

    # --- whole -------------------------------------------------------------------------------

    def saw(self, prompt_index: int, out: RequestOutput) -> None:
        if out.prompt_token_ids is not None and not self.prompt_tokens:
            self.prompt_tokens = len(out.prompt_token_ids)
        if out.metrics is not None:
            self.cached_tokens = out.metrics.num_cached_tokens or self.cached_tokens

    def whole(self, finals: list[RequestOutput]) -> dict:
        self.saw(0, finals[0])
        c = finals[0].outputs[0]
        self.completion_tokens, self.finish = len(c.token_ids), c.finish_reason
        message = self.reader.message(c.text) if self.reader else {"content": c.text}
        if message.get("reasoning_content"):
            self.items.append(_reasoning_item(message["reasoning_content"]))
        if message.get("content"):
            self.items.append(_message_item(message["content"]))
        for call in message.get("tool_calls") or ():
            self.items.append(_call_item(call["id"], call["function"]["name"],
                                         call["function"]["arguments"]))
        return self.response("completed")

    def response(self, status: str) -> dict:
        if status == "completed" and self.finish == "length":
            status = "incomplete"
        r = self.req
        return {
            "id": self.id, "object": "response", "created_at": self.created, "model": self.model,
            "status": status, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete"
            else None,
            "instructions": r.instructions, "metadata": r.metadata or {},
            # NOTE: a copy: an event's snapshot is encoded after later pieces grow the items
            "max_output_tokens": r.max_output_tokens, "output": [_copy(i) for i in self.items],
            "parallel_tool_calls": r.parallel_tool_calls, "temperature": r.temperature,
            "top_p": r.top_p, "tool_choice": r.tool_choice or "auto", "tools": r.tools or [],
            "text": msgspec.to_builtins(r.text) if r.text else {"format": {"type": "text"}},
            "store": False, "truncation": "disabled", "user": r.user,
            "usage": None if status == "in_progress" else {
                "input_tokens": self.prompt_tokens,
                "input_tokens_details": {"cached_tokens": self.cached_tokens},
                "output_tokens": self.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": self.prompt_tokens + self.completion_tokens}}

    # --- streamed ----------------------------------------------------------------------------

    def event(self, kind: str, **fields) -> dict:
        self.sequence += 1
        return {"type": kind, "sequence_number": self.sequence - 1, **fields}

    def opening(self) -> list[dict]:
        return [self.event("response.created", response=self.response("in_progress")),
                self.event("response.in_progress", response=self.response("in_progress"))]

    def chunk(self, prompt_index: int, c: CompletionOutput) -> dict | list[dict] | None:
        self.completion_tokens += len(c.token_ids)
        self.finish = c.finish_reason or self.finish
        final = c.finish_reason is not None
        delta = self.reader.delta(c.text, final) if self.reader else {"content": c.text}
        events = []
        if delta.get("reasoning_content"):
            events += self._into("reasoning", delta["reasoning_content"])
        if delta.get("content"):
            events += self._into("message", delta["content"])
        for call in delta.get("tool_calls") or ():
            f = call.get("function", {})
            if "id" in call:                     # a new call
                events += self._close() + self._open(_call_item(call["id"], f["name"], ""))
            events += self._into("function_call", f.get("arguments", ""))
        return events or None

    def closing(self, include_usage: bool) -> list[dict]:
        return self._close() + [self.event("response.completed",
                                           response=self.response("completed"))]

    def failure(self, error: dict) -> list[dict]:
        return self._close() + [self.event("response.failed",
                                           response={**self.response("failed"), "error": error})]

    def _into(self, kind: str, text: str) -> list[dict]:
        """Events adding `text` to the open item of `kind` (opened first if need be)."""
        events = []
        item = self.items[-1] if self.items and self.items[-1]["status"] == "in_progress" \
            else None
        if item is None or item["type"] != kind:
            events += self._close() + self._open(_reasoning_item("") if kind == "reasoning"
                                                 else _message_item(""))
            item = self.items[-1]
        at = {"item_id": item["id"], "output_index": len(self.items) - 1}
        if kind == "function_call":
            item["arguments"] += text
            return events + [self.event("response.function_call_arguments.delta", **at,
                                        delta=text)] if text else events
        item["content"][0]["text"] += text
        name = "response.reasoning_text.delta" if kind == "reasoning" else \
            "response.output_text.delta"
        return events + [self.event(name, **at, content_index=0, delta=text)]

    def _open(self, item: dict) -> list[dict]:
        item["status"] = "in_progress"
        self.items.append(item)
        at = {"output_index": len(self.items) - 1}
        events = [self.event("response.output_item.added", **at, item=_copy(item, empty=True))]
        if item["type"] == "message":
            events.append(self.event("response.content_part.added", **at, item_id=item["id"],
                                     content_index=0, part=_copy(item["content"][0])))
        return events

    def _close(self) -> list[dict]:
        if not self.items or self.items[-1]["status"] != "in_progress":
            return []
        item = self.items[-1]
        item["status"] = "completed"
        at = {"item_id": item["id"], "output_index": len(self.items) - 1}
        if item["type"] == "function_call":
            events = [self.event("response.function_call_arguments.done", **at,
                                 arguments=item["arguments"])]
        else:
            text = item["content"][0]["text"]
            done = "response.reasoning_text.done" if item["type"] == "reasoning" else \
                "response.output_text.done"
            events = [self.event(done, **at, content_index=0, text=text)]
            if item["type"] == "message":
                events.append(self.event("response.content_part.done", **at, content_index=0,
                                         part=_copy(item["content"][0])))
        return events + [self.event("response.output_item.done", output_index=at["output_index"],
                                    item=_copy(item))]


def _copy(item: dict, empty: bool = False) -> dict:
    """A snapshot of an item for an event (empty: as it opens, before any text)."""
    out = msgspec.json.decode(msgspec.json.encode(item))
    if empty:
        for part in out.get("content", ()):
            part["text"] = ""
        if "arguments" in out:
            out["arguments"] = ""
    return out


def _message_item(text: str) -> dict:
    return {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": "completed",
            "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def _reasoning_item(text: str) -> dict:
    return {"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}", "status": "completed",
            "summary": [], "content": [{"type": "reasoning_text", "text": text}]}


def _call_item(call_id: str, name: str, arguments: str) -> dict:
    return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call_id,
            "name": name, "arguments": arguments, "status": "completed"}
