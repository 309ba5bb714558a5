"""Draft-model speculation end to end on tiny random Llamas: greedy outputs and logprobs are
those of the engine without it (a draft that is the target itself, whose guesses are nearly all
accepted; its first layer only; a separate smaller model), batched, mixed with steps that do not
speculate, under preemption; sampled tokens keep their distribution; a draft that numbers tokens
otherwise is refused; the block manager is clean after every run."""
import json

import pytest
from models_util import make_tiny_model
from test_engine_tiny import assert_same_outputs
from test_speculative import (
    GREEDY,
    SCENARIOS,
    SMALL_VOCAB,
    assert_clean,
    assert_same_distribution,
    assert_same_on_the_gpu,
    make_llm,
    prompts,
)

from conveyor import LLM, SamplingParams

SELF = {"method": "draft_model", "draft_num_layers": 2, "num_speculative_tokens": 3}
FIRST_LAYER = {**SELF, "draft_num_layers": 1}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("llama"))


def run(path, spec, params=GREEDY, **engine_args):
    llm = make_llm(path, speculative_config=spec, **engine_args)
    outs = llm.generate(prompts(), params, use_tqdm=False)
    stats = llm.engine.scheduler.stats()
    assert_clean(llm)
    return outs, stats


@pytest.mark.parametrize("scenario", ["plain", "sync", "chunked-prefill", "preemption",
                                      "max-num-seqs", "penalties-min-tokens",
                                      "logit-bias", "allowed-ids", "prompt-logprobs"])
def test_greedy_outputs_and_logprobs_unchanged(tiny, scenario):
    engine_args, params = SCENARIOS[scenario]
    reference = make_llm(tiny, **engine_args).generate(prompts(), params, use_tqdm=False)
    outs, stats = run(tiny, SELF, params, **engine_args)
    assert_same_outputs(reference, outs, tol=1e-4)
    assert stats.spec_num_draft_tokens > 0
    if scenario == "preemption":
        assert stats.num_preemptions > 0
    if scenario not in ("penalties-min-tokens", "logit-bias", "allowed-ids"):   # not drafted
        # the target drafting for itself: its guesses are its own greedy tokens
        assert stats.spec_num_accepted_tokens >= 0.95 * stats.spec_num_draft_tokens
    if scenario in ("plain", "preemption", "penalties-min-tokens"):
        outs, stats = run(tiny, FIRST_LAYER, params, **engine_args)
        assert_same_outputs(reference, outs, tol=1e-4)
        assert stats.spec_num_draft_tokens > stats.spec_num_accepted_tokens > 0


def test_a_separate_smaller_draft(tiny, tmp_path):
    """A one-layer model of the same shape and other weights: few guesses accepted, the same
    outputs; with a batch-size cutoff some steps speculate and some do not (the draft still
    runs beside each, so its KV stays whole)."""
    draft = make_tiny_model("llama", tmp_path / "draft", seed=1, num_hidden_layers=1)
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 4}
    reference = make_llm(tiny).generate(prompts(), GREEDY, use_tqdm=False)
    outs, stats = run(tiny, spec)
    assert_same_outputs(reference, outs, tol=1e-4)
    assert stats.spec_num_draft_tokens > stats.spec_num_accepted_tokens
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=3)
              for n in (4, 6, 12, 14, 16)]
    plain = make_llm(tiny).generate(prompts(), params, use_tqdm=False)
    outs, stats = run(tiny, {**SELF, "disable_by_batch_size": 3}, params, max_num_seqs=5)
    assert_same_outputs(plain, outs, tol=1e-4)
    assert stats.spec_num_accepted_tokens >= 0.95 * stats.spec_num_draft_tokens > 0


def test_one_at_a_time_and_a_prefix_cache_hit(tiny):
    """Requests one after another share their prompts' blocks: the draft's KV in a cached block
    was written with the target's, so the guesses stay right after a hit."""
    reference = make_llm(tiny).generate(prompts(), GREEDY, use_tqdm=False)
    llm = make_llm(tiny, speculative_config=SELF)
    for _ in range(2):
        single = [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in prompts()]
        assert_same_outputs(reference, single, tol=1e-4)
    stats = llm.engine.scheduler.stats()
    assert stats.prefix_cache_hits > 0
    assert stats.spec_num_accepted_tokens >= 0.95 * stats.spec_num_draft_tokens > 0
    assert_clean(llm)


def test_sampled_tokens_keep_their_distribution(tmp_path):
    """A one-layer draft of the 8-token model: q differs from p, so accepted guesses, rejected
    ones and draws from the residual max(0, p - q) all come often. 1,000 samples: every
    sequence guesses, so the CPU's attention runs a verify query per sequence each step."""
    path = make_tiny_model("llama", tmp_path / "m", **SMALL_VOCAB)
    assert_same_distribution(path, {**FIRST_LAYER, "num_speculative_tokens": 2}, n=1000)


def _tokenizer(folder, tokens: list[str]) -> None:
    (folder / "tokenizer.json").write_text(json.dumps(
        {"model": {"type": "BPE", "vocab": {t: i for i, t in enumerate(tokens)}},
         "added_tokens": []}))


