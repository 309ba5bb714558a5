"""Linear layers, sharded for tensor parallelism (Megatron style).

Column-parallel layers split the output features across ranks (no communication); row-parallel
layers split the input features and all-reduce the partial sums. Every parameter carries a
`weight_loader(param, loaded_weight, shard_id=None)` that copies this rank's slice of a full
checkpoint tensor into it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from conveyor.kernels import triton_available
from conveyor.kernels._util import Fp8Rows
from conveyor.worker.layers.activation import silu_and_mul
from conveyor.worker.layers.parallel import all_reduce, divide, tp_rank, tp_size

# NOTE: on the CPU, torch's F.linear (x W^T) of 2 to 4 rows takes a path 1.3-5x slower than
# W x^T (the vocabulary projection of the default model: 28 against 5 ms for 2 rows, slower than
# for 4 rows), so small batches multiply the other way round (docs/BENCHMARKS.md, "CPU")
CPU_TRANSPOSED_MAX_ROWS = 4


def _dense(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, weight, bias) of a full-precision weight, by the faster form on the CPU."""
    if not x.is_cuda and x.dim() == 2 and 1 < x.shape[0] <= CPU_TRANSPOSED_MAX_ROWS:
        y = torch.mm(weight, x.t()).t().contiguous()
        return y if bias is None else y + bias
    return F.linear(x, weight, bias)


