"""The OpenAI API's request and response shapes (completions and chat completions).

Requests are decoded with msgspec: a field of the wrong type is a clear 400, unknown fields are
ignored (as OpenAI's servers do). `sampling_params` maps a request onto SamplingParams, with
vLLM's extra fields (top_k, min_p, ignore_eos, repetition_penalty, min_tokens, prompt_logprobs,
...) and the server's defaults (generation_config.json) for what the request leaves unset. The
builders turn RequestOutputs into response bodies and stream chunks (plain dicts, sent as JSON).

Completions with `echo` and `logprobs` give the prompt's tokens first in the legacy logprobs
object (the first token's logprob is null: nothing predicts it), as lm-evaluation-harness reads
them for loglikelihoods; `max_tokens: 0` with `echo` returns the prompt alone (one token is
computed and left out).
"""
from __future__ import annotations

import time
from collections.abc import Callable

import msgspec

from conveyor.frontend.chat_output import ChatReader
from conveyor.frontend.tools import history_tool_calls
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


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[dict] | None = None
    name: str | None = None
    tool_calls: list[dict] | None = None     # an assistant's calls (arguments: JSON text)
    tool_call_id: str | None = None          # a tool message: the call it answers


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
        max_tokens = req.max_completion_tokens or req.max_tokens
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
        message = {"role": m.role, "content": content}
        if m.tool_calls:
            message["tool_calls"] = history_tool_calls(m.tool_calls, f"messages[{i}]")
        for key in ("name", "tool_call_id"):
            if getattr(m, key) is not None:
                message[key] = getattr(m, key)
        out.append(message)
    return out


# --- responses --------------------------------------------------------------------------------

