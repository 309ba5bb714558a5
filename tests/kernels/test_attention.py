"""store_kv and paged_attention against the torch backend (the reference), on mixed batches of
decodes and prefill chunks with cached prefixes not aligned to blocks, GQA groups 1/4/8, block
sizes 16/32, head_dim 64/128, the split-KV path, and padded slots; sliding windows, chunked
attention, soft-capping and attention sinks; and the same over an fp8 (e4m3) pool with
per-layer scales. The `interpreter` tests also run on CPU under TRITON_INTERPRET=1 (small
shapes: the interpreter is slow)."""
import math
import random

import pytest
import torch

from conveyor.worker.attention_backend import TorchAttentionBackend
from conveyor.worker.context import StepContext

pytestmark = pytest.mark.gpu

DTYPES = [torch.float16, torch.bfloat16]
TOL = {torch.float16: dict(atol=2e-3, rtol=2e-3), torch.bfloat16: dict(atol=1.5e-2, rtol=1.5e-2)}
FP8 = torch.float8_e4m3fn
K_SCALE, V_SCALE = 0.37, 2.5     # odd scales: a scale applied twice, or not at all, shows


def make_batch(rng, decodes, prefills, block_size, kv_heads, head_dim, dtype, device="cuda"):
    """decodes: context lengths; prefills: (query length, cached prefix). -> ctx, tables."""
    q_lens = [1] * len(decodes) + [q for q, _ in prefills]
    seq_lens = list(decodes) + [q + p for q, p in prefills]
    num_blocks = sum(math.ceil(s / block_size) for s in seq_lens) + 5
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(math.ceil(s / block_size))] for s in seq_lens]
    width = max(len(t) for t in tables) + 2
    gen = torch.Generator(device=device).manual_seed(rng.randint(0, 10**6))
    # garbage everywhere: a read outside the context shows up as a wrong result
    cache = torch.randn(num_blocks, 2, block_size, kv_heads, head_dim, generator=gen,
                        device=device).to(dtype)
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    slots = []
    for table, q_len, seq_len in zip(tables, q_lens, seq_lens):
        slots += [table[p // block_size] * block_size + p % block_size
                  for p in range(seq_len - q_len, seq_len)]
    ctx = StepContext(
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables],
                                  dtype=torch.int32, device=device),
        kv_caches=[cache], query_lens_cpu=q_lens, seq_lens_cpu=seq_lens,
        num_decodes=len(decodes))
    return ctx


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("kv_heads,head_dim", [(8, 128), (3, 64)])
def test_store_kv(dtype, block_size, kv_heads, head_dim):
    from conveyor.kernels.store_kv import store_kv, store_kv_ref

    t, num_blocks = 123, 20
    cache = torch.randn(num_blocks, 2, block_size, kv_heads, head_dim, device="cuda").to(dtype)
    kv = torch.randn(t, 3, kv_heads, head_dim, device="cuda").to(dtype)
    k, v = kv[:, 1], kv[:, 2]                                   # strided views, like qkv's
    slots = torch.randperm(num_blocks * block_size, device="cuda")[:t]
    slots[::7] = -1                                             # padding rows
    want = cache.clone()
    store_kv_ref(k, v, want, slots)
    store_kv(k, v, cache, slots)
    assert torch.equal(cache, want)


CASES = [
    # (decode context lengths, prefills as (query length, cached prefix))
    ([5, 1, 37, 300, 17], []),
    ([], [(123, 0), (5, 0)]),
    ([9, 64, 1000], [(70, 33), (1, 15), (200, 0)]),
    ([2048], [(17, 100)]),
    ([3] * 40, [(300, 531)]),
]


# (dtype, block size, GQA group, head_dim): a spread, not the full product (each compiles)
CONFIGS = [(torch.bfloat16, 16, 2, 128), (torch.bfloat16, 32, 4, 128),
           (torch.float16, 16, 8, 64), (torch.float16, 32, 1, 128), (torch.bfloat16, 16, 3, 64)]


