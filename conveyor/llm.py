"""The offline API: `LLM(...).generate(prompts, params)` and `.chat(messages, params)`.

Runs the engine in this process (scheduler and model runner over an in-process channel) and
returns one RequestOutput per prompt, in order, as vLLM's LLM does.
"""
from __future__ import annotations

import itertools
import time
from collections.abc import Iterator, Sequence
from typing import Any

from conveyor.engine import EngineCore
from conveyor.frontend.tokenizer import apply_chat_template, check_token_ids, load_tokenizer
from conveyor.frontend.tracker import RequestTracker
from conveyor.outputs import RequestOutput
from conveyor.shared.config import EngineConfig
from conveyor.shared.sampling_params import INT64_MAX, INT64_MIN, SamplingParams

Prompt = str | list[int] | dict[str, Any]


OFFLINE_GPU_TOKEN_BUDGET = 16384   # max_num_batched_tokens of LLM(device="cuda")


def offline_defaults(engine_args: dict) -> dict:
    """The engine arguments with LLM's own defaults where they differ from a server's: on a GPU,
    a prefill budget of OFFLINE_GPU_TOKEN_BUDGET tokens a step. An offline batch gains from
    fewer, larger mixed steps (as vLLM's LLM class on big GPUs; on an H200 the reference
    workload ran 0.6-4.7 % faster than with 8192, docs/BENCHMARKS.md), where a server keeps
    steps short for the requests already decoding."""
    if engine_args.get("device") == "cuda":
        return {"max_num_batched_tokens": OFFLINE_GPU_TOKEN_BUDGET, **engine_args}
    return engine_args


class LLM:
    def __init__(self, model: str | None = None, tokenizer: str | None = None,
                 skip_tokenizer_init: bool = False, **engine_args):
        self.config = EngineConfig.from_kwargs(model=model, tokenizer=tokenizer,
                                               **offline_defaults(engine_args))
        self.engine = EngineCore(self.config)
        # without a tokenizer, prompts are token ids and outputs carry token ids only
        self.tokenizer = None if skip_tokenizer_init else load_tokenizer(self.engine.files,
                                                                          tokenizer)
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.tokenizer

    @property
    def quantization_report(self):
        """What --quantization did at load (a QuantReport: `.summary()`, `.quantized`, `.kept`,
        `.prequantized`, bytes before and after), or None for an unquantized model."""
        return self.engine.runner.quant_report

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: int | Sequence[int] | None = None
                 ) -> list[RequestOutput]:
        """priority: one per prompt (or one for all); lower runs first under
        `scheduling_policy="priority"` (docs/SCHEDULING.md), other policies ignore it."""
        prompts = _as_list(prompts)
        params = _params_per_prompt(sampling_params, len(prompts))
        priorities = _priority_per_prompt(priority, len(prompts))
        tracker = RequestTracker(self.tokenizer)
        ids = []
        try:
            for prompt, p, prio in zip(prompts, params, priorities):
                text, token_ids = self._tokenize(prompt)
                ids.append(self._add(tracker, text, token_ids, p, prio))
            self._run(tracker, len(ids) if use_tqdm else 0)
        except BaseException:
            self.engine.abort([s for r in tracker.requests.values() for s in _seq_ids(r)])
            raise
        return [tracker.pop(i) for i in ids]

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer (skip_tokenizer_init is set)")
        prompts = [apply_chat_template(self.tokenizer, conv, add_generation_prompt,
                                       **(chat_template_kwargs or {})) for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None
               ) -> Iterator[str]:
        """Yield the text of one completion as it is generated (used by `conveyor chat`)."""
        tracker = RequestTracker(self.tokenizer)
        text, token_ids = self._tokenize(prompt)
        rid = self._add(tracker, text, token_ids, sampling_params or SamplingParams())
        try:
            while not tracker.requests[rid].output.finished:
                self._step(tracker)
                delta = tracker.stream_delta(rid, 0)
                if delta:
                    yield delta
            tail = tracker.stream_delta(rid, 0)
            if tail:
                yield tail
        finally:
            if not tracker.requests[rid].output.finished:
                self.engine.abort(_seq_ids(tracker.requests[rid]))
            tracker.pop(rid)

    # --- internals ----------------------------------------------------------------------------

    def _tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer (skip_tokenizer_init is set)")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            return self._tokenize(prompt["prompt"])
        return None, list(prompt)

    def _add(self, tracker: RequestTracker, text, token_ids, params: SamplingParams,
             priority: int = 0) -> str:
        if self.tokenizer is None and params.stop:
            raise ValueError("stop strings need a tokenizer (skip_tokenizer_init is set)")
        check_token_ids(token_ids, self.engine.model_config.vocab_size)
        rid = str(next(self._ids))
        for msg in tracker.add(rid, text, token_ids, params, priority, arrival=time.time()):
            tracker.process(self.engine.add(msg))
        return rid

    def _step(self, tracker: RequestTracker) -> list[str]:
        updated, stopped = tracker.process(self.engine.step())
        if stopped:
            tracker.process(self.engine.abort(stopped, "stop"))
        return updated

    def _run(self, tracker: RequestTracker, total: int) -> None:
        bar = None
        if total > 1:
            from tqdm.auto import tqdm
            bar = tqdm(total=total, desc="Processed prompts", dynamic_ncols=True)
        done = 0
        try:
            while not all(r.output.finished for r in tracker.requests.values()):
                if not self.engine.has_work():
                    raise RuntimeError("the engine went idle with requests unfinished")
                self._step(tracker)
                if bar is not None:
                    now_done = sum(r.output.finished for r in tracker.requests.values())
                    bar.update(now_done - done)
                    done = now_done
        finally:
            if bar is not None:
                bar.close()


def _seq_ids(req) -> list[str]:
    rid = req.output.request_id
    return [f"{rid}/{i}" for i in range(len(req.seqs))]


def _as_list(prompts) -> list[Prompt]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and isinstance(prompts[0], int):     # one prompt given as token ids
        return [prompts]
    return prompts


def _params_per_prompt(params, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} sampling params for {n} prompts")
    return params


def _priority_per_prompt(priority, n: int) -> list[int]:
    if priority is None:
        priority = 0
    priorities = [priority] * n if isinstance(priority, int) else list(priority)
    if len(priorities) != n:
        raise ValueError(f"got {len(priorities)} priorities for {n} prompts")
    for p in priorities:
        if isinstance(p, bool) or not isinstance(p, int) or not INT64_MIN <= p <= INT64_MAX:
            raise ValueError(f"priority must be an integer that fits in 64 bits, got {p!r}")
    return priorities
