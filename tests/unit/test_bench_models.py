"""The benchmark scripts hand their engine settings to `conveyor serve` as flags (bench_latency
and bench_throughput with --tp): the flags must parse back to the same settings."""

from benchmarks.models import engine_flags
from conveyor.cli import build_parser


def test_engine_flags_parse_back_through_serve():
    engine = dict(max_num_seqs=8, max_model_len=4096, enforce_eager=False, async_scheduling=True,
                  load_format="dummy", kv_cache_dtype="fp8", quantization="int8",
                  keep_precision="lm_head")
    args = build_parser().parse_args(["serve", *engine_flags(engine)])
    assert {k: getattr(args, k) for k in engine} == engine


def test_unset_engine_arguments_take_serve_defaults():
    flags = engine_flags(dict(quantization=None, max_num_seqs=4))
    assert flags == ["--max-num-seqs=4"]
    assert build_parser().parse_args(["serve", *flags]).quantization is None


def test_qwen3_30b_a3b_shape_has_its_published_size():
    """30.5 B parameters (128 experts of width 768 in each of 48 layers), 3.3 B active a token."""
    from benchmarks.models import checkpoint_bytes, hf_config

    params = checkpoint_bytes("qwen3-30b-a3b") / 2
    assert 30.4e9 < params < 30.6e9
    c = hf_config("qwen3-30b-a3b").to_dict()
    experts = c.get("num_experts") or c["num_local_experts"]     # transformers 5 renames it
    expert = 3 * c["hidden_size"] * c["moe_intermediate_size"]
    active = params - c["num_hidden_layers"] * (experts - c["num_experts_per_tok"]) * expert
    assert 3.2e9 < active < 3.4e9


def test_gpt_oss_shapes_have_their_published_sizes():
    """gpt-oss-20b: 20.9 B parameters, gpt-oss-120b: 116.8 B (OpenAI's model card)."""
    from benchmarks.models import checkpoint_bytes

    assert 20.8e9 < checkpoint_bytes("gpt-oss-20b") / 2 < 21.0e9
    assert 116.7e9 < checkpoint_bytes("gpt-oss-120b") / 2 < 116.9e9


def test_random_quantized_checkpoints_load_and_run(tmp_path):
    """benchmarks' random 4-bit and block-scaled fp8 checkpoints (shortened qwen3-0.6b,
    qwen3-30b-a3b and gpt-oss-20b shapes) load through the published-format path and
    generate."""
    from benchmarks.models import build_random_quantized
    from conveyor import LLM, SamplingParams

    small = dict(num_hidden_layers=1, vocab_size=512)
    moe = dict(small, hidden_size=256, moe_intermediate_size=128, num_experts=4,
               num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2)
    gpt_oss = dict(small, hidden_size=64, intermediate_size=96, num_local_experts=4,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    for shape, fmt, extra in (("qwen3-0.6b", "awq", small), ("qwen3-0.6b", "gptq", small),
                              ("qwen3-30b-a3b", "fp8", moe), ("qwen3-30b-a3b", "awq", moe),
                              ("gpt-oss-20b", "mxfp4", gpt_oss)):
        path = build_random_quantized(shape, fmt, tmp_path / f"{shape}-{fmt}", **extra)
        llm = LLM(model=str(path), device="cpu", skip_tokenizer_init=True,
                  kv_cache_memory_bytes=16 << 20, max_model_len=64)
        assert llm.quantization_report.mode == fmt
        assert llm.quantization_report.prequantized
        out = llm.generate([{"prompt_token_ids": [3, 4, 5]}],
                           SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 4
