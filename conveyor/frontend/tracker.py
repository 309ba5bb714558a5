"""Frontend-side state of requests: fan-out of n, detokenization, stop strings, outputs.

`add` turns one user request into `n` AddRequests (ids `<id>/<i>`); `process` folds the engine's
TokenOutputs back into RequestOutputs and reports sequences a stop string ended, which the caller
must abort in the engine. Used by the offline LLM and by the frontend processes alike.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import msgspec

from conveyor.frontend.detokenizer import IncrementalDetokenizer
from conveyor.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from conveyor.shared.messages import AddRequest, TokenLogprobs, TokenOutput
from conveyor.shared.sampling_params import INT64_MIN, SamplingParams


@dataclass
class _Sequence:
    detok: IncrementalDetokenizer
    out: CompletionOutput


@dataclass
class _Request:
    output: RequestOutput
    params: SamplingParams
    seqs: list[_Sequence] = field(default_factory=list)


def sub_id(request_id: str, index: int) -> str:
    return f"{request_id}/{index}"


def split_id(seq_id: str) -> tuple[str, int]:
    request_id, _, index = seq_id.rpartition("/")
    return request_id, int(index)


class RequestTracker:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.requests: dict[str, _Request] = {}

    def add(self, request_id: str, prompt: str | None, prompt_ids: list[int],
            params: SamplingParams, priority: int = 0, arrival: float | None = None,
            cache_salt: str | None = None, ttft_slo: float | None = None,
            tpot_slo: float | None = None) -> list[AddRequest]:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        arrival = time.time() if arrival is None else arrival
        out = RequestOutput(request_id, prompt, list(prompt_ids), [],
                            prompt_logprobs=[None] if params.prompt_logprobs is not None else None)
        out.metrics.arrival_time = arrival
        req = _Request(out, params)
        msgs = []
        for i in range(params.n):
            detok = IncrementalDetokenizer(self.tokenizer, prompt_ids, params.skip_special_tokens,
                                           params.stop, params.include_stop_str_in_output)
            comp = CompletionOutput(i, "", [], 0.0 if params.logprobs is not None else None,
                                    [] if params.logprobs is not None else None)
            req.seqs.append(_Sequence(detok, comp))
            out.outputs.append(comp)
            sub = _sub_params(params, i)
            msgs.append(AddRequest(id=sub_id(request_id, i), token_ids=list(prompt_ids),
                                   sampling=sub, priority=priority, arrival=arrival,
                                   cache_salt=cache_salt, ttft_slo=ttft_slo,
                                   tpot_slo=tpot_slo))
        self.requests[request_id] = req
        return msgs

    def process(self, outputs: list[TokenOutput]) -> tuple[list[str], list[str]]:
        """Apply engine outputs. Returns (request ids updated, sequence ids to abort as stopped)."""
        now = time.time()
        updated, stopped = [], []
        for o in outputs:
            request_id, index = split_id(o.id)
            req = self.requests.get(request_id)
            if req is None:
                continue
            seq, metrics = req.seqs[index], req.output.metrics
            if o.prompt_logprobs and req.output.prompt_logprobs is not None:
                req.output.prompt_logprobs.extend(self._logprobs(lp) for lp in o.prompt_logprobs)
            if o.stats is not None and index == 0:
                metrics.first_scheduled_time = o.stats.first_scheduled or None
                metrics.num_cached_tokens = o.stats.num_cached_tokens
                metrics.num_preemptions = o.stats.num_preemptions
            if seq.out.finished:         # ended here by a stop string; the engine catches up
                continue
            if o.new_token_ids and metrics.first_token_time is None:
                metrics.first_token_time = now
            seq.out.token_ids.extend(o.new_token_ids)
            if o.logprobs and seq.out.logprobs is not None:
                for lp in o.logprobs:
                    seq.out.logprobs.append(self._logprobs(lp))
                    seq.out.cumulative_logprob += lp.logprobs[0]
            seq.detok.push(o.new_token_ids)
            if seq.detok.stopped_by is not None:
                seq.out.finish_reason, seq.out.stop_reason = "stop", seq.detok.stopped_by
                stopped.append(o.id)
            elif o.finish_reason is not None:
                seq.detok.flush()
                seq.out.finish_reason, seq.out.stop_reason = o.finish_reason, o.stop_reason
                seq.out.error, seq.out.error_code = o.error, o.error_code
            seq.out.text = seq.detok.text
            if all(s.out.finished for s in req.seqs):
                req.output.finished = True
                metrics.finished_time = now
                metrics.num_output_tokens = sum(len(s.out.token_ids) for s in req.seqs)
            updated.append(request_id)
        return list(dict.fromkeys(updated)), stopped

    def stream_delta(self, request_id: str, index: int) -> str:
        seq = self.requests[request_id].seqs[index]
        return seq.detok.stream(final=seq.out.finished)

    def pop(self, request_id: str) -> RequestOutput:
        return self.requests.pop(request_id).output

    def _logprobs(self, lp: TokenLogprobs) -> PositionLogprobs:
        d: PositionLogprobs = {}
        for i, (tok, value) in enumerate(zip(lp.token_ids, lp.logprobs)):
            if tok not in d:
                rank = lp.rank if i == 0 else i
                text = None if self.tokenizer is None else self.tokenizer.decode([tok])
                d[tok] = Logprob(value, rank, text)
        return d


def _sub_params(params: SamplingParams, index: int) -> SamplingParams:
    """The i-th of n samples: its own seed, and prompt logprobs computed once."""
    changes = {"n": 1}
    if params.seed is not None:   # seed + index, wrapped to stay in 64 bits
        changes["seed"] = (params.seed + index - INT64_MIN) % (1 << 64) + INT64_MIN
    if index > 0:
        changes["prompt_logprobs"] = None
    return msgspec.structs.replace(params, **changes)
