"""The MoE pieces that run on the CPU: routing, the per-expert sort and padding of the fused
kernels (`align`), and tensor-parallel sharding of the experts' intermediate dimension."""
import pytest
import torch

from conveyor.kernels.fused_moe import align, fused_moe_ref, route
from conveyor.worker.layers import moe


@pytest.mark.parametrize("t,experts,top_k,block_m", [(1, 8, 2, 16), (37, 5, 3, 16),
                                                     (300, 64, 8, 64), (9, 128, 1, 4)])
def test_align_sorts_and_pads_per_expert(t, experts, top_k, block_m):
    gen = torch.Generator().manual_seed(t)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(t)]).int()
    sorted_ids, expert_ids, total = align(ids, experts, block_m)
    n = t * top_k
    flat = ids.reshape(-1)
    assert sorted_ids.shape[0] % block_m == 0 and int(total) <= sorted_ids.shape[0]
    assert int(total) % block_m == 0
    real = sorted_ids[:int(total)]
    assert sorted(real[real < n].tolist()) == list(range(n))      # every pair once
    assert (sorted_ids[int(total):] == n).all()
    for tile in range(int(total) // block_m):
        pairs = sorted_ids[tile * block_m:(tile + 1) * block_m]
        pairs = pairs[pairs < n].long()
        assert len(pairs) > 0 and (flat[pairs] == expert_ids[tile]).all()
    counts = torch.bincount(flat.long(), minlength=experts)
    assert int(total) == int(((counts + block_m - 1) // block_m * block_m).sum())


def test_route_renormalises_where_asked():
    logits = torch.randn(6, 9)
    w, ids = route(logits, 3, True, torch.float32)
    torch.testing.assert_close(w.sum(-1), torch.ones(6))
    w2, ids2 = route(logits, 3, False, torch.float32)
    assert torch.equal(ids, ids2) and (w2.sum(-1) < 1).all()
    assert torch.equal(ids.long(), logits.topk(3).indices)


def test_tensor_parallel_shards_sum_to_the_whole(monkeypatch):
    """Two ranks' experts, each with half of every expert's intermediate dimension, give
    partial sums that add up to the unsharded layer's output."""
    gen = torch.Generator().manual_seed(0)
    experts, h, inter, top_k = 4, 16, 12, 2
    full = {(e, p): torch.randn(h if p == 2 else inter, inter if p == 2 else h, generator=gen)
            for e in range(experts) for p in range(3)}

    def build(rank, size):
        monkeypatch.setattr(moe, "tp_rank", lambda: rank)
        monkeypatch.setattr(moe, "tp_size", lambda: size)
        layer = moe.FusedMoE(experts, top_k, h, inter, True, torch.float32)
        for (e, p), w in full.items():
            layer.weight_loader(layer.w2 if p == 2 else layer.w13, w, (e, p))
        return layer

    x, logits = torch.randn(5, h, generator=gen), torch.randn(5, experts, generator=gen)
    whole = build(0, 1)(x, logits)
    parts = build(0, 2)(x, logits) + build(1, 2)(x, logits)
    torch.testing.assert_close(parts, whole, atol=1e-5, rtol=1e-5)
    w, ids = route(logits, top_k, True, torch.float32)
    w13 = torch.stack([torch.cat([full[e, 0], full[e, 1]]) for e in range(experts)])
    w2 = torch.stack([full[e, 2] for e in range(experts)])
    torch.testing.assert_close(whole, fused_moe_ref(x, w13, w2, w, ids))