@pytest.mark.parametrize("dtype,block_size,group,head_dim", CONFIGS)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_paged_attention(dtype, block_size, group, head_dim, case):
    from conveyor.kernels.paged_attention import paged_attention

    rng = random.Random(case * 97 + group * 7 + head_dim + block_size)
    decodes, prefills = CASES[case]
    kv_heads = 2
    ctx = make_batch(rng, decodes, prefills, block_size, kv_heads, head_dim, dtype)
    t = sum(ctx.query_lens_cpu)
    q = torch.randn(t, kv_heads * group, head_dim, device="cuda").to(dtype)
    scale = head_dim ** -0.5
    cache = ctx.kv_caches[0]
    want = TorchAttentionBackend().forward(q.float(), cache.float(), ctx, scale)
    for splits, order in _variants(ctx, prefills):
        got = paged_attention(q, cache, ctx.block_tables, ctx.seq_lens, ctx.query_start_loc,
                              scale, max(ctx.query_lens_cpu), num_splits=splits,
                              seq_order=order)
        torch.testing.assert_close(got.float(), want, **TOL[dtype])


def _variants(ctx, prefills, splits=(1, 3)):
    """(num_splits, seq_order) to run a batch with: split or not (a batch with prefill chunks
    splits each query tile's keys too), and decode-only batches also in the decode order
    (longest first, as the runner gives it) and in a random order."""
    if prefills:
        return [(n, None) for n in splits]
    longest = torch.argsort(ctx.seq_lens, descending=True, stable=True).int()
    shuffled = torch.randperm(len(ctx.seq_lens_cpu), device=ctx.seq_lens.device).int()
    return [(n, None) for n in splits] + [(splits[-1], longest), (1, shuffled)]


@pytest.mark.interpreter
@pytest.mark.parametrize("pool,head_dim,splits", [(torch.bfloat16, 32, (1, 2)),
                                                  (torch.bfloat16, 24, (1,)), (FP8, 32, (1,))])
def test_paged_attention_whole_blocks_small(pool, head_dim, splits, device):
    """Contexts of several key blocks with a partial last one, split or not, and a prefill
    chunk over a cached prefix of several blocks (the other interpreter cases fit one block)."""
    from conveyor.kernels.paged_attention import paged_attention

    prefills = [] if len(splits) > 1 else [(20, 150)]
    ctx = make_batch(random.Random(head_dim), [200, 128, 129, 64], prefills, 16, 1, head_dim,
                     pool, device)
    q = torch.randn(sum(ctx.query_lens_cpu), 4, head_dim, device=device).to(torch.bfloat16)
    scales = (K_SCALE, V_SCALE) if pool == FP8 else (1.0, 1.0)
    want = TorchAttentionBackend().forward(q.float(), ctx.kv_caches[0], ctx, 0.2, *scales)
    for n, order in _variants(ctx, prefills, splits):
        got = paged_attention(q, ctx.kv_caches[0], ctx.block_tables, ctx.seq_lens,
                              ctx.query_start_loc, 0.2, max(ctx.query_lens_cpu), num_splits=n,
                              k_scale=scales[0], v_scale=scales[1], seq_order=order)
        torch.testing.assert_close(got.float(), want, atol=1.5e-2 * scales[1], rtol=1.5e-2)


@pytest.mark.parametrize("window,softcap", [(1, 0.0), (7, 0.0), (40, 0.0), (129, 0.0),
                                            (33, 5.0), (0, 2.5)])
@pytest.mark.parametrize("case", [0, 2, 4])
def test_paged_attention_window_softcap(window, softcap, case):
    """A sliding window (keys older than the window masked, whole blocks before it skipped) and
    logit soft-capping, on odd shapes: GQA group 3, head_dim 80, blocks of 16, split or not."""
    from conveyor.kernels.paged_attention import paged_attention

    rng = random.Random(window * 13 + case)
    decodes, prefills = CASES[case]
    ctx = make_batch(rng, decodes, prefills, 16, 2, 80, torch.bfloat16)
    q = torch.randn(sum(ctx.query_lens_cpu), 6, 80, device="cuda").to(torch.bfloat16) * 3
    cache = ctx.kv_caches[0]
    want = TorchAttentionBackend().forward(q.float(), cache.float(), ctx, 0.11,
                                           window=window, softcap=softcap)
    for splits, order in _variants(ctx, prefills, (1, 4)):
        got = paged_attention(q, cache, ctx.block_tables, ctx.seq_lens, ctx.query_start_loc,
                              0.11, max(ctx.query_lens_cpu), num_splits=splits,
                              seq_order=order, window=window, softcap=softcap)
        torch.testing.assert_close(got.float(), want, **TOL[torch.bfloat16])


