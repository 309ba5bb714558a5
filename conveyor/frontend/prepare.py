"""A request checked and tokenized, the one place for both: the prompt (text, token ids or chat
messages through the template, with tools and template keywords), its limits (n, the context
length, the vocabulary), logit_bias, the structured-output constraint (compiled once to check it;
a reasoning model's constraint starts after its thought) and, for the HTTP API's rule, max_tokens
fitted to the context.

A prompt longer in characters than the context could hold even at the vocabulary's longest
token is refused before tokenizing, and `tokenizes_inline` says which prompts are short enough
to tokenize on the event loop (the rest go to a thread).
"""
from __future__ import annotations

from dataclasses import dataclass

import msgspec

from conveyor.frontend.tokenizer import apply_chat_template, check_token_ids
from conveyor.shared.grammar import check as check_grammar
from conveyor.shared.messages.client import GenerateRequest
from conveyor.shared.sampling_params import SamplingParams

INLINE_CHARS = 16 << 10      # prompts up to this many characters are tokenized on the loop
MIN_CHARS_PER_TOKEN = 16     # the length bound assumes at least this (see _max_prompt_chars)


@dataclass
class RequestPreparer:
    tokenizer: object | None
    vocab_size: int
    max_model_len: int
    max_n: int | None = None                 # a request's n beyond this is refused
    reasoning: type | None = None            # the server's ReasoningParser (--reasoning-parser)

    def __post_init__(self) -> None:
        self.max_prompt_chars = _max_prompt_chars(self.tokenizer, self.max_model_len)

    def prepare(self, req: GenerateRequest, fit_context: bool
                ) -> tuple[str | None, list[int], SamplingParams]:
        """(prompt text, prompt token ids, sampling params), or ValueError saying what is
        wrong: the one place a request is tokenized and checked against the limits."""
        params = req.sampling
        if self.max_n is not None and params.n > self.max_n:
            raise ValueError(f"n must be at most {self.max_n}, got {params.n}")
        given = [x is not None for x in (req.prompt, req.prompt_token_ids, req.messages)]
        if sum(given) != 1:
            raise ValueError("set exactly one of prompt, prompt_token_ids and messages")
        if self.tokenizer is None and (req.prompt_token_ids is None or params.stop):
            raise ValueError("this engine has no tokenizer: send prompt_token_ids, and no stop "
                             "strings")
        chars = _prompt_chars(req)
        if chars > self.max_prompt_chars:
            raise ValueError(f"the prompt has {chars} characters, more than a context of "
                             f"{self.max_model_len} tokens can hold (at most "
                             f"{self.max_prompt_chars} characters)")
        if req.messages is not None:
            for i, m in enumerate(req.messages):
                if "role" not in m or "content" not in m:
                    raise ValueError(f"messages[{i}] needs a role and a content")
        if params.allowed_token_ids is not None:
            check_token_ids(params.allowed_token_ids, self.vocab_size, "allowed_token_ids")
        if params.bad_words:
            if self.tokenizer is None:
                raise ValueError("bad_words need the model's tokenizer, and this engine has none")
            params = msgspec.structs.replace(params, bad_words_token_ids=[
                *params.bad_words_token_ids, *bad_word_ids(self.tokenizer, params.bad_words)])
        for ids in params.bad_words_token_ids:
            check_token_ids(ids, self.vocab_size, "bad_words_token_ids")
        if params.logit_bias and max(params.logit_bias) >= self.vocab_size:
            bad = sorted(t for t in params.logit_bias if t >= self.vocab_size)
            raise ValueError(f"logit_bias token ids out of the vocabulary [0, {self.vocab_size})"
                             f": {bad[:5]}")
        if params.structured_outputs is not None:
            if self.tokenizer is None:
                raise ValueError("structured_outputs need the model's tokenizer, and this engine "
                                 "has none")
            check_grammar(params.structured_outputs)
        text = None
        if req.prompt_token_ids is not None:
            token_ids = list(req.prompt_token_ids)
            check_token_ids(token_ids, self.vocab_size)
        elif req.messages is not None:
            token_ids = apply_chat_template(self.tokenizer, req.messages, tools=req.tools,
                                            add_special_tokens=bool(req.add_special_tokens),
                                            **(req.chat_template_kwargs or {}))
        else:
            text = req.prompt
            token_ids = self.tokenizer.encode(text, add_special_tokens=req.add_special_tokens
                                              is not False)
        keep = params.truncate_prompt_tokens
        if keep == -1:
            keep = self.max_model_len - (params.max_tokens or 1)
        if keep is not None and len(token_ids) > keep:
            text, token_ids = None, token_ids[len(token_ids) - max(keep, 1):]
        so = params.structured_outputs
        if so is not None and so.start_after is not None:
            check_token_ids(so.start_after, self.vocab_size, "structured_outputs.start_after")
            if so.thought_open is not None:
                check_token_ids(so.thought_open, self.vocab_size,
                                "structured_outputs.thought_open")
        elif so is not None and self.reasoning is not None and req.messages is not None:
            # a reasoning model thinks freely; the constraint holds its answer, after the thought
            start = self.reasoning.constraint_start(self.tokenizer, token_ids, so)
            if start is not None:
                so = msgspec.structs.replace(so, start_after=start,
                                             thought_open=self.reasoning.thought_open(
                                                 self.tokenizer))
                params = msgspec.structs.replace(params, structured_outputs=so)
        if fit_context:
            room = self.max_model_len - len(token_ids)
            if room < 1:
                raise ValueError(f"the prompt has {len(token_ids)} tokens, but the model's "
                                 f"context length is {self.max_model_len} (prompt plus at least "
                                 f"one generated token)")
            if params.max_tokens is None:
                params = msgspec.structs.replace(params, max_tokens=room)
            elif params.max_tokens > room:
                raise ValueError(f"the prompt has {len(token_ids)} tokens and max_tokens is "
                                 f"{params.max_tokens}, but the model's context length is "
                                 f"{self.max_model_len}; lower max_tokens to at most {room}")
        return text, token_ids, params


def tokenizes_inline(req: GenerateRequest) -> bool:
    """Whether the request's prompt is short enough to tokenize on the event loop."""
    return _prompt_chars(req) <= INLINE_CHARS


def _prompt_chars(req: GenerateRequest) -> int:
    if req.prompt is not None:
        return len(req.prompt)
    if req.messages is not None:
        return sum(len(k) + len(v) for m in req.messages for k, v in m.items())
    return 0


def _max_prompt_chars(tokenizer, max_model_len: int) -> int:
    """Characters beyond which a prompt cannot fit in the context: every token stands for at
    most as many characters as the longest entry of the vocabulary (at least
    MIN_CHARS_PER_TOKEN, for normalizers that drop characters), so a longer text has more
    tokens than the context holds and is refused before it is tokenized."""
    if tokenizer is None:
        return 0
    longest = max(map(len, tokenizer.get_vocab()), default=0)
    return max_model_len * max(longest, MIN_CHARS_PER_TOKEN)


def bad_word_ids(tokenizer, words: list[str]) -> list[list[int]]:
    """The token ids each bad word may be generated as: alone (the start of a text) and after
    a space. NOTE: vLLM keeps the spaced form only where it has as many tokens as the bare one
    (in this vocabulary " paint" is one token, "paint" two, so it would not ban " paint")."""
    out = []
    for word in words:
        bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        out += [bare] + ([spaced] if spaced != bare else [])
    return out
