"""Fused RMSNorm (+ residual), rotary (+ Qwen3 q/k norm), SiLU-and-mul, gpt-oss's clamped
SwiGLU against their torch references, on fresh random inputs of odd shapes."""
import pytest
import torch

pytestmark = pytest.mark.gpu

TOL = {torch.float16: dict(atol=2e-3, rtol=2e-3), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
DTYPES = [torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,cols", [(5, 123), (1, 1024), (37, 4096), (3, 128)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(dtype, rows, cols, with_residual):
    from conveyor.kernels.rms_norm import rms_norm, rms_norm_ref

    x = torch.randn(rows, cols, dtype=dtype, device="cuda") * 3
    w = torch.randn(cols, dtype=dtype, device="cuda")
    res = torch.randn_like(x) if with_residual else None
    got, want = rms_norm(x, w, 1e-6, res), rms_norm_ref(x, w, 1e-6, res)
    if with_residual:
        torch.testing.assert_close(got[1], want[1], atol=0, rtol=0)
        got, want = got[0], want[0]
    torch.testing.assert_close(got, want, **TOL[dtype])


def test_rms_norm_strided_rows():
    from conveyor.kernels.rms_norm import rms_norm, rms_norm_ref

    x = torch.randn(7, 300, dtype=torch.bfloat16, device="cuda")[:, :123]
    w = torch.randn(123, dtype=torch.bfloat16, device="cuda")
    torch.testing.assert_close(rms_norm(x, w, 1e-5), rms_norm_ref(x, w, 1e-5),
                               **TOL[torch.bfloat16])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,inter", [(5, 123), (1, 3072), (33, 14336)])
def test_silu_and_mul(dtype, tokens, inter):
    from conveyor.kernels.silu_and_mul import silu_and_mul, silu_and_mul_ref

    x = torch.randn(tokens, 2 * inter, dtype=dtype, device="cuda") * 2
    torch.testing.assert_close(silu_and_mul(x), silu_and_mul_ref(x), **TOL[dtype])


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,inter,limit", [(5, 123, 7.0), (1, 1440, 1.0), (33, 2880, 0.5)])
def test_clamped_swiglu(dtype, tokens, inter, limit, device):
    """gpt-oss's activation: gate clamped above, up on both sides (limits that bite)."""
    from conveyor.kernels.clamped_swiglu import clamped_swiglu, clamped_swiglu_ref

    x = (torch.randn(tokens, 2 * inter, device=device) * 3).to(dtype)
    want = clamped_swiglu_ref(x.float(), 1.702, limit).to(dtype)   # float32, rounded once
    torch.testing.assert_close(clamped_swiglu(x, 1.702, limit), want, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,heads,kv_heads,head_dim", [(5, 16, 8, 128), (1, 32, 8, 128),
                                                            (13, 6, 2, 64), (7, 5, 1, 96)])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rotary_qk(dtype, tokens, heads, kv_heads, head_dim, qk_norm):
    from conveyor.kernels.rotary import rotary_qk, rotary_qk_ref

    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, device="cuda")
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    q, k = q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)   # strided views
    angles = torch.rand(tokens, head_dim // 2, device="cuda") * 100
    cos, sin = angles.cos(), angles.sin()
    qw = kw = None
    if qk_norm:
        qw = torch.randn(head_dim, dtype=dtype, device="cuda")
        kw = torch.randn(head_dim, dtype=dtype, device="cuda")
    v_before = v.clone()
    want_q, want_k = rotary_qk_ref(q.clone(), k.clone(), cos, sin, qw, kw)
    rotary_qk(q, k, cos, sin, qw, kw)
    tol = dict(atol=3 * TOL[dtype]["atol"], rtol=3 * TOL[dtype]["rtol"])
    torch.testing.assert_close(q, want_q, **tol)
    torch.testing.assert_close(k, want_k, **tol)
    assert torch.equal(v, v_before)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,heads,kv_heads,head_dim,qk_norm,fp8", [
    (9, 16, 8, 128, True, False),       # Qwen3's heads, with the q/k norm
    (6, 6, 2, 64, False, False),
    (7, 5, 1, 96, False, True),         # head_dim not a power of two, fp8 pool
    (5, 32, 8, 128, True, True),
])
def test_rotary_qk_stores_kv(device, dtype, tokens, heads, kv_heads, head_dim, qk_norm, fp8):
    """rotary_qk given the pool writes what rotary_qk in place and then store_kv write, to the
    bit (padding slots untouched), and rotates q the same; k itself is left as it was."""
    from conveyor.kernels.rotary import rotary_qk
    from conveyor.kernels.store_kv import store_kv

    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, device=device).to(dtype) * 4
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    q, k = q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)
    v = v.view(tokens, kv_heads, head_dim)
    angles = torch.rand(tokens, head_dim // 2, device=device) * 100
    cos, sin = angles.cos(), angles.sin()
    qw = kw = None
    if qk_norm:
        qw = torch.randn(head_dim, device=device).to(dtype)
        kw = torch.randn(head_dim, device=device).to(dtype)
    block_size, num_blocks = 16, 3
    cache = torch.randn(num_blocks, 2, block_size, kv_heads, head_dim, device=device).to(dtype)
    scales = (0.37, 2.5) if fp8 else (1.0, 1.0)
    if fp8:
        cache = cache.to(torch.float8_e4m3fn)
    slots = torch.randperm(num_blocks * block_size, device=device)[:tokens].to(torch.int32)
    slots[::3] = -1
    want_q, want_k, want_cache = q.clone(), k.clone(), cache.clone()
    rotary_qk(want_q, want_k, cos, sin, qw, kw)
    store_kv(want_k, v, want_cache, slots, *scales)
    k_before = k.clone()
    rotary_qk(q, k, cos, sin, qw, kw, v=v, kv_cache=cache, slot_mapping=slots,
              k_scale=scales[0], v_scale=scales[1])
    assert torch.equal(q, want_q)
    assert torch.equal(k, k_before)
    assert torch.equal(cache.view(torch.uint8), want_cache.view(torch.uint8))