@pytest.mark.parametrize("chunk", [1, 7, 16, 40, 129])
@pytest.mark.parametrize("case", [0, 2, 4])
def test_paged_attention_chunked(chunk, case):
    """Chunked attention (Llama 4's: a query sees its chunk's keys up to itself; whole blocks
    before the tile's first chunk skipped), on odd shapes: GQA group 3, head_dim 80, blocks of
    16, split or not."""
    from conveyor.kernels.paged_attention import paged_attention

    rng = random.Random(chunk * 17 + case)
    decodes, prefills = CASES[case]
    ctx = make_batch(rng, decodes, prefills, 16, 2, 80, torch.bfloat16)
    q = torch.randn(sum(ctx.query_lens_cpu), 6, 80, device="cuda").to(torch.bfloat16) * 3
    cache = ctx.kv_caches[0]
    want = TorchAttentionBackend().forward(q.float(), cache.float(), ctx, 0.11, chunk=chunk)
    for splits, order in _variants(ctx, prefills, (1, 4)):
        got = paged_attention(q, cache, ctx.block_tables, ctx.seq_lens, ctx.query_start_loc,
                              0.11, max(ctx.query_lens_cpu), num_splits=splits,
                              seq_order=order, chunk=chunk)
        torch.testing.assert_close(got.float(), want, **TOL[torch.bfloat16])


@pytest.mark.interpreter
@pytest.mark.parametrize("chunk,prefills", [(16, []), (37, [(20, 150)]), (100, [(40, 30)])])
def test_paged_attention_chunked_small(chunk, prefills, device):
    """Chunked attention's skipped blocks and mask, also under Triton's interpreter."""
    from conveyor.kernels.paged_attention import paged_attention

    ctx = make_batch(random.Random(chunk), [200, 5, 129], prefills, 16, 1, 32, torch.bfloat16,
                     device)
    q = torch.randn(sum(ctx.query_lens_cpu), 2, 32, device=device).to(torch.bfloat16) * 3
    want = TorchAttentionBackend().forward(q.float(), ctx.kv_caches[0].float(), ctx, 0.2,
                                           chunk=chunk)
    for n, order in _variants(ctx, prefills, (1, 2)):
        got = paged_attention(q, ctx.kv_caches[0], ctx.block_tables, ctx.seq_lens,
                              ctx.query_start_loc, 0.2, max(ctx.query_lens_cpu), num_splits=n,
                              seq_order=order, chunk=chunk)
        torch.testing.assert_close(got.float(), want, atol=1.5e-2, rtol=1.5e-2)


@pytest.mark.interpreter
@pytest.mark.parametrize("group", [1, 3])
def test_paged_attention_verify_shaped_small(group, device):
    """A speculative verify step's shape: a few sequences of five queries each (the last token
    and four guesses, causal among them) over long cached contexts, split or not."""
    from conveyor.kernels.paged_attention import paged_attention

    ctx = make_batch(random.Random(group), [], [(5, 300), (5, 129), (5, 17)], 16, 1, 32,
                     torch.bfloat16, device)
    q = torch.randn(sum(ctx.query_lens_cpu), group, 32, device=device).to(torch.bfloat16)
    want = TorchAttentionBackend().forward(q.float(), ctx.kv_caches[0].float(), ctx, 0.2)
    for n in (1, 4):
        got = paged_attention(q, ctx.kv_caches[0], ctx.block_tables, ctx.seq_lens,
                              ctx.query_start_loc, 0.2, 5, num_splits=n)
        torch.testing.assert_close(got.float(), want, atol=1.5e-2, rtol=1.5e-2)


