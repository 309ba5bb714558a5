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
