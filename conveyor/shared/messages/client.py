"""client <-> frontend: the public ZMQ protocol (docs/PROTOCOL.md).

A client sends GenerateRequest, CancelRequest or StatsRequest; it gets back RequestOutputs
(conveyor/outputs.py: one at the end, or a delta per step when streaming), an ErrorReply, or Stats.
"""
from __future__ import annotations

from typing import Any

import msgspec

from conveyor.shared.request_options import RequestOptions
from conveyor.shared.sampling_params import SamplingParams


class GenerateRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True,
                      omit_defaults=True):
    """Exactly one of prompt, prompt_token_ids and messages is set."""
    id: str                                  # chosen by the client, unique among its open requests
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    # chat: [{"role": ..., "content": ...}], an assistant's "tool_calls", a tool's "tool_call_id"
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None     # functions the chat template shows the model
    sampling: SamplingParams = msgspec.field(default_factory=SamplingParams)
    options: RequestOptions = msgspec.field(default_factory=RequestOptions)
    stream: bool = False                     # True: a RequestOutput per step with what is new
    # keyword arguments of the chat template (add_generation_prompt, ...), with messages
    chat_template_kwargs: dict[str, str | int | float | bool | None] | None = None
    # the tokenizer's special tokens (a BOS) added as it encodes the prompt text or the chat
    # template's text; None: a prompt's yes, a chat's no (its template writes its own)
    add_special_tokens: bool | None = None


class CancelRequest(msgspec.Struct):
    id: str


class ErrorReply(msgspec.Struct):
    id: str | None                           # None: the frame could not be read at all
    error: str
    code: int = 400                          # HTTP-style: 400 invalid, 429 overloaded, 503 down
