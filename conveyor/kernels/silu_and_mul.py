"""SiLU-and-multiply of a fused gate/up projection: x [T, 2I] -> silu(x[:, :I]) * x[:, I:]."""
import torch
import torch.nn.functional as F

from conveyor.kernels._triton import grid_sync, jit, pdl_args, require_triton, tl
from conveyor.kernels._util import check

_BLOCK = 1024


@jit
def silu_mul(gate, up, dtype: tl.constexpr):
    """silu(gate) * up in float32, rounded to dtype: the one formula of every kernel that
    applies the MLP's activation (here, the skinny GEMV's loads, the fp8 quantization's)."""
    gate = gate.to(tl.float32)
    return (gate / (1.0 + tl.exp(-gate)) * up.to(tl.float32)).to(dtype)


@jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, INTER: tl.constexpr,
                         BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    grid_sync(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTER
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + INTER + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_o + cols, silu_mul(gate, up, out_ptr.dtype.element_ty),
             mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    require_triton()
    check(x.dim() == 2 and x.shape[1] % 2 == 0 and x.stride(1) == 1,
          f"x must be [T, 2 * I] with unit column stride, got {tuple(x.shape)}")
    t, i = x.shape[0], x.shape[1] // 2
    out = torch.empty((t, i), dtype=x.dtype, device=x.device)
    if t:
        _silu_and_mul_kernel[(t, -(-i // _BLOCK))](x, out, x.stride(0), out.stride(0),
                                                          INTER=i, BLOCK=_BLOCK, num_warps=4,
                                                          **pdl_args())
    return out


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of x [.., 2I] in float32, rounded once to x's dtype: the torch form of
    silu_mul, for the references of the kernels that fuse it."""
    gate, up = x.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)
