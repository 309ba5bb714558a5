"""Every Triton kernel compiled for Hopper (sm90) on the CPU, from its launcher's own call: the
launch is replaced by triton.compile for GPUTarget("cuda", 90, 32) with the call's argument
types, constexprs and options (PDL and the inline PTX of fp8 attention on, as on an H100/H200).

This catches what Triton's interpreter lets through before a GPU run: a kernel that reads a
module-level Python value that is not a tl.constexpr (the interpreter reads any global; the
compiler refuses), a type error in a branch the CPU tests never take, PTX that does not
assemble. Runs wherever Triton is installed, GPU or not; skipped without it:

    pytest -m compile tests/kernels
"""
import importlib.util
import inspect
import math

import pytest
import torch

from conveyor.kernels import interpreting

pytestmark = [pytest.mark.compile,
              pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                 reason="needs Triton (no GPU needed)"),
              pytest.mark.skipif(interpreting(), reason="compiles: not under TRITON_INTERPRET")]

POINTER = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32",
           torch.int32: "*i32", torch.int64: "*i64", torch.int8: "*i8", torch.uint8: "*u8",
           torch.float8_e4m3fn: "*fp8e4nv"}
LAUNCH_ONLY = ("launch_pdl", "num_ctas", "maxnreg")


def compile_sm90(fn, args: tuple, kwargs: dict):
    """triton.compile of JITFunction fn for sm90 as fn[grid](*args, **kwargs) would launch it.
    Pointers and integers that are multiples of 16 get the divisibility hint the launcher's
    specialisation gives them on a GPU (except do_not_specialize parameters)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kwargs = dict(kwargs)
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
    for k in LAUNCH_ONLY:
        kwargs.pop(k, None)
    bound = dict(zip(fn.arg_names, args)) | kwargs
    plain = set(getattr(fn, "do_not_specialize", ()))
    signature, constexprs, attrs = {}, {}, {}
    for i, p in enumerate(fn.params):
        value = bound[p.name] if p.name in bound else p.default
        assert value is not inspect.Parameter.empty, f"{fn.__name__}: no value for {p.name}"
        if p.is_constexpr or value is None:
            signature[p.name] = "constexpr"
            constexprs[p.name] = value
        elif isinstance(value, torch.Tensor):
            signature[p.name] = POINTER[value.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, bool):
            signature[p.name] = "i1"
        elif isinstance(value, int):
            signature[p.name] = "i64" if abs(value) >= 2**31 else "i32"
            if value % 16 == 0 and value and i not in plain and p.name not in plain:
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[p.name] = "fp32"
    src = ASTSource(fn, signature, constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


@pytest.fixture
def compiled(monkeypatch):
    """Launches compile for sm90 instead; returns the list of (kernel name, compiled)."""
    import triton

    from conveyor.kernels import _triton, paged_attention

    done = []

    def getitem(self, grid):
        def launch(*args, **kwargs):
            done.append((self.__name__, compile_sm90(self, args, kwargs)))
        return launch

    monkeypatch.setattr(triton.runtime.jit.JITFunction, "__getitem__", getitem)
    monkeypatch.setattr(_triton, "pdl", lambda: True)
    monkeypatch.setattr(paged_attention, "_has_cvt_e4m3x2", lambda device: True)
    return done


def check(done, *names):
    assert sorted({n for n, _ in done}) == sorted(set(names))
    for name, kernel in done:
        assert kernel.asm["cubin"], name


BF = torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_norm_activation_and_quantization_kernels(compiled, dtype):
    from conveyor.kernels.clamped_swiglu import clamped_swiglu
    from conveyor.kernels.quant_fp8 import quant_fp8
    from conveyor.kernels.rms_norm import rms_norm
    from conveyor.kernels.silu_and_mul import silu_and_mul

    x, w = torch.zeros(4, 4096, dtype=dtype), torch.zeros(4096, dtype=dtype)
    rms_norm(x, w, 1e-6)
    rms_norm(x, w, 1e-6, x, fp8=True)
    silu_and_mul(torch.zeros(4, 2 * 1000, dtype=dtype))
    clamped_swiglu(torch.zeros(4, 2 * 1000, dtype=dtype), 1.702, 7.0)
    quant_fp8(torch.zeros(4, 2 * 14336, dtype=dtype), silu_mul=True)
    quant_fp8(torch.zeros(4, 4096, dtype=dtype))
    check(compiled, "_rms_norm_kernel", "_silu_and_mul_kernel", "_clamped_swiglu_kernel",
          "_quant_fp8_kernel")


@pytest.mark.parametrize("mode", [None, "int8", "fp8", "q8_0"])
def test_gemm_kernels(compiled, mode):
    from conveyor.kernels.dequantize import dequantize
    from conveyor.kernels.int8_gemm import int8_gemm
    from conveyor.kernels.skinny_gemm import skinny_gemm

    n, k = 6144, 4096
    dtype = {None: BF, "int8": torch.int8, "q8_0": torch.int8, "fp8": torch.float8_e4m3fn}[mode]
    w = torch.zeros(n, k, dtype=dtype)
    s = None if mode is None else torch.ones(n, k // 32 if mode == "q8_0" else 1)
    skinny_gemm(torch.zeros(1, k, dtype=BF), w, torch.zeros(n, dtype=BF), scale=s)
    skinny_gemm(torch.zeros(1, 2 * k, dtype=BF), w, silu_mul=True, scale=s)
    names = ["_skinny_gemm_kernel"]
    if mode == "int8":
        for m in (16, 256):
            int8_gemm(torch.zeros(m, k, dtype=BF), w, s)
        dequantize(w, s, BF)
        names += ["_int8_gemm_kernel", "_dequantize_kernel"]
    if mode == "fp8":
        from conveyor.kernels._util import Fp8Rows
        from conveyor.kernels.fp8_gemm import tiled, tiling

        for m, bias in ((16, None), (128, torch.zeros(n, dtype=BF)), (256, None)):
            rows = Fp8Rows(torch.zeros(m, k, dtype=dtype), torch.ones(m, 1), BF)
            for sms in (132, 16):        # 16: the widest tiles
                tiled(rows, w, s, bias, tiling(m, n, sms))
        tiled(Fp8Rows(w[:5, :1008], s[:5], torch.float16), w[:, :1008], s, None,
              tiling(5, n, 132))         # K not whole steps, fp16 out
        names.append("_fp8_gemm_kernel")
    check(compiled, *names)


@pytest.mark.parametrize("cache_dtype", [BF, torch.float8_e4m3fn])
def test_attention_kernels(compiled, cache_dtype):
    from conveyor.kernels.paged_attention import paged_attention
    from conveyor.kernels.rotary import rotary_qk
    from conveyor.kernels.store_kv import store_kv

    blocks, bs, kvh, d, heads = 64, 16, 8, 128, 32
    cache = torch.zeros(blocks, 2, bs, kvh, d, dtype=cache_dtype)
    tables = torch.zeros(4, 8, dtype=torch.int32)
    seq_lens = torch.tensor([100, 7, 64, 33], dtype=torch.int32)
    for q_lens in ([1, 1, 1, 1], [1, 7, 30, 1], [1, 1, 1, 100]):
        t = sum(q_lens)
        q = torch.zeros(t, heads, d, dtype=BF)
        starts = torch.tensor([0] + [sum(q_lens[:i + 1]) for i in range(4)], dtype=torch.int32)
        paged_attention(q, cache, tables, seq_lens, starts, d ** -0.5, max(q_lens))
    paged_attention(q[:4], cache, tables, seq_lens, torch.arange(5, dtype=torch.int32),
                    d ** -0.5, 1, num_splits=4)
    paged_attention(q[:4], cache, tables, seq_lens, torch.arange(5, dtype=torch.int32),
                    d ** -0.5, 1, seq_order=torch.arange(4, dtype=torch.int32))
    k, v = torch.zeros(9, kvh, d, dtype=BF), torch.zeros(9, kvh, d, dtype=BF)
    slots = torch.arange(9)
    store_kv(k, v, cache, slots)
    cos = sin = torch.zeros(9, d // 2)
    norm = torch.ones(d, dtype=BF)
    rotary_qk(torch.zeros(9, heads, d, dtype=BF), k, cos, sin, norm, norm)
    rotary_qk(torch.zeros(9, heads, d, dtype=BF), k, cos, sin, v=v, kv_cache=cache,
              slot_mapping=slots)
    check(compiled, "_paged_attention_kernel", "_merge_splits_kernel", "_store_kv_kernel",
          "_rotary_kernel")


def test_window_softcap_attention(compiled):
    """Sliding window and soft-capping (Mistral, Gemma): mixed and decode-only launches."""
    from conveyor.kernels.paged_attention import paged_attention

    cache = torch.zeros(64, 2, 16, 4, 256, dtype=BF)
    tables = torch.zeros(2, 8, dtype=torch.int32)
    seq_lens = torch.tensor([100, 40], dtype=torch.int32)
    q = torch.zeros(31, 8, 256, dtype=BF)
    starts = torch.tensor([0, 1, 31], dtype=torch.int32)
    paged_attention(q, cache, tables, seq_lens, starts, 0.0625, 30, window=4096, softcap=50.0)
    paged_attention(q[:2], cache, tables, seq_lens, torch.arange(3, dtype=torch.int32), 0.0625,
                    1, num_splits=3, window=33)
    check(compiled, "_paged_attention_kernel", "_merge_splits_kernel")


def test_sinks_attention(compiled):
    """gpt-oss's attention sinks (float32 or bf16), with its window or none: mixed, split and
    decode-only launches."""
    from conveyor.kernels.paged_attention import paged_attention

    cache = torch.zeros(64, 2, 16, 8, 64, dtype=BF)
    tables = torch.zeros(2, 8, dtype=torch.int32)
    seq_lens = torch.tensor([100, 40], dtype=torch.int32)
    q = torch.zeros(31, 64, 64, dtype=BF)
    starts = torch.tensor([0, 1, 31], dtype=torch.int32)
    for sinks in (torch.zeros(64), torch.zeros(64, dtype=BF)):
        paged_attention(q, cache, tables, seq_lens, starts, 0.125, 30, window=128, sinks=sinks)
        paged_attention(q[:2], cache, tables, seq_lens, torch.arange(3, dtype=torch.int32),
                        0.125, 1, num_splits=3, sinks=sinks)
        paged_attention(q[:2], cache, tables, seq_lens, torch.arange(3, dtype=torch.int32),
                        0.125, 1, seq_order=torch.arange(2, dtype=torch.int32), sinks=sinks)
    check(compiled, "_paged_attention_kernel", "_merge_splits_kernel")


@pytest.mark.parametrize("m", [1, 40, 2000])
def test_gpt_oss_moe_kernels(compiled, m):
    """gpt-oss-20b's experts (H = I = 2880, 32 of them, 4 a token): biases in the grouped
    GEMMs and the clamped SwiGLU, at each tile class; with int8 experts too, and MXFP4's
    (4-bit e2m1 words, an e8m0 scale byte a block of 32 inputs)."""
    from conveyor.kernels.fused_moe import fused_moe
    from conveyor.worker.layers.router import route

    h, inter, experts = 2880, 2880, 32
    weights, ids = route(torch.randn(m, experts), 4, True, BF, softmax_after_topk=True)
    bias = dict(w13_bias=torch.zeros(experts, 2 * inter, dtype=BF),
                w2_bias=torch.zeros(experts, h, dtype=BF), swiglu=(1.702, 7.0))
    fused_moe(torch.zeros(m, h, dtype=BF), torch.zeros(experts, 2 * inter, h, dtype=BF),
              torch.zeros(experts, h, inter, dtype=BF), weights, ids, **bias)
    fused_moe(torch.zeros(m, h, dtype=BF), torch.zeros(experts, 2 * inter, h, dtype=torch.int8),
              torch.zeros(experts, h, inter, dtype=torch.int8), weights, ids, None,
              torch.ones(experts, 2 * inter, 1), torch.ones(experts, h, 1), **bias)
    fused_moe(torch.zeros(m, h, dtype=BF),
              torch.zeros(experts, 2 * inter, h // 8, dtype=torch.int32),
              torch.zeros(experts, h, inter // 8, dtype=torch.int32), weights, ids, None,
              torch.full((experts, 2 * inter, h // 32), 127, dtype=torch.uint8),
              torch.full((experts, h, inter // 32), 127, dtype=torch.uint8), **bias, fp4=True)
    check(compiled, "_moe_gemm_kernel", "_clamped_swiglu_kernel", "_count_kernel",
          "_offsets_kernel", "_scatter_kernel")


@pytest.mark.parametrize("m", [1, 5, 40, 300, 2000])     # MoE: 16-, 32- and 128-row tiles
def test_w4a16_and_fused_moe_kernels(compiled, m):
    from conveyor.kernels.fused_moe import fused_moe
    from conveyor.kernels.w4a16_gemm import CUBLAS_FROM_M, w4a16_gemm
    from conveyor.worker.layers.router import route

    n, k = 4096, 4096
    words = torch.zeros(n, k // 8, dtype=torch.int32)
    scale = torch.ones(n, k // 128)
    w4a16_gemm(torch.zeros(m, k, dtype=BF), words, scale, scale, torch.zeros(n, dtype=BF),
               torch.arange(k))
    small = torch.ones(n, k // 64)          # groups under 128 inputs: scaled a word at a time
    w4a16_gemm(torch.zeros(m, k, dtype=BF), words, small, small)
    h, inter, experts = 2048, 768, 128
    weights, ids = route(torch.randn(m, experts), 8, True, BF)
    fused_moe(torch.zeros(m, h, dtype=BF), torch.zeros(experts, 2 * inter, h, dtype=BF),
              torch.zeros(experts, h, inter, dtype=BF), weights, ids)
    for dtype in (torch.float8_e4m3fn, torch.int8):          # quantized experts
        fused_moe(torch.zeros(m, h, dtype=BF), torch.zeros(experts, 2 * inter, h, dtype=dtype),
                  torch.zeros(experts, h, inter, dtype=dtype), weights, ids, None,
                  torch.ones(experts, 2 * inter, 1), torch.ones(experts, h, 1))
    # an fp8 checkpoint's 128 x 128 blocks; an AWQ / GPTQ checkpoint's 4-bit experts, group 128
    s13, s2 = torch.ones(experts, 2 * inter, h // 128), torch.ones(experts, h, inter // 128)
    fused_moe(torch.zeros(m, h, dtype=BF),
              torch.zeros(experts, 2 * inter, h, dtype=torch.float8_e4m3fn),
              torch.zeros(experts, h, inter, dtype=torch.float8_e4m3fn), weights, ids, None,
              s13, s2)
    fused_moe(torch.zeros(m, h, dtype=BF),                  # GGUF Q8_0: groups of 32
              torch.zeros(experts, 2 * inter, h, dtype=torch.int8),
              torch.zeros(experts, h, inter, dtype=torch.int8), weights, ids, None,
              torch.ones(experts, 2 * inter, h // 32), torch.ones(experts, h, inter // 32))
    fused_moe(torch.zeros(m, h, dtype=BF),
              torch.zeros(experts, 2 * inter, h // 8, dtype=torch.int32),
              torch.zeros(experts, h, inter // 8, dtype=torch.int32), weights, ids, None,
              s13, s2, s13, s2)
    # decode rows on the CUDA cores, then tensor-core tiles; from CUBLAS_FROM_M rows the weight
    # is dequantized, then multiplied by cuBLAS
    int4 = ("_w4a16_gemv_kernel" if m == 1 else
            "_w4a16_kernel" if m < CUBLAS_FROM_M else "_dequantize_int4_kernel")
    check(compiled, int4, "_moe_gemm_kernel", "_silu_and_mul_kernel", "_count_kernel",
          "_offsets_kernel", "_scatter_kernel")


def test_w4a16_kernel_in_tiles_of_64_rows(compiled, monkeypatch):
    """The tensor-core kernel's tiles of 64 rows (taken where CUBLAS_FROM_M is raised past the
    step), both scale paths."""
    from conveyor.kernels import w4a16_gemm as mod

    monkeypatch.setattr(mod, "CUBLAS_FROM_M", 1 << 20)
    n, k = 4096, 4096
    words = torch.zeros(n, k // 8, dtype=torch.int32)
    for groups in (k // 128, k // 64):
        scale = torch.ones(n, groups)
        mod.w4a16_gemm(torch.zeros(200, k, dtype=BF), words, scale, scale)
    check(compiled, "_w4a16_kernel")


def test_sampling_kernels(compiled):
    from conveyor.kernels.sample import sample
    from conveyor.kernels.sample_nucleus import sample_nucleus

    logits = torch.zeros(3, 151936, dtype=BF)
    sample(logits)
    sample(logits, torch.ones(3), torch.zeros(3, dtype=torch.int64))
    ones = torch.ones(2)
    sample_nucleus(logits, torch.arange(2), ones, ones * 0.9, ones * 0.0,
                   torch.zeros(2, dtype=torch.int64))
    check(compiled, "_sample_chunk_kernel", "_sample_reduce_kernel", "_nucleus_kernel")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_lora_kernels(compiled, dtype):
    from conveyor.kernels.lora import lora_expand, lora_shrink

    for t in (8, 300):                   # decode-sized and prefill-sized tiles
        x = torch.zeros(t, 4096, dtype=dtype)
        A = torch.zeros(8, 3, 16, 4096, dtype=dtype)
        B = torch.zeros(8, 6144, 16, dtype=dtype)
        order, starts = torch.zeros(t, dtype=torch.int64), torch.zeros(9, dtype=torch.int64)
        h = lora_shrink(x, A, order, starts)
        lora_expand(torch.zeros(t, 6144, dtype=dtype), h, B,
                    torch.tensor([0, 4096, 5120, 6144], dtype=torch.int32), 4096, order, starts)
    check(compiled, "_shrink_kernel", "_expand_kernel")


def test_a_global_python_float_fails_to_compile(compiled):
    """The class of error this file is for: the interpreter runs this kernel, the compiler
    refuses it."""
    import triton
    import triton.language as tl

    @triton.jit
    def reads_a_global(x_ptr, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(x_ptr + offs, tl.load(x_ptr + offs) * SCALE)

    with pytest.raises(Exception, match="global variable SCALE"):
        reads_a_global[(1,)](torch.zeros(16), BLOCK=16)


SCALE = math.pi
