"""Tensor parallelism on CPU (gloo): `conveyor serve --tp 2` and `--tp 4`, through the ZMQ client,
give the same greedy tokens as TP=1 (the in-process engine). A tiny random Llama with 8 heads and
2 KV heads: at TP=4 each KV head is replicated on two ranks, and its vocabulary (250) does not
split evenly, so the last rank's embedding and head rows are padding. float32 everywhere: the
ranks' partial sums are added in another order than one matmul's, which moves logits by ~1e-7,
far below the gaps between a random model's top tokens, so the tokens must be equal.
"""
import pytest
from models_util import make_tiny_model, make_tiny_multimodal
from mxfp4_util import make_mxfp4_gpt_oss
from serve_util import assert_top5_close, served_outputs

from conveyor import LLM, SamplingParams

pytestmark = pytest.mark.slow

SHAPE = dict(hidden_size=64, head_dim=8, num_attention_heads=8, num_key_value_heads=2,
             intermediate_size=128, vocab_size=250, max_position_embeddings=512)
PROMPTS = [[5, 17, 200, 31], list(range(40, 77)), [9] * 3 + list(range(100, 120)), [249, 0, 1]]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
# on the CPU (gloo) even where a GPU is present
ENGINE = dict(max_num_seqs=64, kv_cache_memory_bytes=64 << 20, max_model_len=512, device="cpu")


def tp1_tokens(path: str, **engine) -> list[list[int]]:
    llm = LLM(model=path, skip_tokenizer_init=True, **ENGINE, **engine)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def served_tokens(path: str, tp: int, *args: str) -> list[list[int]]:
    return [o.token_ids for o in served_outputs(PROMPTS, GREEDY, "--model", path, "--tp", str(tp),
                                                "--skip-tokenizer-init", "--device", "cpu", *args)]


def test_tp2_and_tp4_match_tp1(tmp_path):
    path = str(make_tiny_model("llama", tmp_path / "llama", **SHAPE))
    reference = tp1_tokens(path)
    assert all(len(t) == GREEDY.max_tokens for t in reference)
    for tp in (2, 4):
        assert served_tokens(path, tp) == reference, f"tp={tp}"


def test_dummy_weights_are_the_same_at_tp2(tmp_path):
    """load_format=dummy: a folder with config.json only; every rank draws the same full
    tensors and takes its shard, so TP=2 equals TP=1."""
    path = str(make_tiny_model("llama", tmp_path / "config-only", weights=False, **SHAPE))
    reference = tp1_tokens(path, load_format="dummy", seed=3)
    assert reference != tp1_tokens(path, load_format="dummy", seed=4)   # the seed matters
    assert served_tokens(path, 2, "--load-format", "dummy", "--seed", "3") == reference


