"""Speculative decoding on the default model (SmolLM2-135M-Instruct, GGUF): greedy outputs and
logprobs are those without it, alone and batched; several tokens of one step reach the
frontend at once, and those after a stop string are dropped."""
import re

import msgspec
import pytest
import torch

from conveyor import LLM, SamplingParams
from conveyor.frontend.core import READY, FrontendCore
from conveyor.shared.messages.client import GenerateRequest
from conveyor.shared.messages.engine import Abort, TokenLogprobs, TokenOutput
from conveyor.shared.model_files import default_model_path

pytestmark = pytest.mark.skipif(not default_model_path().is_file(),
                                reason="default model not fetched (make model)")

TEXT = ("The committee met on Tuesday to review the budget. It approved the new library, "
        "delayed the road repairs, and asked for a report on the water supply.")
PROMPTS = [f"Rewrite this text exactly, word for word:\n{TEXT}\nRewritten:\n",
           "1, 2, 3, 4, 5, 6,"]
PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
# float32 on the CPU: the same sums either way, so the same logprobs. bfloat16 on a GPU: a
# verify step's attention and GEMM tiles differ from a decode step's, and a logit of 16-32 is a
# multiple of 0.125 in bf16 (32-64: 0.25), so its row may round a step or two apart (0.25 seen
# on a rank-2 logprob on an H200): there STYLE.md's rule, the same tokens, and each drawn
# token's logprob near the other's
ON_GPU = torch.cuda.is_available()
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
         "prompt_lookup_max": 4}


@pytest.fixture(scope="module")
def llm():
    return LLM(speculative_config=NGRAM)


def test_greedy_outputs_and_logprobs_unchanged(llm, default_llm):
    reference = default_llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    before = llm.engine.scheduler.stats()
    batched = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    single = llm.generate(PROMPTS[:1], PARAMS, use_tqdm=False)
    for ref, out in zip(reference + reference[:1], batched + single):
        a, b = ref.outputs[0], out.outputs[0]
        assert b.token_ids == a.token_ids and b.text == a.text
        for token, pa, pb in zip(a.token_ids, a.logprobs, b.logprobs):
            if ON_GPU:
                assert abs(pa[token].logprob - pb[token].logprob) < 0.5, (pa, pb)
            else:
                assert set(pa) == set(pb)
                assert all(abs(pa[t].logprob - pb[t].logprob) < 1e-4 for t in pa), (pa, pb)
    stats = llm.engine.scheduler.stats()
    accepted = stats.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    drafted = stats.spec_num_draft_tokens - before.spec_num_draft_tokens
    # the rewrite copies its input: most guesses are accepted
    assert accepted > 0.5 * drafted > 5
    assert batched[0].metrics.num_accepted_tokens > 10
    llm.engine.scheduler.check_integrity()


def test_tokens_after_a_stop_string_in_one_output_are_dropped():
    from conveyor.frontend.tokenizer import load_tokenizer
    from conveyor.shared.model_files import resolve_model

    tok = load_tokenizer(resolve_model(None))
    sent, got = [], []
    core = FrontendCore(tok, len(tok), 2048, "f-", sent.append, state=READY)
    params = SamplingParams(max_tokens=50, stop=["brown"], logprobs=0)
    rid = core.submit(GenerateRequest(id="a", prompt="Say:", sampling=params), got.append)
    ids = tok.encode(" the quick brown fox jumps", add_special_tokens=False)
    lps = [TokenLogprobs([t], [-0.5], 1) for t in ids]
    core.on_outputs([TokenOutput(f"{rid}/0", ids[:1], logprobs=lps[:1]),
                     TokenOutput(f"{rid}/0", ids[1:], logprobs=lps[1:])])
    [out] = got
    c = out.outputs[0]
    stop_at = next(i for i in range(len(ids)) if "brown" in tok.decode(ids[:i + 1]))
    assert c.finish_reason == "stop" and c.text == " the quick "
    assert c.token_ids == ids[:stop_at + 1] and len(c.logprobs) == stop_at + 1
    assert isinstance(sent[-1], Abort)


def test_a_constrained_request_among_speculating_ones_keeps_its_grammar(llm):
    """A JSON request batched with rewrites that verify guesses: its row in a verify step is
    masked and its matcher follows every token, so the output still parses and fits the schema,
    while the others still speculate."""
    import json

    import jsonschema

    from conveyor.shared.structured_outputs import StructuredOutputs

    schema = {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "rooms": {"type": "array", "items": {"type": "integer"}, "maxItems": 3}},
        "required": ["city", "rooms"], "additionalProperties": False}
    free = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    constrained = SamplingParams(temperature=0.8, seed=3, max_tokens=60,
                                 structured_outputs=StructuredOutputs(json=schema))
    before = llm.engine.scheduler.stats().spec_num_accepted_tokens
    outs = llm.generate([PROMPTS[0], "Describe a hotel as JSON:", PROMPTS[0]],
                        [free, constrained, free], use_tqdm=False)
    jsonschema.validate(json.loads(outs[1].outputs[0].text), schema)
    assert outs[1].outputs[0].finish_reason == "stop"
    assert llm.engine.scheduler.stats().spec_num_accepted_tokens - before > 10
    llm.engine.scheduler.check_integrity()


