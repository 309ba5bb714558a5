"""The offline API: `LLM(...).generate(prompts, params)` and `.chat(messages, params)`.

The same request path as the server's, in this process: a FrontendCore (tokenize, check, fan
out, detokenize, stop strings) joined to an EngineCore (scheduler and model runner) by an
in-process channel that carries the same encoded messages as the sockets. Returns one
RequestOutput per prompt, in order, as vLLM's LLM does.
"""
from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any

from conveyor.engine import EngineCore
from conveyor.frontend.core import READY, FrontendCore
from conveyor.frontend.tokenizer import load_tokenizer
from conveyor.outputs import RequestOutput
from conveyor.shared.config import EngineConfig
from conveyor.shared.generation_config import default_sampling
from conveyor.shared.lora import LoRARequest, lora_registry
from conveyor.shared.messages import through_wire
from conveyor.shared.messages.client import GenerateRequest
from conveyor.shared.messages.engine import Abort, AddRequest
from conveyor.shared.request_options import RequestOptions
from conveyor.shared.sampling_params import SamplingParams

Prompt = str | list[int] | dict[str, Any]


class LLM:
    def __init__(self, model: str | None = None, tokenizer: str | None = None,
                 skip_tokenizer_init: bool = False, **engine_args):
        self.config = EngineConfig.from_kwargs(model=model, tokenizer=tokenizer,
                                               **engine_args).with_defaults(offline=True)
        if self.config.data_parallel_size > 1:
            raise ValueError("data_parallel_size: replicas are served by `conveyor serve`; LLM "
                             "runs one engine in this process (data_parallel_size=1)")
        if self.config.distributed_executor_backend != "mp":
            raise ValueError("distributed_executor_backend: Ray workers are placed by `conveyor "
                             "serve`; LLM runs one engine in this process ('mp')")
        if self.config.tensor_parallel_size > 1:
            raise ValueError("tensor_parallel_size: tensor-parallel ranks are worker processes "
                             "of `conveyor serve --tp N`; LLM runs one engine in this process "
                             "(tensor_parallel_size=1)")
        if self.config.pipeline_parallel_size > 1:
            raise ValueError("pipeline_parallel_size: pipeline stages are worker processes of "
                             "`conveyor serve`; LLM runs one engine in this process "
                             "(pipeline_parallel_size=1)")
        self.engine, self.runner = EngineCore.local(self.config)
        # without a tokenizer, prompts are token ids and outputs carry token ids only
        c = self.config
        self.tokenizer = None if skip_tokenizer_init else load_tokenizer(
            self.runner.files, tokenizer, c.chat_template, c.revision)
        self.default_sampling = default_sampling(self.runner.files, c.generation_config)
        self.core = FrontendCore(self.tokenizer, self.runner.model_config.vocab_size,
                                 self.runner.max_model_len, "", self._send, state=READY,
                                 loras=lora_registry(self.config, self.runner.model_config))
        self._from_engine: list = []         # outputs the engine gave outside step()
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What a call without sampling params uses: SamplingParams' defaults, over which the
        model's generation_config.json (generation_config="auto") sets its sampling keys."""
        return SamplingParams(**self.default_sampling)

    @property
    def quantization_report(self):
        """What --quantization did at load (a QuantReport: `.summary()`, `.quantized`, `.kept`,
        `.prequantized`, bytes before and after), or None for an unquantized model."""
        return self.runner.quant_report

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: int | Sequence[int] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
                 ) -> list[RequestOutput]:
        """priority: one per prompt (or one for all); lower runs first under
        `scheduling_policy="priority"` (docs/SCHEDULING.md), other policies ignore it.
        lora_request: the LoRA adapter to run with, one for all prompts or one per prompt (None:
        the base model); needs enable_lora=True. An adapter is checked and registered under its
        name the first time it is used."""
        prompts = _as_list(prompts)
        sampling_params = sampling_params or self.get_default_sampling_params()
        loras = _per_prompt(lora_request, len(prompts), "LoRA requests")
        names = [self._lora_name(lora) for lora in loras]
        requests = [_request(p, params, RequestOptions(priority=prio, lora=name))
                    for p, params, prio, name in zip(
                        prompts, _per_prompt(sampling_params, len(prompts), "sampling params"),
                        _per_prompt(priority or 0, len(prompts), "priorities"), names)]
        return self._run(requests, use_tqdm)

    def _lora_name(self, lora: LoRARequest | None) -> str | None:
        if lora is None:
            return None
        if self.core.loras is None:
            raise ValueError("lora_request needs an engine with enable_lora=True")
        # a path given as a Path travels as text
        self.core.loras.add(LoRARequest(lora.lora_name, lora.lora_int_id, str(lora.lora_path)))
        return lora.lora_name

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template_kwargs: dict | None = None,
             tools: list[dict] | None = None,
             continue_final_message: bool = False) -> list[RequestOutput]:
        """tools: OpenAI-style function definitions, for the chat template to show the model;
        continue_final_message (with add_generation_prompt=False): the prompt ends inside the
        last message, the assistant's, which the model goes on writing."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        sampling_params = sampling_params or self.get_default_sampling_params()
        kwargs = {"add_generation_prompt": add_generation_prompt,
                  **({"continue_final_message": True} if continue_final_message else {}),
                  **(chat_template_kwargs or {})}
        requests = [GenerateRequest(id="", messages=conv, sampling=params or SamplingParams(),
                                    chat_template_kwargs=kwargs, tools=tools)
                    for conv, params in zip(conversations, _per_prompt(
                        sampling_params, len(conversations), "sampling params"))]
        return self._run(requests, use_tqdm)

    def stream(self, prompt: Prompt | list[dict], sampling_params: SamplingParams | None = None
               ) -> Iterator[str]:
        """Yield the text of one completion as it is generated (a prompt, or chat messages);
        leaving early aborts it. Used by `conveyor chat`."""
        params = sampling_params or self.get_default_sampling_params()
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            request = GenerateRequest(id="", messages=prompt, sampling=params, stream=True)
        else:
            request = _request(prompt, params, RequestOptions(), stream=True)
        deltas: list[RequestOutput] = []
        [rid] = self._submit([request], deltas.append)
        try:
            while True:
                self._step()
                for out in deltas:
                    if out.outputs and out.outputs[0].text:
                        yield out.outputs[0].text
                if deltas and deltas[-1].finished:
                    return
                deltas.clear()
        finally:
            self.core.cancel(rid)

    # --- internals ----------------------------------------------------------------------------

    def _send(self, msg) -> None:
        """The in-process channel to the engine: the same encoded messages as the sockets."""
        msg = through_wire(msg)
        if isinstance(msg, AddRequest):
            self._from_engine += self.engine.add(msg)
        elif isinstance(msg, Abort):
            self._from_engine += self.engine.abort(msg.ids, msg.reason)
        else:                                                  # StatsRequest
            self.core.on_stats(self.engine.stats())

    def _submit(self, requests: list[GenerateRequest], deliver) -> list[str]:
        rids = []
        try:
            for r in requests:
                r.id = str(next(self._ids))
                rids.append(self.core.submit(r, deliver))
        except BaseException:
            for rid in rids:
                self.core.cancel(rid)
            raise
        return rids

    def _step(self) -> None:
        outputs, self._from_engine = self._from_engine, []
        if not outputs and not self.engine.has_work():
            raise RuntimeError("the engine went idle with requests unfinished")
        self.core.on_outputs(outputs + self.engine.step())

    def _run(self, requests: list[GenerateRequest], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        rids = self._submit(requests, lambda out: done.__setitem__(out.request_id, out))
        bar = None
        if use_tqdm and len(requests) > 1:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(requests), desc="Processed prompts", dynamic_ncols=True)
        try:
            while len(done) < len(requests):
                self._step()
                if bar is not None:
                    bar.update(len(done) - bar.n)
        finally:
            for rid in rids:
                self.core.cancel(rid)
            if bar is not None:
                bar.close()
        return [done[r.id] for r in requests]


def _request(prompt: Prompt, params: SamplingParams | None, options: RequestOptions,
             stream: bool = False) -> GenerateRequest:
    r = GenerateRequest(id="", sampling=params or SamplingParams(), options=options,
                        stream=stream)
    if isinstance(prompt, str):
        r.prompt = prompt
    elif isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            r.prompt_token_ids = list(prompt["prompt_token_ids"])
        else:
            r.prompt = prompt["prompt"]
    else:
        r.prompt_token_ids = list(prompt)
    return r


def _as_list(prompts) -> list[Prompt]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and isinstance(prompts[0], int):     # one prompt given as token ids
        return [prompts]
    return prompts


def _per_prompt(value, n: int, what: str) -> list:
    """One value for each of n prompts: one given for all, or a sequence of n."""
    if value is None or isinstance(value, (SamplingParams, int, LoRARequest)):
        return [value] * n
    values = list(value)
    if len(values) != n:
        raise ValueError(f"got {len(values)} {what} for {n} prompts")
    return values

