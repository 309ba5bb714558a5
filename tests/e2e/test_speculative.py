"""Speculative decoding end to end on tiny random models: greedy outputs and logprobs are those
of the engine without it, whatever the batching (chunked prefill, preemption, async scheduling,
the batch-size cutoff, stops), and sampled tokens keep their distribution (chi-square)."""
import pytest
import torch
from models_util import make_tiny_model
from test_engine_tiny import assert_same_outputs

from conveyor import LLM, SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}
NEW = 16


def prompts(vocab: int = 256) -> list[list[int]]:
    """Prompts with repeats (n-gram lookup finds guesses) and without."""
    g = torch.Generator().manual_seed(0)
    rand = lambda n: torch.randint(3, vocab, (n,), generator=g).tolist()
    motif = rand(5)
    return [motif * 4 + motif[:2], rand(7), rand(3) + motif * 3, rand(19), motif[:3]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("llama"))


def make_llm(path, **kw) -> LLM:
    return LLM(str(path), skip_tokenizer_init=True, block_size=kw.pop("block_size", 4), **kw)


def assert_clean(llm: LLM) -> None:
    s = llm.engine.scheduler
    stats = s.stats()
    assert stats.num_free_blocks == stats.num_total_blocks and stats.num_running == 0
    s.check_integrity()


GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, logprobs=3)
SCENARIOS = {
    "plain": (dict(), GREEDY),
    "sync": (dict(async_scheduling=False), GREEDY),
    "chunked-prefill": (dict(max_num_batched_tokens=8), GREEDY),
    "preemption": (dict(num_kv_blocks=16, max_num_batched_tokens=16), GREEDY),
    "max-num-seqs": (dict(max_num_seqs=2), GREEDY),
    "no-prefix-cache": (dict(enable_prefix_caching=False), GREEDY),
    "penalties-min-tokens": (dict(), SamplingParams(
        temperature=0, max_tokens=NEW, logprobs=2, repetition_penalty=1.02,
        frequency_penalty=0.02, presence_penalty=0.01, min_tokens=6,
        stop_token_ids=list(range(3, 256, 5)))),
    # half the vocabulary banned, some tokens pushed: a guess the bias forbids is rejected
    "logit-bias": (dict(), SamplingParams(
        temperature=0, max_tokens=NEW, logprobs=2, ignore_eos=True,
        logit_bias={**{t: -100.0 for t in range(0, 256, 2)},
                    **{t: 2.0 for t in range(1, 64, 4)}})),
    # a third of the vocabulary allowed (vLLM's allowed_token_ids)
    "allowed-ids": (dict(), SamplingParams(temperature=0, max_tokens=NEW, logprobs=2,
                                           ignore_eos=True,
                                           allowed_token_ids=list(range(1, 256, 3)))),
    "max-tokens-5": (dict(), SamplingParams(temperature=0, max_tokens=5, logprobs=1)),
    "tiny-budget": (dict(max_num_batched_tokens=3), GREEDY),
    "prompt-logprobs": (dict(max_num_batched_tokens=16),
                        SamplingParams(temperature=0, max_tokens=6, prompt_logprobs=2)),
}


class OracleProposer:
    """Guesses from known outputs (each prompt's reference tokens), every third call's with a
    wrong one at a depth that moves and at the end (which a guess list the scheduler verifies
    after its first keeps): a proposer whose guesses are mostly accepted, with rejections at
    every depth."""

    def __init__(self, reference, k: int = 3):
        self.k = k
        self.outputs = {tuple(o.prompt_token_ids): o.outputs[0].token_ids for o in reference}
        self.calls = 0

    def propose(self, slots, states):
        guesses = []
        for s in states:
            done = s.token_ids[s.prompt_len:]
            ref = self.outputs[tuple(s.token_ids[:s.prompt_len])]
            g = list(ref[len(done):len(done) + self.k]) if ref[:len(done)] == done else []
            self.calls += 1
            if g and self.calls % 3 == 0:
                for i in {self.calls % len(g), len(g) - 1}:
                    g[i] = (g[i] + 1) % 256
            guesses.append(g)
        return guesses


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_greedy_outputs_and_logprobs_unchanged(tiny, scenario):
    engine_args, params = SCENARIOS[scenario]
    reference = make_llm(tiny, **engine_args).generate(prompts(), params, use_tqdm=False)
    for proposer in ("oracle", "ngram") if scenario in ("plain", "preemption") else ("oracle",):
        llm = make_llm(tiny, speculative_config=NGRAM, **engine_args)
        if proposer == "oracle":
            llm.runner.draw.proposer = OracleProposer(reference)
        outs = llm.generate(prompts(), params, use_tqdm=False)
        assert_same_outputs(reference, outs, tol=1e-4)
        stats = llm.engine.scheduler.stats()
        assert stats.spec_num_draft_tokens > 0
        assert sum(o.metrics.num_draft_tokens for o in outs) == stats.spec_num_draft_tokens
        assert sum(o.metrics.num_accepted_tokens for o in outs) == \
            stats.spec_num_accepted_tokens
        if proposer == "oracle" and params.max_tokens == NEW:
            assert stats.spec_num_draft_tokens > stats.spec_num_accepted_tokens >= 10
        if scenario == "preemption":
            assert stats.num_preemptions > 0
        assert_clean(llm)


