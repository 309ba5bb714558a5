"""The OpenAI API's request and response shapes (completions and chat completions).

Requests are decoded with msgspec: a field of the wrong type is a clear 400, unknown fields are
ignored (as OpenAI's servers do). `sampling_params` maps a request onto SamplingParams, with
vLLM's extra fields (top_k, min_p, ignore_eos, repetition_penalty, min_tokens, ...). The builders
turn RequestOutputs into response bodies and stream chunks (plain dicts, sent as JSON).
"""
from __future__ import annotations

import time

import msgspec

from conveyor.outputs import CompletionOutput, Logprob, RequestOutput
from conveyor.shared.sampling_params import MAX_LOGPROBS, SamplingParams
from conveyor.shared.structured_outputs import StructuredOutputs


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(msgspec.Struct, kw_only=True):
    name: str | None = None
    description: str | None = None
    schema: dict | None = None
    strict: bool | None = None               # the schema is enforced either way


class ResponseFormat(msgspec.Struct, kw_only=True):
    type: str                                # text, json_object or json_schema
    json_schema: JsonSchemaFormat | None = None


class _Common(msgspec.Struct, kw_only=True):
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


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[dict] | None = None
    name: str | None = None


class ChatRequest(_Common, kw_only=True):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None


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


def sampling_params(req: CompletionRequest | ChatRequest) -> SamplingParams:
    """SamplingParams for a request, or ValueError for what the engine cannot do."""
    if req.logit_bias:
        raise ValueError("logit_bias is not supported")
    if req.stream_options is not None and not req.stream:
        raise ValueError("stream_options is only allowed with stream: true")
    if isinstance(req, ChatRequest):
        max_tokens = req.max_completion_tokens or req.max_tokens
        if req.top_logprobs is not None and not req.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        if req.tools:
            raise ValueError("tools are not supported")
        if req.tool_choice not in (None, "none"):
            raise ValueError("tool_choice is not supported")
    else:
        max_tokens, logprobs = req.max_tokens, req.logprobs
        if req.suffix:
            raise ValueError("suffix is not supported")
        if req.best_of is not None and req.best_of != req.n:
            raise ValueError("best_of other than n is not supported")
        if req.echo and req.logprobs is not None:
            raise ValueError("echo with logprobs is not supported")
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise ValueError(f"logprobs must be between 0 and {MAX_LOGPROBS}, got {logprobs}")
    given = {
        "n": req.n, "temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k,
        "min_p": req.min_p, "presence_penalty": req.presence_penalty,
        "frequency_penalty": req.frequency_penalty, "repetition_penalty": req.repetition_penalty,
        "seed": req.seed, "max_tokens": max_tokens, "min_tokens": req.min_tokens,
        "ignore_eos": req.ignore_eos, "stop": [req.stop] if isinstance(req.stop, str) else req.stop,
        "stop_token_ids": req.stop_token_ids, "logprobs": logprobs,
        "skip_special_tokens": req.skip_special_tokens,
        "include_stop_str_in_output": req.include_stop_str_in_output,
        "structured_outputs": structured_outputs(req),
    }
    # NOTE: a None means "the default"; max_tokens=None is kept: the rest of the context
    return SamplingParams(**{k: v for k, v in given.items()
                             if v is not None or k in ("max_tokens", "seed", "logprobs")})


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


def chat_messages(req: ChatRequest) -> list[dict[str, str]]:
    if not req.messages:
        raise ValueError("messages must not be empty")
    out = []
    for m in req.messages:
        if isinstance(m.content, list):
            parts = [p.get("text") for p in m.content]
            if any(p.get("type") != "text" or not isinstance(t, str)
                   for p, t in zip(m.content, parts)):
                raise ValueError("only text content parts are supported")
            content = "".join(parts)
        else:
            content = m.content or ""
        out.append({"role": m.role, "content": content})
    return out


# --- responses --------------------------------------------------------------------------------

