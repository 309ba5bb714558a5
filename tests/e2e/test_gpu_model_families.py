"""The model families of tests/models_util.py on the GPU (Triton attention with sliding windows,
soft-capping and sinks, the fused-MoE kernels with gpt-oss's biases and activation, partial
rotary): conveyor's greedy tokens against
transformers' on the same GPU in bf16, with prefix caching and chunked prefill on (a 16-token
step budget; the prompts share a 32-token prefix). Equal, or at the first divergence each
side's token is in the other's top-5. Phi-3's sequences stay below its LongRoPE switch, past
which transformers re-rotates the whole sequence and a paged cache does not (README, "Models")."""
import pytest
from gpu_reference import assert_matches_hf, hf_greedy_with_tops
from models_util import make_tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

SHARED = list(range(40, 72))
PROMPTS = [SHARED + [5, 100, 200, 31, 7, 99], SHARED + list(range(120, 141)), SHARED]
NEW_TOKENS, TOP = 16, 5


@pytest.mark.parametrize("arch", ["mistral", "ministral3", "smollm3", "gemma", "gemma2", "gemma3",
                                  "phi3", "qwen3-moe", "mixtral", "qwen2-moe", "glm4", "glm4-moe",
                                  "deepseek-v3", "glm4-moe-lite", "deepseek-v2", "olmo2", "olmo3",
                                  "exaone4", "granite", "granite-moe-shared", "cohere2",
                                  "minimax-m2", "ernie4.5-moe", "olmoe", "hunyuan", "hunyuan-moe",
                                  "starcoder2", "apertus", "gpt-oss"])
def test_family_on_the_gpu_matches_transformers(arch, tmp_path):
    from conveyor import LLM, SamplingParams

    extra = {"original_max_position_embeddings": 128} if arch == "phi3" else {}
    path = make_tiny_model(arch, tmp_path / arch, **extra)
    hf = hf_greedy_with_tops(path, PROMPTS, NEW_TOKENS, TOP)
    llm = LLM(model=str(path), device="cuda", dtype="bfloat16", skip_tokenizer_init=True,
              max_num_seqs=4, max_model_len=128, max_num_batched_tokens=16,
              enable_prefix_caching=True, gpu_memory_utilization=0.3)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS,
                            ignore_eos=True, logprobs=TOP)
    assert_matches_hf(hf, llm.generate(PROMPTS, params, use_tqdm=False), arch)