def test_bad_words_are_judged_with_the_guesses_before_them(tiny):
    """Two-token bad words taken from the free greedy outputs (so they bite), and one-token
    ones: a guess row after the first is banned as its guesses before it make the output, so
    the tokens equal those without speculation."""
    free = make_llm(tiny).generate(prompts(), GREEDY, use_tqdm=False)
    pairs = [list(o.outputs[0].token_ids[i:i + 2]) for o in free for i in (2, 6, 10)]
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, logprobs=2,
                            bad_words_token_ids=pairs + [[t] for t in range(5, 256, 31)])
    reference = make_llm(tiny).generate(prompts(), params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in reference] != [o.outputs[0].token_ids for o in free]
    llm = make_llm(tiny, speculative_config=NGRAM)
    llm.runner.draw.proposer = OracleProposer(reference)
    assert_same_outputs(reference, llm.generate(prompts(), params, use_tqdm=False), tol=1e-4)
    assert llm.engine.scheduler.stats().spec_num_accepted_tokens >= 10
    assert_clean(llm)


def test_single_sequences_and_the_batch_size_cutoff(tiny):
    reference = make_llm(tiny).generate(prompts(), GREEDY, use_tqdm=False)
    # one at a time: each request speculates alone
    llm = make_llm(tiny, speculative_config=NGRAM)
    llm.runner.draw.proposer = OracleProposer(reference)
    single = [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in prompts()]
    assert_same_outputs(reference, single, tol=1e-4)
    # 5 running: no speculation (overlapped steps) until fewer than 3 run
    llm = make_llm(tiny, speculative_config={**NGRAM, "disable_by_batch_size": 3},
                   max_num_seqs=5)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=3)
              for n in (4, 6, 8, 10, 16)]
    llm.runner.draw.proposer = OracleProposer(reference)
    outs = llm.generate(prompts(), params, use_tqdm=False)
    plain = make_llm(tiny).generate(prompts(), params, use_tqdm=False)
    assert_same_outputs(plain, outs, tol=1e-4)
    assert llm.engine.scheduler.stats().spec_num_draft_tokens > 0
    assert_clean(llm)


def test_stops_inside_an_accepted_run(tiny):
    reference = make_llm(tiny).generate(prompts(), GREEDY, use_tqdm=False)
    # each prompt stops on a token of its own output (which its guesses may carry past)
    for k in (2, 6, 9):
        stop = SamplingParams(temperature=0, max_tokens=NEW, logprobs=1,
                              stop_token_ids=[o.outputs[0].token_ids[k] for o in reference])
        plain = make_llm(tiny).generate(prompts(), stop, use_tqdm=False)
        llm = make_llm(tiny, speculative_config=NGRAM)
        llm.runner.draw.proposer = OracleProposer(reference)
        assert_same_outputs(plain, llm.generate(prompts(), stop, use_tqdm=False), tol=1e-4)
        assert_clean(llm)


def test_sampled_tokens_keep_their_distribution(tmp_path, monkeypatch):
    """n-gram guesses on a vocabulary of 8: point masses q, accepted with probability p. Every
    guess at hand is verified (SPEC_COST 0: the rule of when guesses pay is not under test),
    and eight tokens leave room for verifications after the first, which overlaps a decode."""
    from conveyor.scheduler import speculation

    monkeypatch.setattr(speculation, "SPEC_COST", 0.0)
    path = make_tiny_model("llama", tmp_path / "m", **SMALL_VOCAB)
    assert_same_distribution(path, {**NGRAM, "num_speculative_tokens": 2}, max_tokens=8)


