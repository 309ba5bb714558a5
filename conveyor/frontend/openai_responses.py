"""The OpenAI API's response bodies and stream chunks (completions and chat completions), built
from RequestOutputs as plain dicts sent as JSON: usage, the legacy and chat logprobs objects, and
a response's shape, which adds up token counts as the stream's chunks pass by.

Completions with `echo` and `logprobs` give the prompt's tokens first in the legacy logprobs
object (the first token's logprob is null: nothing predicts it), as lm-evaluation-harness reads
them for loglikelihoods.
"""
from __future__ import annotations

import time
from collections.abc import Callable

import msgspec

from conveyor.frontend.chat_output import ChatReader
from conveyor.frontend.openai_protocol import CompletionRequest
from conveyor.outputs import CompletionOutput, Logprob, RequestOutput


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
    continuous_usage = False                 # usage in every chunk (vLLM's stream option)
    sse_event_names, done_marker = False, True     # the stream's form (http.EventStream)

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

    def closing(self, include_usage: bool) -> list[dict]:
        """The stream's last chunks."""
        return [self.usage_chunk()] if include_usage else []

    def failure(self, error: dict) -> list[dict]:
        """The chunks that end a stream whose request failed."""
        return [{"error": error}]

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
        out = self.base([self.choice(prompt_index * self.n + c.index, c, delta=True)],
                        chunk=True)
        if self.continuous_usage:
            out["usage"] = usage(self.prompt_tokens, self.completion_tokens)
        return out

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
        self.echo = ""                       # vLLM's echo: the last assistant message's text

    def opening(self) -> list[dict]:
        return [self.base([{"index": i, "delta": {"role": "assistant", "content": self.echo},
                            "logprobs": None, "finish_reason": None}], chunk=True)
                for i in range(self.n)]

    def body(self, index: int, c: CompletionOutput, delta: bool) -> dict:
        if self.new_reader is None:
            message = {"content": c.text} if delta else {"role": "assistant", "content": c.text}
        else:
            reader = self.readers.setdefault(index, self.new_reader())
            message = (reader.delta(c.text, final=c.finish_reason is not None) if delta
                       else reader.message(c.text))
        if self.echo and not delta:
            message["content"] = self.echo + (message["content"] or "")
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
