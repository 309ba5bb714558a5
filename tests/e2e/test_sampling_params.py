"""Sampling parameters through the whole engine on the default model: each test fails if the
parameter is ignored. (Distribution-level checks of each filter live in tests/unit/test_sampler.py.)
"""
import pytest

from conveyor import LLM, SamplingParams
from conveyor.shared.model_files import default_model_path

pytestmark = pytest.mark.skipif(not default_model_path().is_file(),
                                reason="default model not fetched (make model)")

STORY = [{"role": "user", "content": "Write a short story about a robot who learns to paint."}]


@pytest.fixture(scope="module")
def llm():
    return LLM()


@pytest.fixture(scope="module")
def PROMPT(llm):
    """A chat prompt as token ids: the instruct model answers it at length."""
    from conveyor.frontend.tokenizer import apply_chat_template

    return {"prompt_token_ids": apply_chat_template(llm.tokenizer, STORY)}


def texts(outs):
    return [c.text for o in outs for c in o.outputs]


def test_seed_reproducible_and_distinct(llm, PROMPT):
    p = SamplingParams(temperature=1.0, max_tokens=24, seed=7)
    a = llm.generate([PROMPT], p, use_tqdm=False)[0].outputs[0].token_ids
    # same seed, different batch company and position: same tokens
    b = llm.generate(["Hello there", PROMPT], [SamplingParams(max_tokens=5), p],
                     use_tqdm=False)[1].outputs[0].token_ids
    c = llm.generate([PROMPT], SamplingParams(temperature=1.0, max_tokens=24, seed=8),
                     use_tqdm=False)[0].outputs[0].token_ids
    assert a == b
    assert a != c


def test_n_samples(llm, PROMPT):
    out = llm.generate([PROMPT], SamplingParams(n=3, temperature=1.0, max_tokens=16, seed=1),
                       use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3
    stats = llm.engine.scheduler.stats()
    assert stats.num_free_blocks == stats.num_total_blocks


def test_max_tokens_and_ignore_eos(llm, PROMPT):
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=7), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 7 and out.outputs[0].finish_reason == "length"
    chat = [{"role": "user", "content": "Say hi."}]
    stopped = llm.chat(chat, SamplingParams(temperature=0, max_tokens=200), use_tqdm=False)[0]
    assert stopped.outputs[0].finish_reason == "stop"
    n = len(stopped.outputs[0].token_ids)
    forced = llm.chat(chat, SamplingParams(temperature=0, max_tokens=n + 10, ignore_eos=True),
                      use_tqdm=False)[0]
    assert len(forced.outputs[0].token_ids) == n + 10


def test_min_tokens(llm):
    chat = [{"role": "user", "content": "Say hi."}]
    short = llm.chat(chat, SamplingParams(temperature=0, max_tokens=200), use_tqdm=False)[0]
    n = len(short.outputs[0].token_ids)
    longer = llm.chat(chat, SamplingParams(temperature=0, max_tokens=200, min_tokens=n + 5),
                      use_tqdm=False)[0]
    assert len(longer.outputs[0].token_ids) >= n + 5
    assert llm.tokenizer.eos_token_id not in longer.outputs[0].token_ids[:n + 5]


def test_stop_strings_and_stop_token_ids(llm, PROMPT):
    base = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=40),
                        use_tqdm=False)[0].outputs[0]
    word = base.text.split()[3]
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=40, stop=[word]),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == word
    assert out.text == base.text[:base.text.index(word)]
    kept = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=40, stop=[word],
                                                 include_stop_str_in_output=True),
                        use_tqdm=False)[0].outputs[0]
    assert kept.text.endswith(word)
    tok = base.token_ids[5]
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=40,
                                                stop_token_ids=[tok]), use_tqdm=False)[0]
    comp = out.outputs[0]
    assert comp.finish_reason == "stop" and comp.stop_reason == tok
    assert comp.token_ids == base.token_ids[:base.token_ids.index(tok) + 1]
    stats = llm.engine.scheduler.stats()
    assert stats.num_free_blocks == stats.num_total_blocks


def test_penalties_change_greedy_output(llm, PROMPT):
    base = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)
    for field in ("repetition_penalty", "presence_penalty", "frequency_penalty"):
        value = 1.5 if field == "repetition_penalty" else 1.0
        other = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=40,
                                                      **{field: value}), use_tqdm=False)
        assert texts(other) != texts(base), field


def test_filters_make_sampling_greedy_like(llm, PROMPT):
    greedy = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=16),
                          use_tqdm=False)[0].outputs[0].token_ids
    for kw in (dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0)):
        out = llm.generate([PROMPT], SamplingParams(temperature=1.5, max_tokens=16, seed=3, **kw),
                           use_tqdm=False)[0].outputs[0].token_ids
        assert out == greedy, kw
    loose = llm.generate([PROMPT], SamplingParams(temperature=1.5, max_tokens=16, seed=3),
                         use_tqdm=False)[0].outputs[0].token_ids
    assert loose != greedy


def test_invalid_values_name_the_field(llm):
    for kw, field in [(dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"),
                      (dict(max_tokens=0), "max_tokens"), (dict(n=0), "n"),
                      (dict(min_p=2), "min_p"), (dict(logprobs=99), "logprobs")]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kw)
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate([[10**9]], SamplingParams(), use_tqdm=False)
    with pytest.raises(ValueError, match="unknown engine argument"):
        LLM(max_num_seq=3)