def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_logprobs(entries: list[dict[int, Logprob]], offset: int) -> dict:
    """OpenAI's legacy logprobs object: tokens, their logprobs, top alternatives, offsets."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for entry in entries:
        chosen = next(iter(entry.values()))
        text = chosen.decoded_token or ""
        tokens.append(text)
        token_logprobs.append(chosen.logprob)
        top.append({(lp.decoded_token or ""): lp.logprob for lp in entry.values()})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top,
            "text_offset": offsets}


def chat_logprobs(entries: list[dict[int, Logprob]], top: int) -> dict:
    """Per token: the chosen one, and the `top` most likely (which may include it)."""
    def one(lp: Logprob) -> dict:
        text = lp.decoded_token or ""
        return {"token": text, "logprob": lp.logprob, "bytes": list(text.encode())}

    return {"content": [{**one(next(iter(e.values()))), "top_logprobs": [
        one(lp) for lp in sorted(e.values(), key=lambda lp: lp.rank)[:top]]} for e in entries]}


# --- response shapes --------------------------------------------------------------------------

class ResponseShape:
    """The bodies of one response; the stream adds up its token counts as chunks pass by.
    A subclass says what a choice holds (`body`: text or message, logprobs)."""
    object_name = chunk_object = ""
    token_ids = False                        # add each choice's token ids (vLLM's extra)

    def __init__(self, id: str, model: str, n: int):
        self.id, self.model, self.n = id, model, n
        self.created = int(time.time())
        self.prompt_tokens = 0
        self.completion_tokens = 0

    def base(self, choices: list[dict], chunk: bool = False) -> dict:
        return {"id": self.id, "object": self.chunk_object if chunk else self.object_name,
                "created": self.created, "model": self.model, "choices": choices}

    def opening(self) -> list[dict]:
        return []

    def usage_chunk(self) -> dict:
        return {**self.base([], chunk=True),
                "usage": usage(self.prompt_tokens, self.completion_tokens)}

    def choice(self, index: int, c: CompletionOutput, delta: bool = False) -> dict:
        out = {"index": index, **self.body(index, c, delta),
               "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
        if self.token_ids:
            out["token_ids"] = c.token_ids
        return out

    def chunk(self, prompt_index: int, c: CompletionOutput) -> dict:
        return self.base([self.choice(prompt_index * self.n + c.index, c, delta=True)],
                         chunk=True)

    def whole(self, finals: list[RequestOutput]) -> dict:
        """The response body of whole outputs, one per prompt in prompt order."""
        choices = []
        for i, out in enumerate(finals):
            self.prompt_tokens += len(out.prompt_token_ids or [])
            for c in out.outputs:
                self.completion_tokens += len(c.token_ids)
                choices.append(self.choice(i * self.n + c.index, c))
        return {**self.base(choices),
                "usage": usage(self.prompt_tokens, self.completion_tokens)}


class CompletionShape(ResponseShape):
    object_name = chunk_object = "text_completion"

    def __init__(self, id: str, model: str, req: CompletionRequest, tokenizer):
        super().__init__(id, model, req.n)
        self.echo, self.tokenizer = req.echo, tokenizer
        self.prompts = req.prompt if isinstance(req.prompt, list) and not isinstance(
            req.prompt[0], int) else [req.prompt]
        self.echoed: set[int] = set()

    def _prefix(self, index: int) -> str:
        if not self.echo or index in self.echoed:
            return ""
        self.echoed.add(index)
        prompt = self.prompts[index // self.n]
        if isinstance(prompt, str) or self.tokenizer is None:
            return prompt if isinstance(prompt, str) else ""
        return self.tokenizer.decode(prompt)

    def body(self, index: int, c: CompletionOutput, delta: bool) -> dict:
        return {"text": self._prefix(index) + c.text,
                "logprobs": None if c.logprobs is None else completion_logprobs(c.logprobs, 0)}


class ChatShape(ResponseShape):
    object_name, chunk_object = "chat.completion", "chat.completion.chunk"

    def __init__(self, id: str, model: str, n: int, top_logprobs: int):
        super().__init__(id, model, n)
        self.top = top_logprobs

    def opening(self) -> list[dict]:
        return [self.base([{"index": i, "delta": {"role": "assistant", "content": ""},
                            "logprobs": None, "finish_reason": None}], chunk=True)
                for i in range(self.n)]

    def body(self, index: int, c: CompletionOutput, delta: bool) -> dict:
        message = {"content": c.text} if delta else {"role": "assistant", "content": c.text}
        return {"delta" if delta else "message": message,
                "logprobs": None if c.logprobs is None else chat_logprobs(c.logprobs, self.top)}
