"""The KV pool's size: what the memory budget allows, but never more blocks than `max_num_seqs`
sequences of `max_model_len` tokens could fill (more would only feed the prefix cache, and a
tiny model on a large GPU would hand the scheduler millions of blocks to list)."""
import pytest
from models_util import make_tiny_model

from conveyor import LLM, SamplingParams


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_pool_stops_at_what_the_sequences_can_fill(device, tmp_path):
    path = make_tiny_model("llama", tmp_path)
    budget = (dict(kv_cache_memory_bytes=1 << 30) if device == "cpu"
              else dict(gpu_memory_utilization=0.3))
    llm = LLM(str(path), device=device, skip_tokenizer_init=True, max_num_seqs=6,
              max_model_len=100, block_size=8, **budget)
    assert llm.runner.num_blocks == 6 * 13                       # 100 tokens: 13 blocks of 8
    assert llm.engine.scheduler.stats().num_total_blocks == 6 * 13
    out = llm.generate([[5] * 90] * 6, SamplingParams(max_tokens=10, ignore_eos=True),
                       use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in out] == [10] * 6


def test_a_small_budget_still_decides(tmp_path):
    path = make_tiny_model("llama", tmp_path)
    roomy = LLM(str(path), skip_tokenizer_init=True, max_num_seqs=6, max_model_len=100,
                block_size=8, kv_cache_memory_bytes=1 << 30).runner
    per_block = roomy._block_bytes()
    tight = LLM(str(path), skip_tokenizer_init=True, max_num_seqs=6, max_model_len=100,
                block_size=8, kv_cache_memory_bytes=20 * per_block).runner
    assert tight.num_blocks == 20
