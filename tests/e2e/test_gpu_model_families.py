"""The model families of tests/models_util.py on the GPU (Triton attention with sliding windows,
soft-capping and sinks, the fused-MoE kernels with gpt-oss's biases and activation, partial
rotary): conveyor's greedy tokens against transformers' on the same GPU in bf16 (the mixtures
of experts in float16, below), with prefix caching and chunked prefill on (a 16-token step
budget; the prompts share a 32-token prefix). Equal, or at the first divergence each
side's token is in the other's top-5. Phi-3's sequences stay below its LongRoPE switch, past
which transformers re-rotates the whole sequence and a paged cache does not (README, "Models")."""
import pytest
import torch
from gpu_reference import assert_matches_hf, hf_greedy_with_tops
from models_util import make_tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

SHARED = list(range(40, 72))
PROMPTS = [SHARED + [5, 100, 200, 31, 7, 99], SHARED + list(range(120, 141)), SHARED]
NEW_TOKENS, TOP = 16, 5
# NOTE: the mixtures of experts run in float16 on both sides: their tiny random routers hold
# near ties that bf16's rounding flips, in transformers itself (glm4-moe's bf16 run left its
# float32 tokens at token 7 of two prompts of three; float16 kept them all), and a flipped
# choice is another MLP for that token. On an H100 (2026-12-05) glm4-moe and glm4-moe-lite
# failed the top-5 rule in bf16 and passed in float16, as did MiniMax-M2, DeepSeek-V3 and
# Qwen3-MoE. gpt-oss keeps bf16, its checkpoints' dtype.
FLOAT16 = {"qwen3-moe", "mixtral", "qwen2-moe", "glm4-moe", "glm4-moe-lite", "dots1",
           "deepseek-v3", "deepseek-v2", "granite-moe-shared", "minimax-m2", "ernie4.5-moe",
           "olmoe", "hunyuan-moe", "exaone-moe", "llama4"}


@pytest.mark.parametrize("arch", ["mistral", "ministral3", "llama4", "smollm3", "gemma", "gemma2",
                                  "gemma3", "phi3", "qwen3-moe", "mixtral", "qwen2-moe", "glm4",
                                  "glm4-moe", "deepseek-v3", "glm4-moe-lite", "dots1",
                                  "deepseek-v2", "olmo2", "olmo3", "exaone4", "exaone-moe",
                                  "granite", "granite-moe-shared", "cohere2", "minimax-m2",
                                  "ernie4.5-moe", "olmoe", "hunyuan", "hunyuan-moe", "starcoder2",
                                  "apertus", "gpt-oss"])
def test_family_on_the_gpu_matches_transformers(arch, tmp_path):
    from conveyor import LLM, SamplingParams

    extra = {"original_max_position_embeddings": 128} if arch == "phi3" else {}
    path = make_tiny_model(arch, tmp_path / arch, **extra)
    dtype = "float16" if arch in FLOAT16 else "bfloat16"
    hf = hf_greedy_with_tops(path, PROMPTS, NEW_TOKENS, TOP, getattr(torch, dtype))
    llm = LLM(model=str(path), device="cuda", dtype=dtype, skip_tokenizer_init=True,
              max_num_seqs=4, max_model_len=128, max_num_batched_tokens=16,
              enable_prefix_caching=True, gpu_memory_utilization=0.3)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS,
                            ignore_eos=True, logprobs=TOP)
    assert_matches_hf(hf, llm.generate(PROMPTS, params, use_tqdm=False), arch)