@pytest.mark.interpreter
@pytest.mark.parametrize("window,softcap,prefills", [(20, 0.0, []), (37, 4.0, [(20, 150)]),
                                                     (0, 3.0, [])])
def test_paged_attention_window_softcap_small(window, softcap, prefills, device):
    """The window's skipped blocks and the soft cap, also under Triton's interpreter."""
    from conveyor.kernels.paged_attention import paged_attention

    ctx = make_batch(random.Random(window), [200, 5, 129], prefills, 16, 1, 32, torch.bfloat16,
                     device)
    q = torch.randn(sum(ctx.query_lens_cpu), 2, 32, device=device).to(torch.bfloat16) * 3
    want = TorchAttentionBackend().forward(q.float(), ctx.kv_caches[0].float(), ctx, 0.2,
                                           window=window, softcap=softcap)
    for n, order in _variants(ctx, prefills, (1, 2)):
        got = paged_attention(q, ctx.kv_caches[0], ctx.block_tables, ctx.seq_lens,
                              ctx.query_start_loc, 0.2, max(ctx.query_lens_cpu), num_splits=n,
                              seq_order=order, window=window, softcap=softcap)
        torch.testing.assert_close(got.float(), want, atol=1.5e-2, rtol=1.5e-2)


@pytest.mark.parametrize("window", [0, 7, 40])
@pytest.mark.parametrize("case", [0, 2, 4])
def test_paged_attention_sinks(window, case):
    """gpt-oss's attention sinks (a logit per query head in each softmax's denominator, counted
    once over the splits), with a sliding window or without, on odd shapes: GQA group 3,
    head_dim 80, blocks of 16, split or not; sinks in float32 and bf16."""
    from conveyor.kernels.paged_attention import paged_attention

    rng = random.Random(window * 7 + case)
    decodes, prefills = CASES[case]
    ctx = make_batch(rng, decodes, prefills, 16, 2, 80, torch.bfloat16)
    q = torch.randn(sum(ctx.query_lens_cpu), 6, 80, device="cuda").to(torch.bfloat16) * 3
    sinks = torch.randn(6, device="cuda") * 2 + 1
    cache = ctx.kv_caches[0]
    want = TorchAttentionBackend().forward(q.float(), cache.float(), ctx, 0.11, window=window,
                                           sinks=sinks)
    for splits, order in _variants(ctx, prefills, (1, 4)):
        for s in (sinks, sinks.bfloat16()):
            got = paged_attention(q, cache, ctx.block_tables, ctx.seq_lens,
                                  ctx.query_start_loc, 0.11, max(ctx.query_lens_cpu),
                                  num_splits=splits, seq_order=order, window=window, sinks=s)
            torch.testing.assert_close(got.float(), want, **TOL[torch.bfloat16])


@pytest.mark.interpreter
@pytest.mark.parametrize("window,prefills", [(0, []), (20, []), (37, [(20, 150)]),
                                             (0, [(9, 0)])])
def test_paged_attention_sinks_small(window, prefills, device):
    """Attention sinks under Triton's interpreter too: decodes split or not, a prefill chunk
    over a cached prefix, a window or none; GQA group 3, head_dim 24 (padded)."""
    from conveyor.kernels.paged_attention import paged_attention

    ctx = make_batch(random.Random(window + len(prefills)), [200, 5, 129], prefills, 16, 1, 24,
                     torch.bfloat16, device)
    q = torch.randn(sum(ctx.query_lens_cpu), 3, 24, device=device).to(torch.bfloat16) * 3
    sinks = torch.tensor([2.5, -1.0, 0.3], device=device)
    want = TorchAttentionBackend().forward(q.float(), ctx.kv_caches[0].float(), ctx, 0.2,
                                           window=window, sinks=sinks)
    without = TorchAttentionBackend().forward(q.float(), ctx.kv_caches[0].float(), ctx, 0.2,
                                              window=window)
    assert (want - without).abs().max() > 0.05                  # the sinks matter here
    for n, order in _variants(ctx, prefills, (1, 2)):
        got = paged_attention(q, ctx.kv_caches[0], ctx.block_tables, ctx.seq_lens,
                              ctx.query_start_loc, 0.2, max(ctx.query_lens_cpu), num_splits=n,
                              seq_order=order, window=window, sinks=sinks)
        torch.testing.assert_close(got.float(), want, atol=1.5e-2, rtol=1.5e-2)


