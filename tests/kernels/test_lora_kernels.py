"""The multi-LoRA shrink and expand kernels against the torch reference: odd shapes, fused
slices of different widths, tokens of several adapters and of none, interleaved (decode) or in
runs (prefill chunks), ranks padded with zeros, bf16, fp16 and float32."""
import numpy as np
import pytest
import torch

from conveyor.kernels import interpreting

pytestmark = [pytest.mark.gpu, pytest.mark.interpreter]
DEV = "cpu" if interpreting() and not torch.cuda.is_available() else "cuda"

TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=2e-2, rtol=2e-2),
       torch.bfloat16: dict(atol=6e-2, rtol=6e-2)}


def run_both(dtype, num_tokens, slices, k, slots, rank, token_slots):
    from conveyor.kernels.lora import group_by_slot, lora_expand, lora_ref, lora_shrink

    g = torch.Generator(device=DEV).manual_seed(0)
    x = torch.randn(num_tokens, k, device=DEV, generator=g).to(dtype)
    A = torch.zeros(slots, len(slices), 16 if rank <= 16 else 64, k, device=DEV, dtype=dtype)
    A[:, :, :rank] = (torch.randn(slots, len(slices), rank, k, device=DEV, generator=g)
                      / k ** 0.5).to(dtype)
    B = torch.zeros(slots, sum(slices), A.shape[2], device=DEV, dtype=dtype)
    B[:, :, :rank] = torch.randn(slots, sum(slices), rank, device=DEV, generator=g).to(dtype)
    y = torch.randn(num_tokens, sum(slices), device=DEV, generator=g).to(dtype)
    ts = np.asarray(token_slots, dtype=np.int64)
    order, starts = group_by_slot(ts, slots)
    order_d, starts_d = torch.from_numpy(order).to(DEV), torch.from_numpy(starts).to(DEV)
    offsets = torch.tensor(np.concatenate([[0], np.cumsum(slices)]), dtype=torch.int32,
                           device=DEV)
    got = y.clone()
    h = lora_shrink(x, A, order_d, starts_d)
    lora_expand(got, h, B, offsets, max(slices), order_d, starts_d)
    want = lora_ref(y.clone(), x, A, B, list(slices), torch.from_numpy(ts).to(DEV),
                    sorted(set(token_slots) - {-1}))
    return got, want


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("num_tokens,slices,k", [
    (1, [96, 32, 32], 64),                 # one decode, qkv-like
    (7, [123], 77),                        # odd widths, one slice (o / down)
    (37, [200, 200], 130),                 # gate/up-like
    (300, [512, 128, 128], 256),           # a prefill-sized step (BLOCK_M 64)
    (5, [64, 48], 1100),                   # K in three parts summed by atomics (split-K)
])
@pytest.mark.parametrize("rank", [4, 16, 40])
def test_decode_tokens_interleaved(dtype, num_tokens, slices, k, rank):
    """Every token picks its slot at random (-1: the base)."""
    rng = np.random.default_rng(num_tokens)
    token_slots = rng.integers(-1, 4, num_tokens).tolist()
    got, want = run_both(dtype, num_tokens, slices, k, 4, rank, token_slots)
    torch.testing.assert_close(got, want, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_prefill_runs_and_base_only(dtype):
    """Runs of one adapter (prefill chunks), a slot with no tokens, then a step of no adapter
    (the delta is zero: y unchanged)."""
    token_slots = [2] * 70 + [-1] * 13 + [0] * 5 + [2] * 31
    got, want = run_both(dtype, len(token_slots), [160, 48, 48], 96, 3, 8, token_slots)
    torch.testing.assert_close(got, want, **TOL[dtype])
    got, want = run_both(dtype, 9, [64], 32, 3, 8, [-1] * 9)
    torch.testing.assert_close(got, want, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_tokens,slices,k", [(1, [96, 32, 32], 64), (37, [123], 77),
                                                 (300, [200, 200], 130)])
def test_expand_of_a_stacked_gemm(dtype, num_tokens, slices, k):
    """The shrink as the extra columns of one GEMM over [W; A of every slot] (layers/lora.py):
    the expand reads each token's own slot from h [T, S, slices, R] whose rows are strided, and
    adds into y, the output's first columns (strided too); equal to the reference on x."""
    from conveyor.kernels.lora import group_by_slot, lora_expand, lora_ref

    slots, rank = 3, 16
    g = torch.Generator(device=DEV).manual_seed(num_tokens)
    n = sum(slices)
    x = torch.randn(num_tokens, k, device=DEV, generator=g).to(dtype)
    W = (torch.randn(n, k, device=DEV, generator=g) / k ** 0.5).to(dtype)
    A = (torch.randn(slots, len(slices), rank, k, device=DEV, generator=g) / k ** 0.5).to(dtype)
    B = torch.randn(slots, n, rank, device=DEV, generator=g).to(dtype)
    ts = np.random.default_rng(num_tokens).integers(-1, slots, num_tokens)
    order, starts = (torch.from_numpy(a).to(DEV) for a in group_by_slot(ts, slots))
    offsets = torch.tensor(np.concatenate([[0], np.cumsum(slices)]), dtype=torch.int32,
                           device=DEV)
    out = x @ torch.cat([W, A.reshape(-1, k)]).T                      # [T, n + S * slices * R]
    y, h = out[:, :n], out[:, n:].view(num_tokens, slots, len(slices), rank)
    want = lora_ref(x @ W.T, x, A, B, slices, torch.from_numpy(ts).to(DEV),
                    sorted(set(ts.tolist()) - {-1}))
    got = lora_expand(y, h, B, offsets, max(slices), order, starts)
    torch.testing.assert_close(got, want, **TOL[dtype])


def test_graph_replay_reads_new_slots():
    """Captured once with no adapter, replayed with new slot assignments copied into the same
    buffers: the replay follows the buffers (as StepGraphs does)."""
    if DEV == "cpu":
        pytest.skip("CUDA graphs need a GPU")
    from conveyor.kernels.lora import group_by_slot, lora_expand, lora_ref, lora_shrink

    t, k, slices, slots = 16, 64, [48], 2
    x = torch.randn(t, k, device=DEV, dtype=torch.bfloat16)
    A = torch.randn(slots, 1, 16, k, device=DEV, dtype=torch.bfloat16) / 8
    B = torch.randn(slots, 48, 16, device=DEV, dtype=torch.bfloat16)
    offsets = torch.tensor([0, 48], dtype=torch.int32, device=DEV)
    order = torch.zeros(t, dtype=torch.long, device=DEV)
    starts = torch.zeros(slots + 1, dtype=torch.long, device=DEV)
    y = torch.zeros(t, 48, device=DEV, dtype=torch.bfloat16)

    def step():
        y.zero_()
        lora_expand(y, lora_shrink(x, A, order, starts), B, offsets, 48, order, starts)

    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    ts = np.array([1, 0, -1, 1] * 4)
    o, s = group_by_slot(ts, slots)
    order.copy_(torch.from_numpy(o))
    starts.copy_(torch.from_numpy(s))
    graph.replay()
    want = lora_ref(torch.zeros_like(y), x, A, B, slices, torch.from_numpy(ts).to(DEV), [0, 1])
    torch.testing.assert_close(y, want, **TOL[torch.bfloat16])
