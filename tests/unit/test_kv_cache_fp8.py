"""The fp8 KV cache on CPU: the option, the pool (one byte an element), the torch backend's
quantize-on-write and scale-on-read, and the start-up calibration of the per-layer scales
against the K/V that transformers computes for the same tokens."""
import argparse
import math
import random

import pytest
import torch
from models_util import make_tiny_model

from conveyor.shared.config import EngineConfig
from conveyor.shared.model_config import ModelConfig
from conveyor.worker.attention_backend import TorchAttentionBackend, quantize_fp8
from conveyor.worker.context import StepContext
from conveyor.worker.kv_cache import FP8_DTYPE, bytes_per_block, kv_cache_dtype

FP8 = torch.float8_e4m3fn


def test_option_is_validated_and_reaches_the_cli():
    from conveyor.cli import add_engine_args, engine_kwargs

    assert EngineConfig().kv_cache_dtype == "auto" and not EngineConfig().kv_cache_fp8
    assert EngineConfig(kv_cache_dtype="fp8").kv_cache_fp8
    assert EngineConfig(kv_cache_dtype="fp8_e4m3").kv_cache_fp8
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="int8")
    ap = argparse.ArgumentParser()
    add_engine_args(ap)
    assert engine_kwargs(ap.parse_args(["--kv-cache-dtype", "fp8"]))["kv_cache_dtype"] == "fp8"


def test_pool_takes_one_byte_an_element():
    model = ModelConfig("LlamaForCausalLM", hidden_size=64, num_hidden_layers=3,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                        intermediate_size=128, vocab_size=256)
    auto, fp8 = EngineConfig(), EngineConfig(kv_cache_dtype="fp8")
    assert kv_cache_dtype(auto, torch.bfloat16) == torch.bfloat16
    assert kv_cache_dtype(fp8, torch.bfloat16) == FP8_DTYPE == FP8
    bf16_bytes = bytes_per_block(model, auto, torch.bfloat16)
    assert bf16_bytes == 3 * 2 * 16 * 2 * 16 * 2
    assert bytes_per_block(model, fp8, FP8) * 2 == bf16_bytes


def _pool_ctx(block_size=4, kv_heads=2, head_dim=8, seed=0):
    """Two sequences: a decode over 9 cached tokens and a 6-token chunk after 5 cached ones."""
    rng = random.Random(seed)
    q_lens, seq_lens = [1, 6], [10, 11]
    num_blocks = 12
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(math.ceil(s / block_size))] for s in seq_lens]
    slots = [t[p // block_size] * block_size + p % block_size
             for t, q, s in zip(tables, q_lens, seq_lens) for p in range(s - q, s)]
    ctx = StepContext(slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor(
        [0, 1, 7], dtype=torch.int32), seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (3 - len(t)) for t in tables], dtype=torch.int32),
        kv_caches=[], query_lens_cpu=q_lens, seq_lens_cpu=seq_lens, num_decodes=1)
    # the cached positions (and everything else) hold random fp8 values
    cache = (torch.randn(num_blocks, 2, block_size, kv_heads, head_dim) * 4).to(FP8)
    return cache, ctx


