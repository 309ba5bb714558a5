"""gpt-oss's clamped SwiGLU of a fused gate/up projection: x [T, 2I] (gate columns, then up)
-> (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit); in float32,
rounded once to x's dtype. The activation of the fused-MoE path where the model asks for it
(kernels/fused_moe.py), as silu_and_mul is everyone else's."""
import torch

from conveyor.kernels._triton import grid_sync, jit, pdl_args, require_triton, tl
from conveyor.kernels._util import check

_BLOCK = 1024


@jit
def _clamped_swiglu_kernel(x_ptr, out_ptr, stride_x, stride_o, alpha, limit,
                           INTER: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    grid_sync(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTER
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + INTER + cols, mask=mask, other=0.0).to(tl.float32)
    gate = tl.minimum(gate, limit)
    up = tl.minimum(tl.maximum(up, -limit), limit)
    out = (up + 1.0) * (gate * tl.sigmoid(gate * alpha))
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def clamped_swiglu(x: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    require_triton()
    check(x.dim() == 2 and x.shape[1] % 2 == 0 and x.stride(1) == 1,
          f"x must be [T, 2 * I] with unit column stride, got {tuple(x.shape)}")
    check(limit > 0, f"limit must be positive, got {limit}")
    t, i = x.shape[0], x.shape[1] // 2
    out = torch.empty((t, i), dtype=x.dtype, device=x.device)
    if t:
        _clamped_swiglu_kernel[(t, -(-i // _BLOCK))](x, out, x.stride(0), out.stride(0),
                                                     float(alpha), float(limit), INTER=i,
                                                     BLOCK=_BLOCK, num_warps=4, **pdl_args())
    return out


def clamped_swiglu_ref(x: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """The torch form, in x's dtype, in transformers' order of operations (GptOssExperts)."""
    gate, up = x.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))
