"""The engine against transformers on tiny random Llama, Qwen2 and Qwen3 models.

Greedy tokens must be identical, logprobs close; outputs must not change with the prefix cache,
chunked prefill, a KV pool so small that requests are preempted and recomputed, or async
scheduling (two steps in flight, sampled tokens fed to the next step on the device).
"""
import pytest
import torch
from models_util import make_tiny_model

from conveyor import LLM, SamplingParams

PROMPT_LENS = [1, 7, 19, 40, 3]
NEW = 12


def prompts(vocab: int = 256, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module", params=["llama", "llama-tied", "qwen2", "qwen3"])
def tiny(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = make_tiny_model(request.param, tmp_path_factory.mktemp(request.param))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, hf


def hf_greedy(hf, ids: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                          attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          output_logits=True, return_dict_in_generate=True,
                          eos_token_id=None, pad_token_id=0)
    return out.sequences[0, len(ids):].tolist(), [x[0].log_softmax(-1) for x in out.logits]


def make_llm(path, **kw) -> LLM:
    return LLM(str(path), skip_tokenizer_init=True, block_size=kw.pop("block_size", 4), **kw)


GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, logprobs=3)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_greedy_and_logprobs_match_transformers(tiny, async_scheduling):
    path, hf = tiny
    outs = make_llm(path, async_scheduling=async_scheduling).generate(prompts(), GREEDY,
                                                                       use_tqdm=False)
    for ids, out in zip(prompts(), outs):
        expected, logprobs = hf_greedy(hf, ids, NEW)
        comp = out.outputs[0]
        assert comp.token_ids == expected
        assert comp.finish_reason == "length"
        for tok, pos, ref in zip(comp.token_ids, comp.logprobs, logprobs):
            assert pos[tok].rank == 1
            assert abs(pos[tok].logprob - ref[tok].item()) < 1e-4
            top = ref.topk(3).indices.tolist()
            assert set(top) <= set(pos)


@pytest.mark.parametrize("engine_args", [
    dict(enable_prefix_caching=False),
    dict(max_num_batched_tokens=8),                   # chunked prefill, mixed batches
    dict(num_kv_blocks=14, max_num_batched_tokens=16),  # preemption and recompute
    dict(max_num_seqs=2),
])
def test_outputs_do_not_depend_on_scheduling(tiny, engine_args):
    path, _ = tiny
    reference = [o.outputs[0].token_ids for o in
                 make_llm(path).generate(prompts(), GREEDY, use_tqdm=False)]
    llm = make_llm(path, **engine_args)
    outs = llm.generate(prompts(), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
    if "num_kv_blocks" in engine_args:
        assert llm.engine.scheduler.num_preemptions > 0
        assert sum(o.metrics.num_preemptions for o in outs) > 0
    stats = llm.engine.scheduler.stats()
    assert stats.num_free_blocks == stats.num_total_blocks and stats.num_running == 0
    llm.engine.scheduler.check_integrity()


def test_prefix_cache_hits_and_same_outputs(tiny):
    path, _ = tiny
    shared = prompts()[3]                                   # 40 tokens: 10 full blocks
    batch = [shared + [5, 6, 7], shared + [9]]
    llm = make_llm(path)
    first = llm.generate(batch[:1], GREEDY, use_tqdm=False)[0]
    second = llm.generate(batch, GREEDY, use_tqdm=False)
    assert second[0].outputs[0].token_ids == first.outputs[0].token_ids
    assert second[0].metrics.num_cached_tokens >= 40
    cold = make_llm(path, enable_prefix_caching=False).generate(batch, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in second] == [o.outputs[0].token_ids for o in cold]
    stats = llm.engine.scheduler.stats()
    assert stats.prefix_cache_hits > 0


def test_prompt_logprobs_match_transformers(tiny):
    path, hf = tiny
    ids = prompts()[3]
    llm = make_llm(path, max_num_batched_tokens=16)       # several chunks
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2),
                       use_tqdm=False)[0]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].log_softmax(-1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    for p in range(1, len(ids)):
        entry = out.prompt_logprobs[p]
        assert abs(entry[ids[p]].logprob - ref[p - 1, ids[p]].item()) < 1e-4
        assert set(ref[p - 1].topk(2).indices.tolist()) <= set(entry)


def assert_same_outputs(a, b, tol: float = 1e-5) -> None:
    """Same tokens, ends and prompt logprobs; the same logprob entries, values within tol (batch
    shapes differ, so float sums may round differently)."""
    def same_positions(x, y):
        assert (x is None) == (y is None)
        for px, py in zip(x or [], y or []):
            assert (px is None) == (py is None) and set(px or {}) == set(py or {})
            for t in px or {}:
                assert px[t].rank == py[t].rank
                assert abs(px[t].logprob - py[t].logprob) < tol
        assert len(x or []) == len(y or [])

    assert len(a) == len(b)
    for ra, rb in zip(a, b):
        assert len(ra.outputs) == len(rb.outputs)
        for ca, cb in zip(ra.outputs, rb.outputs):
            assert ca.token_ids == cb.token_ids
            assert (ca.finish_reason, ca.stop_reason) == (cb.finish_reason, cb.stop_reason)
            same_positions(ca.logprobs, cb.logprobs)
        same_positions(ra.prompt_logprobs, rb.prompt_logprobs)


SEEDED = dict(temperature=0.8, top_k=50, max_tokens=NEW, logprobs=2)
ASYNC_SCENARIOS = {
    "chunked-prefill": (dict(max_num_batched_tokens=8), GREEDY),
    "preemption": (dict(num_kv_blocks=14, max_num_batched_tokens=16), GREEDY),
    "max-num-seqs": (dict(max_num_seqs=2), GREEDY),
    "max-tokens-1": (dict(), SamplingParams(temperature=0, max_tokens=1, logprobs=3)),
    "n2-seeded": (dict(), SamplingParams(n=2, seed=5, **SEEDED)),
    "penalties-min-tokens": (dict(), SamplingParams(
        seed=3, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.7,
        min_tokens=8, stop_token_ids=list(range(3, 256, 4)), **SEEDED)),
    "prompt-logprobs": (dict(max_num_batched_tokens=16, num_kv_blocks=20),
                        SamplingParams(temperature=0, max_tokens=6, prompt_logprobs=2,
                                       logprobs=1)),
}


@pytest.mark.parametrize("scenario", ASYNC_SCENARIOS)
def test_async_scheduling_changes_no_output(tiny, scenario):
    path, _ = tiny
    engine_args, params = ASYNC_SCENARIOS[scenario]
    runs = {}
    for flag in (False, True):
        llm = make_llm(path, async_scheduling=flag, **engine_args)
        runs[flag] = llm.generate(prompts(), params, use_tqdm=False)
        if "num_kv_blocks" in engine_args and scenario == "preemption":
            assert llm.engine.scheduler.num_preemptions > 0
        stats = llm.engine.scheduler.stats()
        assert stats.num_free_blocks == stats.num_total_blocks and stats.num_running == 0
        llm.engine.scheduler.check_integrity()
    assert_same_outputs(runs[False], runs[True])
    if scenario == "penalties-min-tokens":      # the test can tell: both change the tokens
        plain = make_llm(path).generate(prompts(), SamplingParams(seed=3, **SEEDED),
                                        use_tqdm=False)
        assert [o.outputs[0].token_ids for o in plain] != [
            o.outputs[0].token_ids for o in runs[True]]
        assert all(len(o.outputs[0].token_ids) >= 8 for o in runs[True])


def test_async_scheduling_with_stops_and_the_prefix_cache(tiny):
    path, _ = tiny
    reference = make_llm(path, async_scheduling=False).generate(prompts(), GREEDY,
                                                                 use_tqdm=False)
    # every prompt stops early on a token of its own greedy output (or on EOS)
    stops = SamplingParams(temperature=0, max_tokens=NEW, logprobs=2,
                           stop_token_ids=[o.outputs[0].token_ids[3] for o in reference])
    shared = prompts()[3]
    batch = [shared + [5, 6, 7], shared + [9], *prompts()]
    runs = {}
    for flag in (False, True):
        llm = make_llm(path, async_scheduling=flag)
        first = llm.generate(prompts(), stops, use_tqdm=False)
        second = llm.generate(batch, GREEDY, use_tqdm=False)        # hits the cache
        assert llm.engine.scheduler.stats().prefix_cache_hits > 0
        assert all(o.outputs[0].finish_reason == "stop" for o in first)
        runs[flag] = first + second
    assert_same_outputs(runs[False], runs[True])


def test_hf_overrides_change_the_model_as_transformers_does(tmp_path):
    """vLLM's hf_overrides: config.json's keys replaced (a nested object's one by one) in every
    process that reads the config; tokens equal transformers' on the same edited config, and
    differ from the unedited model's."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = make_tiny_model("llama", tmp_path / "llama", max_position_embeddings=512)
    overrides = {"rope_parameters": {"factor": 16.0, "rope_theta": 500.0},
                 "max_position_embeddings": 256}
    cfg = AutoConfig.from_pretrained(path)
    cfg.rope_parameters.update(overrides["rope_parameters"])
    cfg.max_position_embeddings = 256
    hf = AutoModelForCausalLM.from_pretrained(path, config=cfg, dtype=torch.float32).eval()
    llm = make_llm(path, hf_overrides=overrides)
    assert llm.runner.max_model_len == 256
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts(), params, use_tqdm=False)]
    assert ours == [hf_greedy(hf, p, NEW)[0] for p in prompts()]
    plain = [o.outputs[0].token_ids
             for o in make_llm(path).generate(prompts(), params, use_tqdm=False)]
    assert plain != ours
    with pytest.raises(ValueError, match="hf_overrides"):
        make_llm(path, hf_overrides="[1, 2]")