def test_write_quantizes_with_saturation_and_read_applies_the_scales():
    cache, ctx = _pool_ctx()
    t, bs = 7, cache.shape[2]
    k = torch.randn(t, 2, 8) * 3
    v = torch.randn(t, 2, 8) * 0.01
    k[0, 0, 0] = 1e4                                       # beyond 448 * k_scale: saturates
    backend = TorchAttentionBackend()
    backend.write_kv(cache, k, v, ctx.slot_mapping, 0.5, 1e-4)
    s = ctx.slot_mapping
    stored_k = cache.view(torch.uint8)[s // bs, 0, s % bs].view(FP8).float()
    stored_v = cache.view(torch.uint8)[s // bs, 1, s % bs].view(FP8).float()
    assert stored_k[0, 0, 0] == 448
    assert torch.equal(stored_k, (k / 0.5).clamp(-448, 448).to(FP8).float())
    assert torch.equal(stored_v, (v / 1e-4).clamp(-448, 448).to(FP8).float())
    assert torch.equal(quantize_fp8(k, 0.5).float(), stored_k)
    # v / 1e-4 uses e4m3's normal range: the relative error is at most half a step (2**-4)
    normal = (v / 1e-4).abs() > 2 ** -6
    assert ((stored_v * 1e-4 - v).abs() <= v.abs() * 2 ** -4 + 1e-9)[normal].all()

    # reading: the same as attention over the dequantized values (float32, times the scales)
    q = torch.randn(t, 4, 8)
    deq = cache.float()
    deq[:, 0] *= 0.5
    deq[:, 1] *= 1e-4
    want = backend.forward(q, deq, ctx, 0.3)
    got = backend.forward(q, cache, ctx, 0.3, 0.5, 1e-4)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_scales_need_an_fp8_pool():
    cache, ctx = _pool_ctx()
    with pytest.raises(ValueError, match="fp8"):
        TorchAttentionBackend().write_kv(cache.float(), torch.randn(7, 2, 8),
                                         torch.randn(7, 2, 8), ctx.slot_mapping, 0.5, 1.0)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_calibration_measures_the_models_k_and_v(arch, tmp_path):
    """The scales are amax * MARGIN / 448 of the K (after RoPE and q/k norm) and V that
    transformers' cache holds after the same tokens."""
    from transformers import AutoModelForCausalLM

    from conveyor import LLM
    from conveyor.worker.kv_scales import MARGIN, calibration_ids

    path = make_tiny_model(arch, tmp_path)
    llm = LLM(str(path), skip_tokenizer_init=True, kv_cache_dtype="fp8", block_size=4,
              max_num_seqs=2)
    runner = llm.runner
    assert all(c.dtype == FP8 for c in runner.kv_caches)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = calibration_ids(256, min(512, runner.max_model_len))
    with torch.no_grad():
        cache = hf(ids[None], use_cache=True).past_key_values
    for layer, (k_scale, v_scale) in zip(cache.layers, runner.kv_scales):
        assert k_scale == pytest.approx(layer.keys.abs().max().item() * MARGIN / 448, rel=1e-4)
        assert v_scale == pytest.approx(layer.values.abs().max().item() * MARGIN / 448, rel=1e-4)
    attn = [m for m in runner.model.modules() if hasattr(m, "k_scale")]
    assert [(a.k_scale, a.v_scale) for a in attn] == runner.kv_scales


def test_fp8_pool_has_four_times_the_float32_blocks(tmp_path):
    from conveyor import LLM

    path = make_tiny_model("llama", tmp_path)
    budget = dict(kv_cache_memory_bytes=1 << 20, max_num_seqs=256, max_model_len=128,
                  skip_tokenizer_init=True)
    auto = LLM(str(path), **budget).runner
    fp8 = LLM(str(path), kv_cache_dtype="fp8", **budget).runner
    assert auto.kv_caches[0].dtype == torch.float32 and fp8.kv_caches[0].dtype == FP8
    assert fp8.num_blocks == 4 * auto.num_blocks
    assert auto.kv_scales is None


@pytest.mark.parametrize("engine_args", [
    dict(max_num_batched_tokens=8),                     # chunks read earlier chunks from the pool
    dict(num_kv_blocks=14, max_num_batched_tokens=16),  # preemption and recompute
    dict(async_scheduling=False),
])
def test_fp8_outputs_do_not_depend_on_scheduling(engine_args, tmp_path):
    """Quantization happens once per token, on write: chunking, preemption (recompute writes
    the same values again) and prefix-cache hits read back the same fp8 bytes."""
    from conveyor import LLM, SamplingParams

    path = make_tiny_model("qwen3", tmp_path)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (1, 7, 19, 40, 3)]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    def run(**kw):
        llm = LLM(str(path), skip_tokenizer_init=True, block_size=4, kv_cache_dtype="fp8", **kw)
        return llm, [o.outputs[0].token_ids for o in llm.generate(prompts, greedy,
                                                                   use_tqdm=False)]

    ref_llm, reference = run(enable_prefix_caching=False)
    llm, tokens = run(**engine_args)
    assert tokens == reference
    if "num_kv_blocks" in engine_args:
        assert llm.engine.scheduler.num_preemptions > 0
    again = llm.generate(prompts, greedy, use_tqdm=False)       # prefix-cache hits
    assert [o.outputs[0].token_ids for o in again] == reference
    assert llm.engine.scheduler.stats().prefix_cache_hits > 0
    # the fp8 pool makes a difference the test can see: some logprob moves
    auto = LLM(str(path), skip_tokenizer_init=True, block_size=4, enable_prefix_caching=False)
    lp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=1)
    a, b = (x.generate(prompts[3:4], lp, use_tqdm=False)[0].outputs[0] for x in (auto, ref_llm))
    assert [p[t].logprob for p, t in zip(a.logprobs, a.token_ids)] != [
        p[t].logprob for p, t in zip(b.logprobs, b.token_ids)]


def test_fused_store_hands_the_pool_to_the_rotary_kernel_unless_a_backend_must_see_k_and_v():
    """Attention.fused_store: the keywords that let rotary_qk store K and V into this layer's
    pool with the layer's scales (the GPU path); none where the layer has a backend of its own,
    as during fp8 calibration, which must see k and v through write_kv."""
    from conveyor.worker.kv_scales import _AmaxRecorder
    from conveyor.worker.layers.attention import Attention

    cache, ctx = _pool_ctx()
    ctx.kv_caches = [cache.float(), cache]
    attn = Attention(1, num_heads=4, num_kv_heads=2, head_dim=8, scale=0.3)
    attn.k_scale, attn.v_scale = 0.5, 2.0
    v = torch.randn(7, 3 * 16)[:, 16:32]                     # a strided slice, like qkv's
    store = attn.fused_store(v, ctx)
    assert store["kv_cache"] is cache and store["slot_mapping"] is ctx.slot_mapping
    assert (store["k_scale"], store["v_scale"]) == (0.5, 2.0)
    assert store["v"].shape == (7, 2, 8) and torch.equal(store["v"].reshape(7, 16), v)
    attn.backend = _AmaxRecorder(TorchAttentionBackend())
    assert attn.fused_store(v, ctx) == {}
