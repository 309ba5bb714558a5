"""The one-shot all-reduce kernel (kernels/all_reduce.py) against its torch reference, with W
ranks emulated on one GPU: each rank has its own buffer and counters and launches on its own
stream, so the W kernels run at once and wait for each other's flags as separate GPUs do (the
peers' buffers are plain device memory here instead of NVLink mappings). Two real GPUs:
tests/e2e/test_gpu_all_reduce.py.

Checks: the sum is exact (float32 in rank order, rounded once) and bitwise the same on every
rank; the fused residual add is exact and the fused RMSNorm within rounding; calls of changing
shapes queued back to back without a host sync (the parity of the receive slots, the flags'
counts); replays of a CUDA graph; strided rows, odd ranks, bf16 and fp16.
"""
import pytest
import torch

pytestmark = pytest.mark.gpu

MAX_BYTES = 1 << 20
TOL = {torch.float16: dict(atol=2e-3, rtol=2e-3), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


class Ranks:
    """W emulated ranks on one GPU."""

    def __init__(self, world: int):
        from conveyor.kernels.all_reduce import FLAG_BYTES, MAX_ROWS, buffer_bytes

        self.world = world
        self.buffers = [torch.empty(buffer_bytes(world, MAX_BYTES), dtype=torch.uint8,
                                    device="cuda") for _ in range(world)]
        for b in self.buffers:
            b[:FLAG_BYTES].zero_()
            b[FLAG_BYTES:].fill_(0xFF)          # stale data must never be summed
        self.bases = torch.tensor([b.data_ptr() for b in self.buffers], dtype=torch.int64,
                                  device="cuda")
        self.counters = [torch.zeros(MAX_ROWS, dtype=torch.int32, device="cuda")
                         for _ in range(world)]
        self.streams = [torch.cuda.Stream() for _ in range(world)]

    def call(self, parts, weight=None, residual=None, eps=1e-6):
        """Every rank's result of one call (queued on the ranks' streams, not waited for)."""
        from conveyor.kernels.all_reduce import one_shot_all_reduce

        out = []
        main = torch.cuda.current_stream()
        for r, stream in enumerate(self.streams):
            stream.wait_stream(main)
            with torch.cuda.stream(stream):
                out.append(one_shot_all_reduce(parts[r], self.bases, self.counters[r], r,
                                               MAX_BYTES, weight, eps, residual))
        for stream in self.streams:
            main.wait_stream(stream)
        return out


def assert_result(got, parts, weight=None, residual=None, eps=1e-6):
    from conveyor.kernels.all_reduce import one_shot_all_reduce_ref

    want = one_shot_all_reduce_ref(parts, weight, eps, residual)
    for g in got[1:]:                                    # every rank, the same bits
        for a, b in zip(g if isinstance(g, tuple) else (g,),
                        got[0] if isinstance(got[0], tuple) else (got[0],)):
            assert torch.equal(a, b)
    if weight is None:
        torch.testing.assert_close(got[0], want, atol=0, rtol=0)
        return
    if residual is not None:
        torch.testing.assert_close(got[0][1], want[1], atol=0, rtol=0)
        got, want = [g[0] for g in got], want[0]
    torch.testing.assert_close(got[0], want, **TOL[want.dtype])


def inputs(world, rows, cols, dtype, stride_pad=0):
    return [(torch.randn(rows, cols + stride_pad, device="cuda") * 2).to(dtype)[:, :cols]
            for _ in range(world)]


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,cols,pad", [(1, 4096, 0), (7, 1032, 24), (64, 8192, 0)])
def test_sum_matches_the_reference_on_every_rank(world, dtype, rows, cols, pad):
    ranks = Ranks(world)
    for _ in range(3):                                   # both parities, and back again
        parts = inputs(world, rows, cols, dtype, pad)
        assert_result(ranks.call(parts), parts)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_fused_residual_add_and_rms_norm(dtype, with_residual):
    ranks = Ranks(2)
    for rows, cols in [(1, 4096), (5, 1000), (33, 2048)]:
        parts = inputs(2, rows, cols, dtype)
        weight = torch.randn(cols, dtype=dtype, device="cuda")
        residual = torch.randn(rows, cols, dtype=dtype, device="cuda") if with_residual else None
        assert_result(ranks.call(parts, weight, residual, 1e-5), parts, weight, residual, 1e-5)


def test_calls_queued_back_to_back_with_changing_shapes():
    """60 calls without a host sync between them: a rank may run ahead of another by a whole
    call, which is what the slot parity and the flags' counts are for."""
    ranks = Ranks(2)
    calls = []
    for i in range(60):
        rows = (1, 17, 4, 64, 3)[i % 5]
        parts = inputs(2, rows, 2048, torch.bfloat16)
        calls.append((parts, ranks.call(parts)))
    torch.cuda.synchronize()
    for parts, got in calls:
        assert_result(got, parts)


def test_cuda_graph_replays():
    ranks = Ranks(2)
    static = inputs(2, 8, 4096, torch.bfloat16)
    weight = torch.randn(4096, dtype=torch.bfloat16, device="cuda")
    ranks.call(static)                                   # compile outside the capture
    ranks.call(static, weight)
    torch.cuda.synchronize()
    graphs, outs = [], []
    for r, stream in enumerate(ranks.streams):
        from conveyor.kernels.all_reduce import one_shot_all_reduce

        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=stream):
            a = one_shot_all_reduce(static[r], ranks.bases, ranks.counters[r], r, MAX_BYTES)
            b = one_shot_all_reduce(a, ranks.bases, ranks.counters[r], r, MAX_BYTES, weight)
        graphs.append(g)
        outs.append((a, b))
    for _ in range(3):
        parts = inputs(2, 8, 4096, torch.bfloat16)
        for s, p in zip(static, parts):
            s.copy_(p)
        torch.cuda.synchronize()
        for g, stream in zip(graphs, ranks.streams):
            with torch.cuda.stream(stream):
                g.replay()
        torch.cuda.synchronize()
        total = [o[0] for o in outs]
        assert_result(total, parts)
        # the second all-reduce sums W copies of the first's result, then normalises
        assert_result([o[1] for o in outs], [total[0]] * 2, weight)


def test_bad_input_is_refused():
    from conveyor.kernels.all_reduce import MAX_ROWS, one_shot_all_reduce

    ranks = Ranks(2)
    x = torch.zeros(2, 1024, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="one-shot limit"):
        one_shot_all_reduce(torch.zeros(MAX_ROWS + 1, 8, dtype=torch.bfloat16, device="cuda"),
                            ranks.bases, ranks.counters[0], 0, MAX_BYTES)
    with pytest.raises(ValueError, match="16-byte"):
        one_shot_all_reduce(x[:, :1020], ranks.bases, ranks.counters[0], 0, MAX_BYTES)
    with pytest.raises(ValueError, match="dtype"):
        one_shot_all_reduce(x.float(), ranks.bases, ranks.counters[0], 0, MAX_BYTES)
    with pytest.raises(ValueError, match="rank"):
        one_shot_all_reduce(x, ranks.bases, ranks.counters[0], 2, MAX_BYTES)
