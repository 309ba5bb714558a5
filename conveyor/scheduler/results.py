"""Applying a step's result to the requests it planned (`update`): their tokens, prompt
logprobs and ends (a stop, max_tokens, the length limit), the blocks whose tokens are all known
cached, and with speculative decoding the verified guesses counted and the rejected ones rolled
back (their blocks freed, never cached). A part of the Scheduler class: it reads and changes
the scheduler's requests, blocks and slots (scheduler.py says how plans and results pair up).
"""
from __future__ import annotations

from conveyor.scheduler import prompt_logprobs
from conveyor.scheduler.request import Request, RequestStatus
from conveyor.scheduler.speculation import back_off, next_guesses
from conveyor.scheduler.stop import check_stop
from conveyor.shared.messages.engine import TokenOutput
from conveyor.shared.messages.worker import StepResult

STEP_TIME_EMA = 0.2                          # weight of the latest step in the step time estimate

WAITING, RUNNING, FINISHED = RequestStatus.WAITING, RequestStatus.RUNNING, RequestStatus.FINISHED


class ApplyResults:
    """Scheduler's handling of results (a mixin: the state is the Scheduler's)."""

    def update(self, result: StepResult) -> list[TokenOutput]:
        """Apply the worker's result of the oldest plan in flight; returns one output per request
        that got tokens, prompt logprobs or finished."""
        if not self._in_flight or result.step != self._in_flight[0][0]:
            raise ValueError(f"result for step {result.step} does not match the oldest plan in "
                             f"flight")
        planned = self._in_flight[0][1]
        num_sampling = sum(p.step.sample for p in planned)
        counts = result.num_sampled or [1] * num_sampling
        if (len(counts) != num_sampling or len(result.sampled) != sum(counts)
                or len(result.logprobs) != len(result.sampled)
                or len(result.proposals) not in (0, num_sampling)):
            raise ValueError(f"step {result.step}: {len(result.sampled)} sampled tokens in "
                             f"{len(counts)} runs for {num_sampling} sampling sequences")
        _, _, planned_at = self._in_flight.popleft()
        if result.step == self._solo_step:
            self._solo_step = 0
        took = self._time_step(planned_at)
        spec = self.spec_counts
        spec.propose_s += result.propose_time_s
        self.mask_counts.add(result.mask_rows, result.mask_fill_s, result.mask_wait_s)
        if any(p.step.draft_token_ids for p in planned):
            spec.verify_steps += 1
            spec.verify_s += took
        runs = iter(counts)
        proposals = iter(result.proposals)
        first = 0
        prompt_entries = dict(result.prompt_logprobs)
        outputs = []
        for p in planned:
            req, step = p.req, p.step
            sample = None
            if step.sample:
                n = next(runs)
                sample = (result.sampled[first:first + n], result.logprobs[first:first + n],
                          next(proposals, []))
                first += n
            if req.status is FINISHED:               # aborted, or stopped by an earlier token
                continue
            out = TokenOutput(req.id, [])
            # NOTE: a step planned before its request was preempted still delivers its token
            # (pending, so the request was not readmitted meanwhile) and prompt logprobs; only
            # its blocks are gone.
            current = req.status is RUNNING and req.stats.num_preemptions == p.incarnation
            if current and not step.draft_token_ids:
                # tokens [0, p.end) are all known now: the last one came at the latest from the
                # plan before this one, whose result came first
                self.blocks.cache_full_blocks(req, p.end)
            if step.prompt_logprobs_from >= 0:
                out.prompt_logprobs = prompt_logprobs.take_new(
                    req, step.prompt_logprobs_from, prompt_entries.get(step.slot, [])) or None
            if sample is not None:
                tokens, logprobs, guesses = sample
                req.num_pending_tokens -= 1
                if step.draft_token_ids:
                    self._accepted(req, len(step.draft_token_ids), len(tokens) - 1, current)
                for token, lp in zip(tokens, logprobs):
                    self._add_token(req, token, lp, out)
                    if req.status is FINISHED:      # a stop inside an accepted run
                        break
                if req.status is RUNNING:
                    if current and step.draft_token_ids:
                        self.blocks.cache_full_blocks(req)
                    # NOTE: n-gram lookups cost nothing, so only verifications move the average
                    if step.draft_token_ids or (result.proposals and not self.spec.overlapped):
                        back_off(req, guesses, len(tokens) - 1 if step.draft_token_ids else None)
                    req.spec_token_ids = next_guesses(req, guesses)
            if out.new_token_ids or out.prompt_logprobs or out.finish_reason:
                outputs.append(out)
        if any(p.req.status is FINISHED for p in planned):
            self.running = [r for r in self.running if r.status is RUNNING]
            self.waiting = [r for r in self.waiting if r.status is WAITING]
        return outputs

    def _accepted(self, req: Request, num_guesses: int, num_accepted: int,
                  current: bool) -> None:
        """Count a verification, and roll the progress of `req` back past its rejected
        guesses: their KV is not valid, nor are the blocks that hold only them."""
        self.spec_counts.add(num_guesses, num_accepted)
        req.stats.num_draft_tokens += num_guesses
        req.stats.num_accepted_tokens += num_accepted
        if current:
            req.num_computed_tokens -= num_guesses - num_accepted
            self.blocks.trim(req)

    def _time_step(self, planned_at: float) -> float:
        """Fold the step whose result just came into step_time_s; returns its time. It ran
        from when it was planned or the step before it ended, whichever came later (steps run
        in order)."""
        now = self.clock()
        took = now - max(planned_at, self._last_result)
        self._last_result = now
        self.step_time_s = took if not self.step_time_s else (
            self.step_time_s + STEP_TIME_EMA * (took - self.step_time_s))
        return took

    def _add_token(self, req: Request, token: int, logprobs, out: TokenOutput) -> None:
        req.token_ids.append(token)
        self.num_generated_tokens += 1
        out.new_token_ids.append(token)
        if req.sampling.logprobs is not None and logprobs is not None:
            out.logprobs = (out.logprobs or []) + [logprobs]
        if req.num_output_tokens == 1:
            req.stats.first_token = self.clock()
            out.stats = req.stats
            self.objectives.first_token(req)
        if check_stop(req, self.eos_token_ids, self.max_len):
            self._release(req)
            out.finish_reason, out.stop_reason, out.stats = (
                req.finish_reason, req.stop_reason, req.stats)

    def _release(self, req: Request) -> None:
        """Free what a finished request holds; the caller takes it out of its queue.

        NOTE: a plan in flight may still write KV into the blocks freed here (or by a
        preemption). That is safe: a worker runs plans strictly in order, and the blocks can
        reappear only in a later plan, which runs after it. The slot is likewise freed only by
        the next plan, after the worker ran the ones in flight.
        """
        self.blocks.free(req)
        self._release_slot(req)
        req.status = FINISHED
        del self.requests[req.id]
        self.objectives.ended(req, self.clock())
        if req.finish_reason in ("stop", "length"):
            self.admission.output_len.add(req.num_output_tokens)

    def _release_slot(self, req: Request) -> None:
        if req.slot is not None:
            self.slots.release(req.slot)
            req.slot = None
