"""fp8 W8A8 GEMM: y = (q_x * s_x) @ (W * s_w)^T + bias, with x quantized per token on the fly
(quant_fp8.py) and W float8_e4m3fn [N, K] quantized per output row at load (s_w [N, 1]).

The product runs on the fp8 tensor cores through torch._scaled_mm with row-wise scales (scale_a
[M, 1], scale_b [1, N], float32; cuBLASLt applies them in its epilogue), which wants K and N
multiples of 16, W^T column-major (W [N, K] row-major is exactly that) and a bfloat16 output;
fp16 models get the bf16 result cast. Needs compute capability 8.9+ (Ada, Hopper).

x may come quantized already (Fp8Rows, from the RMSNorm kernel before the layer), or be the
MLP's gate/up output with silu_mul, which the quantization kernel applies as it reads it.
"""
import torch

from conveyor.kernels._util import Fp8Rows, check
from conveyor.kernels.quant_fp8 import MAX_K, quant_fp8, quant_fp8_ref


def supported(device: torch.device) -> bool:
    """Whether the device has fp8 tensor cores (compute capability 8.9 or newer)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def takes(x: torch.Tensor | Fp8Rows, weight: torch.Tensor, scale: torch.Tensor,
          silu_mul: bool = False) -> bool:
    """Whether fp8_gemm takes this product; x may be Fp8Rows (never with silu_mul)."""
    n, k = weight.shape
    if isinstance(x, Fp8Rows):
        x_ok = x.q.dtype == torch.float8_e4m3fn and x.shape[-1] == k and not silu_mul
        x = x.q
    else:
        x_ok = (x.dtype in (torch.float16, torch.bfloat16)
                and x.shape[-1] == (2 * k if silu_mul else k))
    return (x_ok and x.is_cuda and x.dim() == 2 and x.stride(-1) == 1
            and weight.dtype == torch.float8_e4m3fn
            and weight.is_contiguous() and k % 16 == 0 and n % 16 == 0 and k <= MAX_K
            and scale.shape == (n, 1) and scale.dtype == torch.float32 and scale.is_contiguous())


def fp8_gemm(x: torch.Tensor | Fp8Rows, weight: torch.Tensor, scale: torch.Tensor,
             bias: torch.Tensor | None = None, silu_mul: bool = False) -> torch.Tensor:
    """x [M, K] @ (weight [N, K] fp8 * scale [N, 1])^T + bias [N] -> y [M, N] in x's dtype.

    x: a tensor, or Fp8Rows quantized for this layer (rms_norm(fp8=True)).
    silu_mul: x is [M, 2K], gate then up, and the product is of silu(gate) * up."""
    check(takes(x, weight, scale, silu_mul), f"fp8_gemm takes x [M, K] fp16/bf16 on CUDA "
          f"([M, 2K] with silu_mul) or Fp8Rows [M, K] (without), weight [N, K] float8_e4m3fn "
          f"contiguous with K, N multiples of 16 (K at most {MAX_K}) and scale float32 [N, 1]; "
          f"got x {tuple(x.shape)} {x.q.dtype if isinstance(x, Fp8Rows) else x.dtype}"
          f"{' with silu_mul' if silu_mul else ''}, weight {tuple(weight.shape)} "
          f"{weight.dtype}, scale {tuple(scale.shape)} {scale.dtype}")
    if isinstance(x, Fp8Rows):
        return _scaled_mm(x.q, x.scale, weight, scale, bias, x.dtype)
    return _scaled_mm(*quant_fp8(x, silu_mul), weight, scale, bias, x.dtype)


def _scaled_mm(q: torch.Tensor, s: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
               bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    if q.shape[0] == 0:
        return q.new_empty(0, weight.shape[0], dtype=dtype)
    y = torch._scaled_mm(q, weight.t(), scale_a=s, scale_b=scale.view(1, -1),
                         out_dtype=torch.bfloat16)
    if bias is not None:      # in float32: the bf16 output is rounded once already
        return (y.float() + bias.float()).to(dtype)
    return y.to(dtype)


def fp8_gemm_ref(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """The same arithmetic in float32: x rounded to fp8 per token as the kernel does, both
    operands scaled back, one matmul, rounded once (also the CPU path of fp8 models)."""
    q, s = quant_fp8_ref(x)
    y = (q.float() * s) @ (weight.float() * scale).T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
