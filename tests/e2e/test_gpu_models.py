"""Random Qwen3-0.6B- and Llama-3.1-8B-shaped models (4 layers) on the GPU: conveyor's greedy
tokens against transformers' on the same GPU, with and without async scheduling. Equal, or at the
first divergence each side's token is in the other's top-5 (vLLM's check_logprobs_close). Seeded
sampling gives the same tokens with async scheduling on and off."""
import gc

import pytest
import torch
from gpu_reference import assert_matches_hf, hf_greedy_with_tops

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

PROMPTS = [[5, 100, 2000, 31, 7, 999, 4242, 17, 256, 3000],
           list(range(300, 341)), [9] * 3 + list(range(1000, 1150))]
NEW_TOKENS = 24
TOP = 5


@pytest.mark.parametrize("shape", ["qwen3-0.6b", "llama3.1-8b"])
def test_greedy_matches_transformers(shape, tmp_path):
    from benchmarks.models import build_random_model
    from conveyor import LLM, SamplingParams

    # a wider init than HF's 0.02 so the next-token distributions are not flat
    path = build_random_model(shape, tmp_path / shape, num_hidden_layers=4,
                              initializer_range=0.05)
    hf = hf_greedy_with_tops(path, PROMPTS, NEW_TOKENS, TOP)

    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=TOP)
    for async_scheduling in (True, False):
        llm = LLM(model=str(path), device="cuda", skip_tokenizer_init=True, max_num_seqs=8,
                  max_model_len=512, gpu_memory_utilization=0.5,
                  async_scheduling=async_scheduling)
        ours = llm.generate(PROMPTS, params, use_tqdm=False)
        release(llm)
        assert_matches_hf(hf, ours, f"{shape} (async {async_scheduling})")


def release(llm) -> None:
    """Give the GPU memory of an LLM back before the next one sizes its KV pool."""
    del llm.engine, llm.runner
    gc.collect()
    torch.cuda.empty_cache()


def test_seeded_sampling_is_the_same_with_async_scheduling(tmp_path):
    """Penalties, min_tokens, stop ids, logprobs and prompt logprobs: the sampler's small host
    inputs reach the GPU without a sync, and each step still sees every earlier token."""
    from benchmarks.models import build_random_model
    from conveyor import LLM, SamplingParams

    path = build_random_model("qwen3-0.6b", tmp_path / "qwen3", num_hidden_layers=2,
                              initializer_range=0.05)
    filters = [dict(top_k=100, prompt_logprobs=2), dict(top_p=0.9, min_p=0.05),
               dict(presence_penalty=0.5)]
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=NEW_TOKENS, ignore_eos=True,
                             logprobs=2, repetition_penalty=1.2, frequency_penalty=0.5,
                             min_tokens=8, stop_token_ids=list(range(100, 5000, 7)), **kw)
              for i, kw in enumerate(filters)]
    runs = {}
    for async_scheduling in (False, True):
        llm = LLM(model=str(path), device="cuda", skip_tokenizer_init=True, max_num_seqs=8,
                  max_model_len=512, gpu_memory_utilization=0.3,
                  async_scheduling=async_scheduling)
        runs[async_scheduling] = llm.generate(PROMPTS, params, use_tqdm=False)
        release(llm)
    for off, on in zip(runs[False], runs[True]):
        assert on.outputs[0].token_ids == off.outputs[0].token_ids
        assert on.outputs[0].finish_reason == off.outputs[0].finish_reason
        assert len(on.outputs[0].token_ids) >= 8
        assert [sorted(p) for p in on.outputs[0].logprobs] == [
            sorted(p) for p in off.outputs[0].logprobs]
    assert runs[True][0].prompt_logprobs is not None
