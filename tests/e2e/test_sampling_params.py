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
def llm(default_llm):
    return default_llm


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
    # same seed, different batch company and position: same tokens; another seed beside it
    outs = llm.generate(["Hello there", PROMPT, PROMPT],
                        [SamplingParams(max_tokens=5), p,
                         SamplingParams(temperature=1.0, max_tokens=24, seed=8)], use_tqdm=False)
    b, c = (o.outputs[0].token_ids for o in outs[1:])
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
    word, tok = base.text.split()[3], base.token_ids[5]
    # one batch: each row stops by its own parameters
    out, kept, comp = (o.outputs[0] for o in llm.generate([PROMPT] * 3, [
        SamplingParams(temperature=0, max_tokens=40, stop=[word]),
        SamplingParams(temperature=0, max_tokens=40, stop=[word], include_stop_str_in_output=True),
        SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[tok])], use_tqdm=False))
    assert out.finish_reason == "stop" and out.stop_reason == word
    assert out.text == base.text[:base.text.index(word)]
    assert kept.text.endswith(word)
    assert comp.finish_reason == "stop" and comp.stop_reason == tok
    assert comp.token_ids == base.token_ids[:base.token_ids.index(tok) + 1]
    # the stop token is not in the text (as in vLLM); include_stop_str_in_output keeps it, and
    # the EOS token's text (kept special tokens) goes the same way
    assert comp.text == llm.tokenizer.decode(comp.token_ids[:-1])
    chat = [[{"role": "user", "content": "Say hi"}]] * 2
    eos, eos_kept = (o.outputs[0] for o in llm.chat(chat, [
        SamplingParams(temperature=0, max_tokens=100, skip_special_tokens=False),
        SamplingParams(temperature=0, max_tokens=100, skip_special_tokens=False,
                       include_stop_str_in_output=True)], use_tqdm=False))
    assert eos.finish_reason == "stop" and eos.token_ids[-1] == llm.tokenizer.eos_token_id
    assert eos.text == eos_kept.text.removesuffix(llm.tokenizer.eos_token) != eos_kept.text
    tok_kept = llm.generate([PROMPT], SamplingParams(
        temperature=0, max_tokens=40, stop_token_ids=[tok], include_stop_str_in_output=True),
        use_tqdm=False)[0].outputs[0]
    assert tok_kept.text == llm.tokenizer.decode(comp.token_ids)
    stats = llm.engine.scheduler.stats()
    assert stats.num_free_blocks == stats.num_total_blocks


def test_bad_words_are_never_generated(llm, PROMPT):
    """The greedy story names its robot; with bad_words ["robot", "AI"] neither word's tokens
    (alone or after a space) appear, and the rest of the output is still the model's."""
    from conveyor.frontend.prepare import bad_word_ids

    p = dict(temperature=0, max_tokens=60)
    free = llm.generate([PROMPT], SamplingParams(**p), use_tqdm=False)[0].outputs[0]
    held = llm.generate([PROMPT], SamplingParams(**p, bad_words=["robot", "AI"]),
                        use_tqdm=False)[0].outputs[0]
    banned = bad_word_ids(llm.tokenizer, ["robot", "AI"])
    assert any(_contains(free.token_ids, ids) for ids in banned)
    assert not any(_contains(held.token_ids, ids) for ids in banned)
    assert held.text[:6] == free.text[:6]


def _contains(tokens: list[int], ids: list[int]) -> bool:
    return any(tokens[i:i + len(ids)] == ids for i in range(len(tokens)))


def test_penalties_change_greedy_output(llm, PROMPT):
    """One batch: the plain greedy row and one row per penalty."""
    fields = ("repetition_penalty", "presence_penalty", "frequency_penalty")
    params = [SamplingParams(temperature=0, max_tokens=40)] + [
        SamplingParams(temperature=0, max_tokens=40,
                       **{f: 1.5 if f == "repetition_penalty" else 1.0}) for f in fields]
    base, *others = llm.generate([PROMPT] * len(params), params, use_tqdm=False)
    for field, other in zip(fields, others):
        assert texts([other]) != texts([base]), field


def test_filters_make_sampling_greedy_like(llm, PROMPT):
    """One batch: a greedy row, a row per filter, and the same sampling without a filter."""
    filters = (dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0))
    params = [SamplingParams(temperature=0, max_tokens=16)] + [
        SamplingParams(temperature=1.5, max_tokens=16, seed=3, **kw) for kw in (*filters, {})]
    greedy, *filtered, loose = (o.outputs[0].token_ids for o in llm.generate(
        [PROMPT] * len(params), params, use_tqdm=False))
    for kw, out in zip(filters, filtered):
        assert out == greedy, kw
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
