"""The OpenAI API's requests (completions and chat completions); their responses are built in
frontend/openai_responses.py.

Requests are decoded with msgspec: a field of the wrong type is a clear 400, and so is a field
the server does not know (OpenAI's servers refuse unrecognized arguments too): a request is
never run without what it asked for. The fields an OpenAI client echoes back in an assistant
message of the history are taken when they say nothing (null or empty). `sampling_params`
maps a request onto SamplingParams, with vLLM's extra fields (top_k, min_p, ignore_eos,
repetition_penalty, min_tokens, prompt_logprobs, ...) and the server's defaults
(generation_config.json) for what the request leaves unset; `max_tokens: 0` with `echo`
returns the prompt alone (one token is computed and left out).
"""
from __future__ import annotations

from typing import Literal

import msgspec

from conveyor.frontend.tools import history_tool_calls
from conveyor.shared.sampling_params import MAX_LOGPROBS, SamplingParams
from conveyor.shared.structured_outputs import StructuredOutputs


class _Strict(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A request object: a field it does not declare is refused (400 naming it)."""


class StreamOptions(_Strict, kw_only=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(_Strict, kw_only=True):
    name: str | None = None
    description: str | None = None
    schema: dict | None = None
    strict: bool | None = None               # the schema is enforced either way


class ResponseFormat(_Strict, kw_only=True):
    type: str                                # text, json_object or json_schema
    json_schema: JsonSchemaFormat | None = None


class _Common(_Strict, kw_only=True):
    """What both endpoints take: OpenAI's sampling fields plus vLLM's extras."""
    model: str | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None      # vLLM's: only these may be drawn
    bad_words: list[str] | None = None               # vLLM's: words never generated
    truncate_prompt_tokens: int | None = None        # vLLM's: the prompt's last k tokens
    request_id: str | None = None                    # vLLM's: the response's id ("cmpl-ID")
    user: str | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = 0                        # lower runs first (--scheduling-policy priority)
    ttft_slo: float | None = None            # latency objectives in seconds (docs/SCHEDULING.md)
    tpot_slo: float | None = None
    return_token_ids: bool = False           # each choice also carries its token ids
    cache_salt: str | None = None            # prefix-cache blocks are shared only within a salt
    prompt_logprobs: int | None = None       # top-k logprobs of each prompt token (not streamed)
    # structured outputs (one form at most): OpenAI's, vLLM's, and vLLM's older fields
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: str | dict | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(_Common, kw_only=True):
    prompt: str | list[str | int | list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    add_special_tokens: bool = True          # vLLM's: the tokenizer's BOS (or the like) first


class ChatMessage(_Strict, kw_only=True):
    role: str
    content: str | list[dict] | None = None
    name: str | None = None
    tool_calls: list[dict] | None = None     # an assistant's calls (arguments: JSON text)
    tool_call_id: str | None = None          # a tool message: the call it answers
    reasoning_content: str | None = None     # an assistant's thought (the chat template's)
    # what the openai client keeps of an assistant message it was sent: taken only while
    # they say nothing (chat_messages)
    refusal: str | None = None
    annotations: list | None = None
    audio: dict | None = None
    function_call: dict | None = None


class ChatRequest(_Common, kw_only=True):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, str | int | float | bool | None] | None = None
    # OpenAI's, as gpt-oss's template reads it; refused where the template does not
    reasoning_effort: Literal["low", "medium", "high"] | None = None
    include_reasoning: bool = True           # vLLM's: False drops reasoning_content
    # vLLM's: a prompt that ends without the assistant's opening, or inside its last message
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool = False                       # vLLM's: a last assistant message starts the reply
    add_special_tokens: bool = False         # vLLM's: the tokenizer's own on top of the template's


def decode_request(body: bytes, kind: type):
    """The request, or ValueError saying which field is wrong."""
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as e:
        raise ValueError(f"invalid request: {e}") from None
    except msgspec.DecodeError as e:
        raise ValueError(f"the body is not valid JSON: {e}") from None
    except RecursionError:  # msgspec skips unknown fields by recursion: a deep one exhausts it
        raise ValueError("the body is nested too deeply") from None


def sampling_params(req: CompletionRequest | ChatRequest,
                    defaults: dict | None = None) -> SamplingParams:
    """SamplingParams for a request, or ValueError for what the engine cannot do. `defaults`
    ({field: value}, from the model's generation config) fill the fields the request leaves
    unset."""
    if req.stream_options is not None and not req.stream:
        raise ValueError("stream_options is only allowed with stream: true")
    if req.stream and req.prompt_logprobs is not None:
        raise ValueError("prompt_logprobs is not available with stream: true")
    prompt_logprobs = req.prompt_logprobs
    if isinstance(req, ChatRequest):
        max_tokens = (req.max_completion_tokens if req.max_completion_tokens is not None
                      else req.max_tokens)
        if req.top_logprobs is not None and not req.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
    else:
        max_tokens, logprobs = req.max_tokens, req.logprobs
        if req.suffix:
            raise ValueError("suffix is not supported")
        if req.best_of is not None and req.best_of != req.n:
            raise ValueError(f"best_of other than n is not supported (best_of {req.best_of}, "
                             f"n {req.n})")
        if max_tokens == 0:
            if not req.echo:
                raise ValueError("max_tokens must be at least 1 (0 only with echo: the prompt "
                                 "alone)")
            max_tokens = 1                   # computed, then left out of the response
        if req.echo and req.truncate_prompt_tokens is not None:
            raise ValueError("echo is not supported with truncate_prompt_tokens")
        if req.echo and logprobs is not None:
            prompt_logprobs = max(logprobs, prompt_logprobs or 0)
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise ValueError(f"logprobs must be between 0 and {MAX_LOGPROBS}, got {logprobs}")
    given = {
        "n": req.n, "temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k,
        "min_p": req.min_p, "presence_penalty": req.presence_penalty,
        "frequency_penalty": req.frequency_penalty, "repetition_penalty": req.repetition_penalty,
        "seed": req.seed, "max_tokens": max_tokens, "min_tokens": req.min_tokens,
        "ignore_eos": req.ignore_eos, "stop": [req.stop] if isinstance(req.stop, str) else req.stop,
        "stop_token_ids": req.stop_token_ids, "logprobs": logprobs,
        "prompt_logprobs": prompt_logprobs, "logit_bias": _logit_bias(req.logit_bias),
        "allowed_token_ids": req.allowed_token_ids, "bad_words": req.bad_words,
        "truncate_prompt_tokens": req.truncate_prompt_tokens,
        "skip_special_tokens": req.skip_special_tokens,
        "include_stop_str_in_output": req.include_stop_str_in_output,
        "structured_outputs": structured_outputs(req),
    }
    for name, value in (defaults or {}).items():
        if given.get(name) is None:
            given[name] = value
    # NOTE: a None means "the default"; max_tokens=None is kept: the rest of the context
    return SamplingParams(**{k: v for k, v in given.items()
                             if v is not None or k in ("max_tokens", "seed", "logprobs")})


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias (token ids as strings) with integer keys."""
    if not bias:
        return None
    try:
        return {int(k): float(v) for k, v in bias.items()}
    except ValueError:
        raise ValueError(f"logit_bias keys must be token ids, got {list(bias)[:5]}") from None


def structured_outputs(req: CompletionRequest | ChatRequest) -> StructuredOutputs | None:
    """The request's output constraint from whichever form it came in (ValueError if more
    than one, or a form is malformed)."""
    forms = {}
    if req.structured_outputs is not None:
        forms["structured_outputs"] = req.structured_outputs
    rf = req.response_format
    if rf is not None and rf.type != "text":
        if rf.type == "json_object":
            forms["response_format"] = StructuredOutputs(json_object=True)
        elif rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema is None:
                raise ValueError("response_format of type json_schema needs json_schema.schema")
            forms["response_format"] = StructuredOutputs(json=rf.json_schema.schema)
        else:
            raise ValueError(f"response_format type must be text, json_object or json_schema, "
                             f"got {rf.type!r}")
    for kind in ("json", "regex", "choice", "grammar"):
        value = getattr(req, f"guided_{kind}")
        if value is not None:
            forms[f"guided_{kind}"] = StructuredOutputs(**{kind: value})
    if len(forms) > 1:
        raise ValueError(f"set at most one of {', '.join(forms)}")
    return next(iter(forms.values()), None)


def completion_prompts(req: CompletionRequest) -> list[str | list[int]]:
    """The prompts of a completions request: texts and/or token-id lists, one per choice set."""
    p = req.prompt
    if isinstance(p, str):
        prompts = [p]
    elif p and all(isinstance(x, int) for x in p):
        prompts = [list(p)]
    elif p and all(isinstance(x, (str, list)) for x in p):
        prompts = list(p)
    else:
        raise ValueError("prompt must be a string, a list of strings, a list of token ids, or "
                         "a list of token-id lists")
    if any(len(x) == 0 for x in prompts):
        raise ValueError("the prompt is empty")
    return prompts


def chat_messages(req: ChatRequest) -> list[dict]:
    """The messages as the chat template takes them: text content, and an assistant's tool
    calls with their arguments as objects."""
    if not req.messages:
        raise ValueError("messages must not be empty")
    out = []
    for i, m in enumerate(req.messages):
        if isinstance(m.content, list):
            parts = [p.get("text") for p in m.content]
            if any(p.get("type") != "text" or not isinstance(t, str)
                   for p, t in zip(m.content, parts)):
                raise ValueError("only text content parts are supported")
            content = "".join(parts)
        else:
            content = m.content or ""
        for key in ("refusal", "annotations", "audio", "function_call"):
            if getattr(m, key):
                raise ValueError(f"messages[{i}].{key} is not supported")
        message = {"role": m.role, "content": content}
        if m.tool_calls:
            message["tool_calls"] = history_tool_calls(m.tool_calls, f"messages[{i}]")
        for key in ("name", "tool_call_id", "reasoning_content"):
            if getattr(m, key) is not None:
                message[key] = getattr(m, key)
        if m.reasoning_content is not None:
            message["thinking"] = m.reasoning_content    # gpt-oss's template's name for it
        out.append(message)
    return out