def linear(x: torch.Tensor | Fp8Rows, weight: torch.Tensor, bias: torch.Tensor | None = None,
           silu_mul: bool = False, scale: torch.Tensor | None = None,
           zero: torch.Tensor | None = None, perm: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(silu_and_mul(x) if silu_mul else x, W, bias), W = weight, or weight * scale
    where the layer is quantized (weight int8 or float8_e4m3fn [N, K], scale float32 [N, G]).

    On CUDA with Triton, one row (single-stream decode) takes the skinny GEMM kernel, which
    streams the weight at near full bandwidth where cuBLAS's small-M kernels reach about a third
    of it, reads int8/fp8 weights as they are, and computes silu_mul while loading x. More rows:
    cuBLAS for full-precision weights, the W8A16 Triton GEMM for int8 (dequantize + cuBLAS from
    int8_gemm.CUBLAS_FROM_M rows), per-token fp8 activations and fp8 tensor cores for fp8
    (fp8_gemm: Triton tiles for decode batches on Hopper, torch._scaled_mm for prefill; the
    quantization applies silu_mul as it reads x; x may also arrive quantized, as Fp8Rows, where
    LinearBase.takes_fp8_rows said it may). On the CPU the quantized layers run the torch
    references. 4-bit weights (int32 words of 8 values, from an AWQ or GPTQ checkpoint) come with
    a zero point per group, and act-order GPTQ with the column order `perm`: the W4A16 Triton
    kernel on CUDA, dequantize-then-matmul elsewhere (kernels/w4a16_gemm.py).
    """
    if weight.dtype == torch.int32:
        from conveyor.kernels import w4a16_gemm

        if silu_mul:
            x = silu_and_mul(x)
        if x.is_cuda and triton_available() and w4a16_gemm.takes(x, weight, scale):
            return w4a16_gemm.w4a16_gemm(x, weight, scale, zero, bias, perm)
        return w4a16_gemm.w4a16_ref(x, weight, scale, zero, bias, perm)
    if isinstance(x, Fp8Rows):
        from conveyor.kernels import fp8_gemm

        return fp8_gemm.fp8_gemm(x, weight, scale, bias, silu_mul)
    gpu = x.is_cuda and triton_available()
    if gpu:
        from conveyor.kernels import skinny_gemm

        if skinny_gemm.takes(x, weight, scale):
            return skinny_gemm.skinny_gemm(x, weight, bias, silu_mul, scale)
    if gpu and scale is not None and weight.dtype == torch.float8_e4m3fn:
        from conveyor.kernels import fp8_gemm

        if fp8_gemm.takes(x, weight, scale, silu_mul):
            return fp8_gemm.fp8_gemm(x, weight, scale, bias, silu_mul)
    if silu_mul:
        x = silu_and_mul(x)
    if scale is None:
        return _dense(x, weight, bias)
    if weight.dtype == torch.float8_e4m3fn and scale.shape[1] > 1:
        # block-scaled fp8 checkpoints, run W8A16: the weight dequantized for this product
        from conveyor.kernels import dequantize

        w = (dequantize.dequantize if gpu else dequantize.dequantize_ref)(weight, scale, x.dtype)
        return _dense(x, w, bias)
    if weight.dtype == torch.int8:
        from conveyor.kernels import int8_gemm

        if gpu and int8_gemm.takes(x, weight, scale):
            if x.shape[0] < int8_gemm.CUBLAS_FROM_M:
                return int8_gemm.int8_gemm(x, weight, scale, bias)
            from conveyor.kernels.dequantize import dequantize

            return F.linear(x, dequantize(weight, scale, x.dtype), bias)
        return int8_gemm.int8_gemm_ref(x, weight, scale, bias)
    from conveyor.kernels.fp8_gemm import fp8_gemm_ref

    return fp8_gemm_ref(x, weight, scale, bias)


# and 4-bit words and MXFP4's scale bytes: never cast
_ONE_BYTE = (torch.int8, torch.float8_e4m3fn, torch.int32, torch.uint8)


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
    if param.shape != loaded_weight.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)}, "
                         f"checkpoint {tuple(loaded_weight.shape)}")
    if (param.dtype in _ONE_BYTE or loaded_weight.dtype in _ONE_BYTE) and (
            param.dtype != loaded_weight.dtype):
        raise ValueError(f"dtype mismatch: parameter {param.dtype}, checkpoint "
                         f"{loaded_weight.dtype} (1-byte weights load only from their own dtype)")
    param.data.copy_(loaded_weight)


def _parameter(shape: tuple[int, ...], dtype: torch.dtype, loader,
               device: torch.device | None = None) -> nn.Parameter:
    param = nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)
    param.weight_loader = loader
    return param


class LinearBase(nn.Module):
    """y = x W^T + b with W of shape [out_local, in_local]; subclasses say how to slice."""

    def __init__(self, in_local: int, out_local: int, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.weight = _parameter((out_local, in_local), dtype, self.weight_loader)
        self.bias = _parameter((out_local,), dtype, self.weight_loader) if bias else None
        self.register_parameter("weight_scale", None)   # [N, G] when quantized (quantization.py)
        self.register_parameter("weight_zero", None)    # [N, G]: 4-bit checkpoints' zero points
        self.register_parameter("weight_perm", None)    # [K]: GPTQ act-order's column order
        self.lora = None                 # a LoRALayer (layers/lora.py) with --enable-lora

    def weight_loader(self, param, loaded_weight, shard_id=None) -> None:
        default_weight_loader(param, loaded_weight)

    def make_quantized(self, dtype: torch.dtype, groups: int) -> None:
        """Load 1-byte weights (int8 from GGUF Q8_0, float8_e4m3fn from an fp8 checkpoint) and
        float32 scales [out_local, groups] from the checkpoint instead of full-precision
        weights. The scales are sliced like the weight (rows, or columns: whole groups) by the
        same weight_loader; one scale per row is never split by columns."""
        n, k = self.weight.shape
        device = self.weight.device
        self.weight = _parameter((n, k), dtype, self.weight_loader, device)
        self.weight_scale = _parameter((n, groups), torch.float32, self.weight_loader, device)

    def make_int4(self, groups: int, act_order: bool) -> None:
        """Load a 4-bit checkpoint's weights (worker/int4_checkpoint.py): int32 words of 8
        values [out_local, in_local / 8], float32 scales and zero points [out_local, groups],
        and with act_order the column order [in_local]. Sliced like the weight by the same
        loaders; the column order is one for the whole layer (q, k and v of a GPTQ checkpoint
        share it, their inputs being the same)."""
        n, k = self.weight.shape
        device = self.weight.device
        if k % 8 or k % groups:
            raise ValueError(f"a 4-bit layer needs its {k} inputs in whole words of 8 and "
                             f"{groups} groups")
        self.weight = _parameter((n, k // 8), torch.int32, self.weight_loader, device)
        self.weight_scale = _parameter((n, groups), torch.float32, self.weight_loader, device)
        self.weight_zero = _parameter((n, groups), torch.float32, self.weight_loader, device)
        if act_order:
            if isinstance(self, RowParallelLinear) and tp_size() > 1:
                raise ValueError("GPTQ act-order (desc_act) checkpoints are not supported with "
                                 "tensor parallelism: their row-parallel layers' groups span "
                                 "the ranks")
            self.weight_perm = _parameter((k,), torch.int64, _load_perm, device)

    def takes_fp8_rows(self, x: torch.Tensor) -> bool:
        """Whether forward(x) quantizes x per row for the fp8 tensor cores (an fp8 layer on the
        GPU, more than one row), so that the kernel before it may hand x over quantized, as
        Fp8Rows (RMSNorm(..., fp8=True))."""
        if (self.weight.dtype != torch.float8_e4m3fn or self.lora is not None
                or not (x.is_cuda and triton_available())):
            return False     # NOTE: LoRA's shrink reads x unquantized
        from conveyor.kernels import fp8_gemm, skinny_gemm

        return (not skinny_gemm.takes(x, self.weight, self.weight_scale)
                and fp8_gemm.takes(x, self.weight, self.weight_scale))

    def forward(self, x: torch.Tensor | Fp8Rows) -> torch.Tensor:
        return self._project(x, self.bias)

    def _project(self, x: torch.Tensor | Fp8Rows, bias: torch.Tensor | None,
               silu_mul: bool = False) -> torch.Tensor:
        """linear() of this layer's weight, plus its LoRA delta if it has adapters: from the
        one GEMM over [W; A] where A is stacked under W (rows then strided), else added by
        the LoRA layer's shrink and expand."""
        if self.lora is not None and self.lora.stacked is not None:
            return self.lora.stacked_forward(x, bias, silu_mul)
        y = linear(x, self.weight, bias, silu_mul, self.weight_scale, self.weight_zero,
                   self.weight_perm)
        return y if self.lora is None else self.lora(silu_and_mul(x) if silu_mul else x, y)


def _load_perm(param, loaded_weight, shard_id=None) -> None:
    """Act-order's column order: the same for every part of a fused layer (same input)."""
    if getattr(param, "loaded", False) and not torch.equal(param.data, loaded_weight):
        raise ValueError("the parts of a fused layer have different act-order column orders")
    default_weight_loader(param, loaded_weight)
    param.loaded = True


class ReplicatedLinear(LinearBase):
    """The whole layer on every rank."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 dtype: torch.dtype = torch.float32):
        super().__init__(input_size, output_size, bias, dtype)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; the output stays sharded."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 dtype: torch.dtype = torch.float32):
        super().__init__(input_size, divide(output_size, tp_size()), bias, dtype)

    def weight_loader(self, param, loaded_weight, shard_id=None) -> None:
        size = param.shape[0]
        default_weight_loader(param, loaded_weight.narrow(0, tp_rank() * size, size))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel layers on one input fused into one matmul (e.g. gate and up).

    Each rank holds [its slice of output 0, its slice of output 1, ...]; shard_id is the index of
    the sub-layer a checkpoint tensor belongs to.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False,
                 dtype: torch.dtype = torch.float32):
        self.output_sizes = [divide(s, tp_size()) for s in output_sizes]
        super().__init__(input_size, sum(output_sizes), bias, dtype)

    def weight_loader(self, param, loaded_weight, shard_id=None) -> None:
        size = self.output_sizes[shard_id]
        offset = sum(self.output_sizes[:shard_id])
        shard = loaded_weight.narrow(0, tp_rank() * size, size)
        default_weight_loader(param.narrow(0, offset, size), shard)


class QKVParallelLinear(ColumnParallelLinear):
    """The q, k and v projections fused; heads split across ranks.

    Each rank holds [q of its heads, k of its kv heads, v of its kv heads]. With fewer kv heads
    than ranks, each kv head is replicated on tp_size // num_kv_heads consecutive ranks.
    """

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, dtype: torch.dtype = torch.float32):
        tp = tp_size()
        self.head_dim = head_dim
        self.num_heads = divide(num_heads, tp)
        if num_kv_heads >= tp:
            self.num_kv_heads = divide(num_kv_heads, tp)
            self.kv_head_start = tp_rank() * self.num_kv_heads
        else:
            self.num_kv_heads = 1
            self.kv_head_start = tp_rank() // divide(tp, num_kv_heads)
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        out_total = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp
        super().__init__(hidden_size, out_total, bias, dtype)

    def weight_loader(self, param, loaded_weight, shard_id=None) -> None:
        if shard_id == "q":
            offset, size, start = 0, self.q_size, tp_rank() * self.q_size
        elif shard_id in ("k", "v"):
            offset = self.q_size + (self.kv_size if shard_id == "v" else 0)
            size, start = self.kv_size, self.kv_head_start * self.head_dim
        else:
            raise ValueError(f"QKV shard_id must be 'q', 'k' or 'v', got {shard_id!r}")
        default_weight_loader(param.narrow(0, offset, size), loaded_weight.narrow(0, start, size))


class RowParallelLinear(LinearBase):
    """Input features split across ranks (the input arrives sharded); partial sums all-reduced.

    The bias lives on every rank but is added once, on rank 0, before the reduction.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 dtype: torch.dtype = torch.float32, reduce_results: bool = True):
        super().__init__(divide(input_size, tp_size()), output_size, bias, dtype)
        # False: forward returns this rank's partial sums; the caller reduces them (fused into
        # the RMSNorm that follows: RMSNorm(..., reduce=True))
        self.reduce_results = reduce_results

    def weight_loader(self, param, loaded_weight, shard_id=None) -> None:
        if param.dim() == 1 or (param is not self.weight and loaded_weight.shape[1] == 1):
            default_weight_loader(param, loaded_weight)      # the bias; one scale per row
            return
        size = param.shape[1]
        default_weight_loader(param, loaded_weight.narrow(1, tp_rank() * size, size))

    def forward(self, x: torch.Tensor, silu_mul: bool = False) -> torch.Tensor:
        """silu_mul: x is a fused gate/up output [T, 2 * input_local]; the layer's input is
        silu(gate) * up (fused into the kernel's loads at decode sizes)."""
        # NOTE: with LoRA the delta is a partial sum like y: the same all-reduce adds it up
        y = self._project(x, self.bias if tp_rank() == 0 else None, silu_mul)
        if tp_size() > 1 and not y.is_contiguous():
            y = y.contiguous()   # a stacked layer's rows are strided: not for the all-reduce
        return all_reduce(y) if self.reduce_results else y