def test_quantized_tp2_stays_close_to_tp1(tmp_path):
    """int8 weights and an fp8 KV pool at TP=2. Not bit-equal to TP=1: a row-parallel layer's
    rank quantizes its half of each row with its own scale, and each rank calibrates the KV
    scales of its own heads. Greedy tokens equal or, at the first divergence, each side's token
    in the other's top-5 (STYLE.md's rule)."""
    path = str(make_tiny_model("llama", tmp_path / "llama", **SHAPE))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5)
    quant = dict(quantization="int8", kv_cache_dtype="fp8")
    llm = LLM(model=path, skip_tokenizer_init=True, **ENGINE, **quant)
    reference = [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    served = served_outputs(PROMPTS, params, "--model", path, "--tp", "2", "--skip-tokenizer-init",
                            "--quantization", "int8", "--kv-cache-dtype", "fp8", "--device", "cpu")
    assert all(len(o.token_ids) == 12 for o in served)
    assert_top5_close(reference, served)


def test_each_worker_writes_its_profile_window(tmp_path, monkeypatch):
    """CONVEYOR_PROFILE_DIR: every rank of a served engine profiles steps 1-3 and writes a trace
    and a table; at TP=2 the table holds the all-reduces, the trace the step loop's host phases."""
    path = str(make_tiny_model("llama", tmp_path / "llama", **SHAPE))
    out = tmp_path / "profile"
    monkeypatch.setenv("CONVEYOR_PROFILE_DIR", str(out))
    monkeypatch.setenv("CONVEYOR_PROFILE_STEPS", "1:3")
    assert len(served_tokens(path, 2)[0]) == GREEDY.max_tokens
    for rank in (0, 1):
        table = (out / f"worker-{rank}.txt").read_text()
        assert table.startswith(f"worker {rank}: steps 1 to 3 (3 steps)")
        assert "allreduce" in table.replace("_", "").lower()
        trace = (out / f"worker-{rank}.json").read_text()
        for phase in ("conveyor: wait for a plan", "conveyor: receive a plan",
                      "conveyor: run a step"):
            assert f'"name": "{phase}"' in trace, (rank, phase)


@pytest.mark.parametrize("arch", ["qwen3-moe", "qwen2-moe", "glm4", "glm4-moe", "deepseek-v3",
                                  "deepseek-v2", "olmo2", "olmo3", "exaone4", "gemma2", "phi3",
                                  "granite-moe-shared", "cohere2", "minimax-m2", "ernie4.5-moe",
                                  "flex-olmo", "hunyuan", "hunyuan-moe", "starcoder2", "apertus",
                                  "ministral3", "glm4-moe-lite", "dots1", "exaone-moe", "llama4",
                                  "gpt-oss"])
def test_new_families_at_tp2_match_tp1(tmp_path, arch):
    """Experts split along their intermediate dimension (Qwen3-MoE: 6 experts of width 24, 12
    a rank; Qwen2-MoE's shared expert too, as a dense MLP, its gate whole on each rank; GLM's
    float32 router whole on each rank, its shared experts as a dense MLP; DeepSeek's MLA: the
    latents' projections whole on each rank, the per-head ones split with the heads; OLMo's q/k
    norms over all heads, each rank's share normalised by the mean over all ranks), Gemma's
    and GLM-4's extra norms over reduced partial sums, Cohere's attention and MLP summed
    before the reduction, Phi-3's fused checkpoint tensors split then sharded, gpt-oss's sinks
    split with the heads and its experts' down bias added on one rank: TP=2 gives TP=1's
    tokens."""
    path = str(make_tiny_model(arch, tmp_path / arch, max_position_embeddings=512))
    reference = tp1_tokens(path)
    assert served_tokens(path, 2) == reference


@pytest.mark.parametrize("kind", ["mistral3:mistral4", "llama4"])
def test_multimodal_text_models_at_tp2_match_tp1(tmp_path, kind):
    """Mistral Small 4 (MLA with the queries' scale by position, softmax scores ranked in
    groups) and Llama 4 (chunked layers, experts weighting their input), served for their text
    from their multimodal checkpoints: TP=2 gives TP=1's tokens."""
    path = str(make_tiny_multimodal(kind, tmp_path / "m"))
    reference = tp1_tokens(path)
    assert served_tokens(path, 2) == reference


@pytest.mark.parametrize("inter", [64, 32])
def test_gpt_oss_mxfp4_at_tp2_matches_tp1(tmp_path, inter):
    """gpt-oss's MXFP4 checkpoint at TP=2: its experts kept in 4 bits where each rank's share
    of the intermediate size is whole blocks of 32 (64: one block a rank), dequantized as they
    load where it is not (32: 16 a rank); TP=2 gives TP=1's tokens either way."""
    src = make_tiny_model("gpt-oss", tmp_path / "src", max_position_embeddings=512,
                          intermediate_size=inter)
    make_mxfp4_gpt_oss(src, tmp_path / "mxfp4")
    path = str(tmp_path / "mxfp4")
    reference = tp1_tokens(path)
    assert served_tokens(path, 2) == reference