def test_constrained_requests_speculate_and_keep_their_greedy_outputs(llm, default_llm):
    """A JSON request that copies JSON from its prompt verifies n-gram guesses (each guessed
    row masked after the guesses before it) and gives the tokens it gives without speculation;
    so do a regex one, whose guesses the grammar refuses part-way, and ones whose constraint
    starts after a token sequence (a thought: its guesses may cross the start), that sequence
    perhaps after an optional opening (taken, or left: held from the first token)."""
    from conveyor.shared.structured_outputs import StructuredOutputs

    schema = {"type": "object", "properties": {
        "city": {"type": "string"}, "rooms": {"type": "array", "items": {"type": "integer"}}},
        "required": ["city", "rooms"], "additionalProperties": False}
    data = '{"city": "Paris", "rooms": [12, 14, 15, 21]}'
    prompts = [f"Copy this JSON exactly:\n{data}\n{data}\nCopy:\n",
               f"Copy this text exactly:\n{TEXT}\nCopy:\n"]
    sentences = StructuredOutputs(regex=r"The [a-z ]+\.( [A-Z][a-z ,]+\.)*")
    params = [SamplingParams(temperature=0, max_tokens=40,
                             structured_outputs=StructuredOutputs(json=schema)),
              SamplingParams(temperature=0, max_tokens=30, structured_outputs=sentences)]
    # a constraint that starts after a sequence (a reasoning model's end of thought): free
    # tokens first, copied from the prompt, then the grammar
    after = llm.tokenizer.encode(" budget.", add_special_tokens=False)
    later = StructuredOutputs(regex=r" [0-9]+ [a-z]+\.", start_after=after)
    opened = msgspec.structs.replace(
        later, thought_open=llm.tokenizer.encode("The committee", add_special_tokens=False))
    # "The" is the opening's and the grammar's: the copy leaves the opening at " committee"
    left = StructuredOutputs(regex=r"The [a-z ]+\.", start_after=after,
                             thought_open=llm.tokenizer.encode("The meeting",
                                                               add_special_tokens=False))
    for so in (later, opened, left):
        prompts.append(prompts[1])
        params.append(SamplingParams(temperature=0, max_tokens=30, structured_outputs=so))
    want = default_llm.generate(prompts, params, use_tqdm=False)
    got = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(want, got):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
    assert got[0].outputs[0].text.startswith('{"city": "Paris"')
    assert got[0].metrics.num_accepted_tokens > 5
    assert got[1].metrics.num_draft_tokens > 0
    assert " budget." in got[2].outputs[0].text
    thought = got[3].outputs[0].text
    assert thought.startswith("The committee") and " budget." in thought
    assert got[2].metrics.num_draft_tokens > 0 and got[3].metrics.num_draft_tokens > 0
    held = got[4].outputs[0].text
    assert held.startswith("The committee") and re.fullmatch(r"The [a-z ]+\.", held), held
    llm.engine.scheduler.check_integrity()


def test_a_draft_models_guesses_for_constrained_requests(default_llm):
    """The default model drafting with its first 8 layers guesses without the grammar: guessed
    tokens it refuses are rejected at their masked rows, so greedy outputs are those without
    speculation and a sampled one still fits its schema."""
    import json

    import jsonschema

    from conveyor.shared.structured_outputs import StructuredOutputs

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    so = StructuredOutputs(json=schema)
    prompts = ["Describe a person as JSON:", f"Copy this text exactly:\n{TEXT}\nCopy:\n"]
    greedy = [SamplingParams(temperature=0, max_tokens=30, structured_outputs=so),
              SamplingParams(temperature=0, max_tokens=20,
                             structured_outputs=StructuredOutputs(regex=r"The [a-z ]+\.?"))]
    llm = LLM(speculative_config={"method": "draft_model", "draft_num_layers": 8,
                                  "num_speculative_tokens": 3})
    want = default_llm.generate(prompts, greedy, use_tqdm=False)
    got = llm.generate(prompts, greedy, use_tqdm=False)
    for a, b in zip(want, got):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
    assert all(o.metrics.num_draft_tokens > 0 for o in got)
    sampled = SamplingParams(temperature=1.0, seed=7, max_tokens=60, structured_outputs=so)
    out = llm.generate(["Describe a person as JSON:"], sampled, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop"
    jsonschema.validate(json.loads(out.text), schema)
    llm.engine.scheduler.check_integrity()