def test_a_draft_with_another_vocabulary_is_refused(tiny, tmp_path):
    spec = lambda path: {"method": "draft_model", "model": str(path),
                         "num_speculative_tokens": 2}
    smaller = make_tiny_model("llama", tmp_path / "v250", vocab_size=250, weights=False)
    with pytest.raises(ValueError, match="vocabulary of 250 tokens, the target 256"):
        make_llm(tiny, speculative_config=spec(smaller), load_format="dummy")
    # with tokenizers: their token lists decide, whatever the logits' widths
    target = make_tiny_model("llama", tmp_path / "t", weights=False)
    other = make_tiny_model("llama", tmp_path / "o", weights=False, vocab_size=260)
    tokens = [f"t{i}" for i in range(256)]
    _tokenizer(target, tokens)
    _tokenizer(other, tokens[:7] + ["x"] + tokens[8:])
    with pytest.raises(ValueError, match="another tokenizer.*id 7: 'x' against 't7'"):
        make_llm(target, speculative_config=spec(other), load_format="dummy")
    _tokenizer(other, tokens)          # same tokens, a padded head: the draft's logits are cut
    llm = make_llm(target, speculative_config=spec(other), load_format="dummy")
    reference = make_llm(target, load_format="dummy").generate(prompts(), GREEDY,
                                                               use_tqdm=False)
    assert_same_outputs(reference, llm.generate(prompts(), GREEDY, use_tqdm=False), tol=1e-4)
    with pytest.raises(ValueError, match="draft_num_layers must be at most"):
        LLM(str(tiny), skip_tokenizer_init=True,
            speculative_config={**SELF, "draft_num_layers": 3})


@pytest.mark.slow
def test_served_with_tp2_matches_tp1(tmp_path):
    """`conveyor serve --tp 2` with a draft of the target's first layer (gloo): the draft is
    sharded like the target, every rank runs it and rank 0 draws; greedy tokens equal TP=1's."""
    from serve_util import served_outputs
    from test_tp_cpu import ENGINE, PROMPTS, SHAPE
    from test_tp_cpu import GREEDY as TP_GREEDY

    path = str(make_tiny_model("llama", tmp_path / "llama", **SHAPE))
    llm = LLM(model=path, skip_tokenizer_init=True, **ENGINE)
    reference = [o.outputs[0].token_ids
                 for o in llm.generate(PROMPTS, TP_GREEDY, use_tqdm=False)]
    got = served_outputs(PROMPTS, TP_GREEDY, "--model", path, "--tp", "2",
                         "--skip-tokenizer-init", "--speculative-config", json.dumps(FIRST_LAYER),
                         "--device", "cpu")
    assert [o.token_ids for o in got] == reference


@pytest.mark.slow
def test_a_draft_replicated_on_one_rank_at_tp2(tmp_path):
    """draft_tensor_parallel_size 1 at --tp 2 (gloo): rank 0 holds the whole draft and guesses
    alone. The target drafting for itself (its heads would split too) has nearly every guess
    accepted, so rank 0's guesses verify on both ranks; a draft of 3 heads, which does not
    split over 2 ranks, is refused without the option and gives TP 1's tokens with it."""
    from serve_util import start_server
    from test_tp_cpu import ENGINE, PROMPTS, SHAPE
    from test_tp_cpu import GREEDY as TP_GREEDY

    from conveyor.client import Client

    path = str(make_tiny_model("llama", tmp_path / "llama", **SHAPE))
    reference = [o.outputs[0].token_ids
                 for o in LLM(model=path, skip_tokenizer_init=True, **ENGINE).generate(
                     PROMPTS, TP_GREEDY, use_tqdm=False)]
    odd = make_tiny_model("llama", tmp_path / "odd", seed=1, num_hidden_layers=1, hidden_size=24,
                          head_dim=8, num_attention_heads=3, num_key_value_heads=1,
                          intermediate_size=48, vocab_size=SHAPE["vocab_size"])
    whole = {"method": "draft_model", "num_speculative_tokens": 3,
             "draft_tensor_parallel_size": 1}
    def serve(spec):
        return start_server("--model", path, "--tp", "2", "--device", "cpu", "--port", "-1",
                            "--skip-tokenizer-init", "--speculative-config", json.dumps(spec))

    sharded = {**whole, "model": str(odd)}
    del sharded["draft_tensor_parallel_size"]
    with pytest.raises(RuntimeError, match="draft_tensor_parallel_size 1 runs it whole"):
        serve(sharded).kill_all()
    for spec, accepted in (({**whole, "draft_num_layers": 2}, 0.95),
                           ({**whole, "model": str(odd)}, 0.0)):
        server = serve(spec)
        try:
            with Client(server.addresses[0], timeout=60) as client:
                got = [r.outputs[0].token_ids for r in client.generate(PROMPTS, TP_GREEDY)]
                stats = client.stats()
        finally:
            server.kill_all()
        assert got == reference, spec
        assert stats.spec_num_draft_tokens > 0
        assert stats.spec_num_accepted_tokens >= accepted * stats.spec_num_draft_tokens


@pytest.mark.gpu
@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
@pytest.mark.parametrize("spec", [SELF, FIRST_LAYER], ids=["self", "first-layer"])
def test_the_draft_on_the_gpu(tiny, spec, enforce_eager):
    """On a GPU the draft runs from its own CUDA graphs (beside the target's mixed and decode
    graphs, and its k decode steps), or eagerly: greedy tokens match the engine's without
    speculation, and the target drafting for itself has nearly every guess accepted."""
    llm = assert_same_on_the_gpu(tiny, spec, enforce_eager)
    assert (llm.runner.drafter.graphs is None) == enforce_eager
    stats = llm.engine.scheduler.stats()
    if spec is SELF:
        assert stats.spec_num_accepted_tokens >= 0.9 * stats.spec_num_draft_tokens > 0