def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_logprobs(entries: list[tuple[str, float | None, dict | None]],
                        offset: int) -> dict:
    """OpenAI's legacy logprobs object of (token text, its logprob, {text: logprob} of the top
    tokens) per token; text offsets count from `offset`."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for text, logprob, alternatives in entries:
        tokens.append(text)
        token_logprobs.append(logprob)
        top.append(alternatives)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top,
            "text_offset": offsets}


def legacy_entry(position: dict[int, Logprob], k: int | None = None
                 ) -> tuple[str, float, dict]:
    """One position for completion_logprobs: the chosen token (first) and, of the rest, those
    ranked k or better (all when k is None)."""
    items = list(position.values())
    chosen = items[0]
    top = {(lp.decoded_token or ""): lp.logprob for j, lp in enumerate(items)
           if j == 0 or k is None or (lp.rank or 0) <= k}
    return chosen.decoded_token or "", chosen.logprob, top


def prompt_logprobs_json(entries: list[dict[int, Logprob] | None], k: int) -> list:
    """vLLM's prompt_logprobs: per prompt token None (the first) or {token id: {logprob, rank,
    decoded_token}} of the prompt's token and the k most likely."""
    return [None if e is None else {
        str(tok): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
        for j, (tok, lp) in enumerate(e.items()) if j == 0 or (lp.rank or 0) <= k}
        for e in entries]


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

    def __init__(self, id: str, model: str, n: int, prompt_logprobs: int | None = None):
        self.id, self.model, self.n = id, model, n
        self.prompt_logprobs = prompt_logprobs
        self.created = int(time.time())
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.prompts: dict[int, RequestOutput] = {}   # prompt index -> its first output

    def base(self, choices: list[dict], chunk: bool = False) -> dict:
        return {"id": self.id, "object": self.chunk_object if chunk else self.object_name,
                "created": self.created, "model": self.model, "choices": choices}

    def opening(self) -> list[dict]:
        return []

    def usage_chunk(self) -> dict:
        return {**self.base([], chunk=True),
                "usage": usage(self.prompt_tokens, self.completion_tokens)}

    def saw(self, prompt_index: int, out: RequestOutput) -> None:
        """Note an output of a prompt: the first one carries the prompt's tokens."""
        if out.prompt_token_ids is not None and prompt_index not in self.prompts:
            self.prompts[prompt_index] = out
            self.prompt_tokens += len(out.prompt_token_ids)

    def visible(self, c: CompletionOutput) -> CompletionOutput:
        """What the client sees of a completion."""
        return c

    def choice(self, index: int, c: CompletionOutput, delta: bool = False) -> dict:
        out = {"index": index, **self.body(index, c, delta),
               "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
        if self.token_ids:
            out["token_ids"] = c.token_ids
        return out

    def chunk(self, prompt_index: int, c: CompletionOutput) -> dict:
        c = self.visible(c)
        self.completion_tokens += len(c.token_ids)
        return self.base([self.choice(prompt_index * self.n + c.index, c, delta=True)],
                         chunk=True)

    def whole(self, finals: list[RequestOutput]) -> dict:
        """The response body of whole outputs, one per prompt in prompt order."""
        choices = []
        for i, out in enumerate(finals):
            self.saw(i, out)
            for c in out.outputs:
                c = self.visible(c)
                self.completion_tokens += len(c.token_ids)
                choices.append(self.choice(i * self.n + c.index, c))
        return {**self.base(choices),
                "usage": usage(self.prompt_tokens, self.completion_tokens)}

    def prompt_logprobs_of(self, prompt_index: int) -> list | None:
        out = self.prompts.get(prompt_index)
        if self.prompt_logprobs is None or out is None or out.prompt_logprobs is None:
            return None
        return prompt_logprobs_json(out.prompt_logprobs, self.prompt_logprobs)


class CompletionShape(ResponseShape):
    object_name = chunk_object = "text_completion"

    def __init__(self, id: str, model: str, req: CompletionRequest, tokenizer):
        super().__init__(id, model, req.n, req.prompt_logprobs)
        self.echo, self.tokenizer = req.echo, tokenizer
        self.logprobs = req.logprobs
        self.prompt_only = req.max_tokens == 0     # echo alone (sampling_params checked it)
        self.texts = req.prompt if isinstance(req.prompt, list) and not isinstance(
            req.prompt[0], int) else [req.prompt]
        self.echoed: set[int] = set()
        self.offsets: dict[int, int] = {}          # choice index -> text offset of what follows

    def visible(self, c: CompletionOutput) -> CompletionOutput:
        if not self.prompt_only:
            return c
        reason = c.finish_reason if c.finish_reason in (None, "abort", "error") else "length"
        return msgspec.structs.replace(c, text="", token_ids=[], finish_reason=reason,
                                       stop_reason=None,
                                       logprobs=None if c.logprobs is None else [])

    def _prompt_text(self, prompt_index: int) -> str:
        prompt = self.texts[prompt_index]
        if isinstance(prompt, str) or self.tokenizer is None:
            return prompt if isinstance(prompt, str) else ""
        return self.tokenizer.decode(prompt)

    def _prompt_entries(self, prompt_index: int) -> list[tuple[str, float | None, dict | None]]:
        """The prompt's tokens for the legacy logprobs object: the first has no logprob."""
        out = self.prompts.get(prompt_index)
        if out is None or not out.prompt_token_ids or out.prompt_logprobs is None:
            return []
        first = self.tokenizer.decode([out.prompt_token_ids[0]]) if self.tokenizer else ""
        return [(first, None, None)] + [legacy_entry(e, self.logprobs)
                                        for e in out.prompt_logprobs[1:]]

    def body(self, index: int, c: CompletionOutput, delta: bool) -> dict:
        prompt_index = index // self.n
        echo_now = self.echo and index not in self.echoed
        if echo_now:
            self.echoed.add(index)
        out = {"text": (self._prompt_text(prompt_index) if echo_now else "") + c.text,
               "logprobs": None}
        if c.logprobs is not None:
            entries = self._prompt_entries(prompt_index) if echo_now else []
            entries += [legacy_entry(e) for e in c.logprobs]
            start = self.offsets.get(index, 0)
            out["logprobs"] = completion_logprobs(entries, start)
            self.offsets[index] = start + sum(len(e[0]) for e in entries)
        if not delta and self.prompt_logprobs is not None:
            out["prompt_logprobs"] = self.prompt_logprobs_of(prompt_index)
        return out


class ChatShape(ResponseShape):
    object_name, chunk_object = "chat.completion", "chat.completion.chunk"

    def __init__(self, id: str, model: str, n: int, top_logprobs: int,
                 prompt_logprobs: int | None = None,
                 new_reader: Callable[[], ChatReader] | None = None):
        super().__init__(id, model, n, prompt_logprobs)
        self.top = top_logprobs
        self.new_reader = new_reader         # None: the text is the content, as it is
        self.readers: dict[int, ChatReader] = {}

    def opening(self) -> list[dict]:
        return [self.base([{"index": i, "delta": {"role": "assistant", "content": ""},
                            "logprobs": None, "finish_reason": None}], chunk=True)
                for i in range(self.n)]

    def body(self, index: int, c: CompletionOutput, delta: bool) -> dict:
        if self.new_reader is None:
            message = {"content": c.text} if delta else {"role": "assistant", "content": c.text}
        else:
            reader = self.readers.setdefault(index, self.new_reader())
            message = (reader.delta(c.text, final=c.finish_reason is not None) if delta
                       else reader.message(c.text))
        return {"delta" if delta else "message": message,
                "logprobs": None if c.logprobs is None else chat_logprobs(c.logprobs, self.top)}

    def choice(self, index: int, c: CompletionOutput, delta: bool = False) -> dict:
        out = super().choice(index, c, delta)
        reader = self.readers.get(index)
        if reader is not None and reader.called and c.finish_reason == "stop":
            out["finish_reason"] = "tool_calls"
        return out

    def chunk(self, prompt_index: int, c: CompletionOutput) -> dict | None:
        """None when a parser holds back all of this piece and it carries nothing else."""
        out = super().chunk(prompt_index, c)
        choice = out["choices"][0]
        if (not choice["delta"] and choice["finish_reason"] is None and c.logprobs is None
                and not self.token_ids):
            return None
        return out

    def whole(self, finals: list[RequestOutput]) -> dict:
        body = super().whole(finals)
        if self.prompt_logprobs is not None:
            body["prompt_logprobs"] = self.prompt_logprobs_of(0)
        return body