SMALL_VOCAB = dict(vocab_size=8, bos_token_id=0, eos_token_id=1, initializer_range=0.5)


def assert_same_distribution(path, spec, n: int = 2000, max_tokens: int = 4) -> None:
    """Continuations of a repetitive prompt, n samples with speculation (`spec`) and without:
    guesses often accepted and often rejected, the same frequencies of each position's token
    and of the first two (chi-square)."""
    from scipy.stats import chi2_contingency

    prompt = [3, 4, 5, 3, 4, 5, 3, 4]
    params = SamplingParams(n=n, temperature=0.9, top_p=0.95, top_k=6, min_p=0.02,
                            repetition_penalty=1.2, max_tokens=max_tokens, ignore_eos=True,
                            logit_bias={2: 1.0, 6: -1.0})
    samples = []
    # every sample runs at once: lift the default batch size past which speculation stops
    for config in (None, {**spec, "disable_by_batch_size": 512}):
        llm = make_llm(path, speculative_config=config, max_num_seqs=256, seed=11)
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        samples.append([tuple(c.token_ids) for c in out.outputs])
        if config is not None:
            stats = llm.engine.scheduler.stats()
            assert stats.spec_num_accepted_tokens > n // 10
            assert stats.spec_num_draft_tokens - stats.spec_num_accepted_tokens > n // 10
        assert_clean(llm)
    for key in [lambda t, i=i: t[i] for i in range(max_tokens)] + [lambda t: t[:2]]:
        cells = sorted({key(t) for run in samples for t in run})
        table = [[sum(key(t) == c for t in run) for c in cells] for run in samples]
        kept = [i for i in range(len(cells)) if table[0][i] + table[1][i] >= 10]
        table = [[row[i] for i in kept] for row in table]
        assert chi2_contingency(table).pvalue > 1e-3, table


@pytest.mark.slow
def test_served_with_tp2_matches_tp1(tmp_path):
    """`conveyor serve --tp 2 --speculative-config ...` (gloo): rank 0 verifies, every rank
    appends its tokens and rolls back alike; greedy tokens equal the in-process TP=1 engine's."""
    from serve_util import served_outputs
    from test_tp_cpu import ENGINE, GREEDY, PROMPTS, SHAPE

    path = str(make_tiny_model("llama", tmp_path / "llama", **SHAPE))
    llm = LLM(model=path, skip_tokenizer_init=True, **ENGINE)
    reference = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}'
    got = served_outputs(PROMPTS, GREEDY, "--model", path, "--tp", "2", "--skip-tokenizer-init",
                         "--speculative-config", spec, "--device", "cpu")
    assert [o.token_ids for o in got] == reference


def assert_same_on_the_gpu(path, spec, enforce_eager: bool, oracle: bool = False):
    """Greedy tokens with speculation on a GPU equal those without by STYLE.md's top-5 rule
    (bf16: the GPU attention kernels take 16-bit floats, and a verify step sums in another
    order than a decode step); returns the speculating engine. `oracle`: guesses from the
    reference's tokens (OracleProposer), so that many are verified and accepted."""
    from serve_util import assert_top5_close

    kw = dict(device="cuda", dtype="bfloat16", enforce_eager=enforce_eager)
    top5 = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, logprobs=5)
    reference = make_llm(path, **kw).generate(prompts(), top5, use_tqdm=False)
    llm = make_llm(path, speculative_config=spec, **kw)
    if oracle:
        llm.runner.draw.proposer = OracleProposer(reference)
    outs = llm.generate(prompts(), top5, use_tqdm=False)
    assert_top5_close([o.outputs[0] for o in reference], [o.outputs[0] for o in outs])
    assert llm.engine.scheduler.stats().spec_num_accepted_tokens > 0
    assert_clean(llm)
    return llm


@pytest.mark.gpu
@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_ngram_on_the_gpu(tiny, enforce_eager):
    """Verify steps through the Triton kernels, eagerly and from the mixed CUDA graphs, the
    first of a run taking the token of the decode before it on the device."""
    assert_same_on_the_gpu(tiny, NGRAM, enforce_eager, oracle=True)