@pytest.mark.parametrize("splits", [1, 2, 16])
def test_paged_attention_split_kv_long_context(splits):
    from conveyor.kernels.paged_attention import paged_attention

    rng = random.Random(splits)
    ctx = make_batch(rng, [4000, 1, 777], [], 16, 8, 128, torch.bfloat16)
    q = torch.randn(3, 16, 128, device="cuda").to(torch.bfloat16)
    want = TorchAttentionBackend().forward(q.float(), ctx.kv_caches[0].float(), ctx, 0.1)
    got = paged_attention(q, ctx.kv_caches[0], ctx.block_tables, ctx.seq_lens,
                          ctx.query_start_loc, 0.1, 1, num_splits=splits)
    torch.testing.assert_close(got.float(), want, **TOL[torch.bfloat16])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_sinks", [False, True])
def test_triton_backend_matches_torch(dtype, with_sinks):
    """The backend: write_kv then forward, with padded rows (slot -1) past the batch (and
    attention sinks passed through)."""
    from conveyor.worker.triton_backend import TritonAttentionBackend

    rng = random.Random(5)
    ctx = make_batch(rng, [7, 100], [(33, 17), (5, 0)], 16, 2, 128, dtype)
    t = sum(ctx.query_lens_cpu)
    q = torch.randn(t + 2, 8, 128, device="cuda").to(dtype)
    k = torch.randn(t + 2, 2, 128, device="cuda").to(dtype)
    v = torch.randn(t + 2, 2, 128, device="cuda").to(dtype)
    ctx.slot_mapping = torch.cat([ctx.slot_mapping,
                                  torch.tensor([-1, -1], device="cuda")])
    cache = ctx.kv_caches[0]
    ref_cache = cache.clone()
    torch_backend, triton_backend = TorchAttentionBackend(), TritonAttentionBackend()
    torch_backend.write_kv(ref_cache, k, v, ctx.slot_mapping)
    triton_backend.write_kv(cache, k, v, ctx.slot_mapping)
    assert torch.equal(cache, ref_cache)
    sinks = torch.randn(8, device="cuda") if with_sinks else None
    want = torch_backend.forward(q.float(), ref_cache.float(), ctx, 0.08, sinks=sinks)
    got = triton_backend.forward(q, cache, ctx, 0.08, sinks=sinks)
    torch.testing.assert_close(got.float(), want, **TOL[dtype])
    assert not got[t:].any()


# --- fp8 (e4m3) pool ---------------------------------------------------------------------------

def _store_fp8_case(dtype, block_size, kv_heads, head_dim, t, device):
    from conveyor.kernels.store_kv import store_kv, store_kv_ref

    num_blocks = -(-t // block_size) + 3
    cache = torch.randn(num_blocks, 2, block_size, kv_heads, head_dim, device=device).to(FP8)
    kv = torch.randn(t, 3, kv_heads, head_dim, device=device) * 60
    kv[1, 1, 0, 0] = 1000.0                                     # past 448 * k_scale
    kv = kv.to(dtype)
    k, v = kv[:, 1], kv[:, 2]                                   # strided views, like qkv's
    slots = torch.randperm(num_blocks * block_size, device=device)[:t]
    slots[::7] = -1                                             # padding rows
    want = cache.clone()
    store_kv_ref(k, v, want, slots, K_SCALE, V_SCALE)
    store_kv(k, v, cache, slots, K_SCALE, V_SCALE)
    assert torch.equal(cache.view(torch.uint8), want.view(torch.uint8))
    keep = slots >= 0
    raw = cache.view(torch.uint8)[slots[keep] // block_size, 0, slots[keep] % block_size]
    stored = raw.view(FP8).float()
    exact = k[keep].float() / K_SCALE
    assert stored.abs().max() == 448                            # saturated, not NaN
    # elsewhere the stored value is k / k_scale rounded to e4m3's 3 mantissa bits
    normal = (exact.abs() < 448) & (exact.abs() > 2 ** -6)
    assert ((stored - exact).abs() <= exact.abs() * 2 ** -4)[normal].all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("kv_heads,head_dim", [(8, 128), (3, 64)])
def test_store_kv_fp8(dtype, block_size, kv_heads, head_dim):
    _store_fp8_case(dtype, block_size, kv_heads, head_dim, 123, "cuda")


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_fp8_small(dtype, device):
    _store_fp8_case(dtype, 4, 3, 24, 13, device)


def _attention_fp8_case(dtype, block_size, group, head_dim, decodes, prefills, splits, device,
                        kv_heads=2, seed=0):
    from conveyor.kernels.paged_attention import paged_attention

    rng = random.Random(seed)
    ctx = make_batch(rng, decodes, prefills, block_size, kv_heads, head_dim, FP8, device)
    t = sum(ctx.query_lens_cpu)
    q = torch.randn(t, kv_heads * group, head_dim, device=device).to(dtype)
    scale = head_dim ** -0.5
    cache = ctx.kv_caches[0]
    # the reference reads the same fp8 bytes (exact in float32) and applies the same scales
    want = TorchAttentionBackend().forward(q.float(), cache, ctx, scale, K_SCALE, V_SCALE)
    tol = {k: x * V_SCALE for k, x in TOL[dtype].items()}
    for n, order in _variants(ctx, prefills, splits):
        got = paged_attention(q, cache, ctx.block_tables, ctx.seq_lens, ctx.query_start_loc,
                              scale, max(ctx.query_lens_cpu), num_splits=n, k_scale=K_SCALE,
                              v_scale=V_SCALE, seq_order=order)
        torch.testing.assert_close(got.float(), want, **tol)


@pytest.mark.parametrize("dtype,block_size,group,head_dim", CONFIGS)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_paged_attention_fp8(dtype, block_size, group, head_dim, case):
    decodes, prefills = CASES[case]
    _attention_fp8_case(dtype, block_size, group, head_dim, decodes, prefills,
                        (1, 3) if not prefills else (1,), "cuda",
                        seed=case * 97 + group * 7 + head_dim + block_size)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype,group,splits", [(torch.bfloat16, 2, (1, 2)),
                                                (torch.float16, 3, (1,))])
def test_paged_attention_fp8_small(dtype, group, splits, device):
    """Decodes and a prefill chunk over a cached prefix, block size 4, head_dim 24 (padded)."""
    prefills = [] if len(splits) > 1 else [(5, 6)]
    _attention_fp8_case(dtype, 4, group, 24, [3, 9], prefills, splits, device, kv_heads=1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_backend_fp8_matches_torch(dtype):
    """write_kv then forward on an fp8 pool, with padded rows (slot -1) past the batch."""
    from conveyor.worker.triton_backend import TritonAttentionBackend

    rng = random.Random(6)
    ctx = make_batch(rng, [7, 100], [(33, 17), (5, 0)], 16, 2, 128, FP8)
    t = sum(ctx.query_lens_cpu)
    q, k, v = (torch.randn(t + 2, h, 128, device="cuda").to(dtype) for h in (8, 2, 2))
    ctx.slot_mapping = torch.cat([ctx.slot_mapping, torch.tensor([-1, -1], device="cuda")])
    cache = ctx.kv_caches[0]
    ref_cache = cache.clone()
    torch_backend, triton_backend = TorchAttentionBackend(), TritonAttentionBackend()
    torch_backend.write_kv(ref_cache, k, v, ctx.slot_mapping, K_SCALE, V_SCALE)
    triton_backend.write_kv(cache, k, v, ctx.slot_mapping, K_SCALE, V_SCALE)
    assert torch.equal(cache.view(torch.uint8), ref_cache.view(torch.uint8))
    want = torch_backend.forward(q.float(), ref_cache, ctx, 0.08, K_SCALE, V_SCALE)
    got = triton_backend.forward(q, cache, ctx, 0.08, K_SCALE, V_SCALE)
    torch.testing.assert_close(got.float(), want, **{k: x * V_SCALE for k, x in TOL[dtype].items()})
    assert not got[t:].any()
