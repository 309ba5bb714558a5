"""Weight quantization at load time: int8 (W8A16) and fp8 e4m3 (W8A8), one scale per output row.

A layer is quantized after its full-precision weight is loaded (and sharded) by the usual
weight loaders: its `weight` becomes int8 or float8_e4m3fn [N, K] and a float32 `weight_scale`
[N, G] appears beside it (G = 1, or K / 32 for GGUF Q8_0 blocks kept as they are); the layer's
forward passes both to `linear()`, which picks the kernel. Layers whose names match a
--keep-precision pattern stay in the model's dtype. The embedding is a gather: quantized, it
saves memory only, and its rows are dequantized as they are looked up.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field

import torch
from torch import nn

from conveyor.kernels._util import FP8_MAX

log = logging.getLogger("conveyor.quantization")

INT8_MAX = 127.0
Q8_0_GROUP = 32                     # GGUF Q8_0: 32 int8 values and one fp16 scale per block
_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


def quantize_weight(w: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (q [N, K] int8 or float8_e4m3fn, scale [N, 1] float32), symmetric per row:
    scale = amax(|row|) / 127 (int8, q rounded to nearest) or / 448 (fp8, the e4m3 maximum).
    An all-zero row gets scale 1 (its q is zero anyway)."""
    if mode not in _DTYPES:
        raise ValueError(f"mode must be 'int8' or 'fp8', got {mode!r}")
    if w.dim() != 2:
        raise ValueError(f"w must be [N, K], got {tuple(w.shape)}")
    w = w.float()
    amax = torch.linalg.vector_norm(w, ord=float("inf"), dim=1, keepdim=True)   # no |w| copy
    scale = torch.where(amax > 0, amax / (INT8_MAX if mode == "int8" else FP8_MAX), 1.0)
    if mode == "int8":
        q = (w / scale).round_().clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    else:
        q = (w / scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def keep_matches(name: str, patterns: tuple[re.Pattern, ...]) -> bool:
    """Whether module `name` (e.g. model.layers.3.mlp.down_proj) stays in the model's dtype."""
    return any(p.search(name) for p in patterns)


def quantizable(module: nn.Module) -> bool:
    """Linear layers (the LM head too) and the embedding: modules with a 2-D `weight` that
    forward through linear() or a row gather and know a `weight_scale`."""
    return hasattr(module, "weight_scale") and getattr(module, "weight", None) is not None


@dataclass
class QuantReport:
    """What load-time quantization did, for the log line and LLM.quantization_report."""
    # "int8" | "fp8", or a checkpoint's: "fp8" | "int8" | "awq" | "gptq" | "mxfp4"
    mode: str
    dtype: str                                  # the model's (activation) dtype
    quantized: list[str] = field(default_factory=list)     # per-row scales, quantized here
    # loaded quantized: GGUF Q8_0 blocks kept in int8, or a quantized checkpoint's layers
    prequantized: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)          # --keep-precision, or left so by
    #                                                        a quantized checkpoint
    bytes_before: int = 0                       # of the weights of quantized/prequantized layers
    bytes_after: int = 0                        # the same layers: 1-byte weights + scales
    from_checkpoint: bool = False               # the checkpoint came quantized (not GGUF)

    def loaded(self, name: str, weights: tuple, extras: tuple) -> None:
        """Count a layer loaded quantized: its weights (a 4-bit word holds 8 values) against
        their bytes in the model dtype, and what they take with their scales and zeros."""
        self.prequantized.append(name)
        values = sum(w.numel() * (8 if w.dtype == torch.int32 else 1) for w in weights)
        self.bytes_before += values * getattr(torch, self.dtype).itemsize
        self.bytes_after += sum(_nbytes(t) for t in (*weights, *extras) if t is not None)

    def summary(self) -> str:
        parts = [f"{self.mode}: quantized {len(self.quantized)} layers"]
        if self.prequantized and self.from_checkpoint:
            parts.append(f"loaded {len(self.prequantized)} layers in {self.mode} from the "
                         f"checkpoint")
        elif self.prequantized:
            parts.append(f"kept {len(self.prequantized)} GGUF Q8_0 layers in int8 "
                         f"(group {Q8_0_GROUP})")
        mib = f"({self.bytes_before / 2**20:,.1f} MiB -> {self.bytes_after / 2**20:,.1f} MiB)"
        kept = ", ".join(self.kept) if self.kept else "none"
        return f"{', '.join(parts)} {mib}; kept in {self.dtype}: {kept}"


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def resolve_mode(requested: str | None, checkpoint: str | None) -> str | None:
    """The quantization to run: --quantization, or the checkpoint's own (an fp8 checkpoint
    loads as fp8, an AWQ, GPTQ or MXFP4 one in 4 bits; asking for another mode is an
    error)."""
    if checkpoint is None or requested in (None, checkpoint):
        return checkpoint or requested
    raise ValueError(f"the checkpoint is already quantized ({checkpoint}): leave quantization "
                     f"unset or set it to {checkpoint!r}, not {requested!r}")


def quantize_model(model: nn.Module, mode: str | None, keep: tuple[re.Pattern, ...],
                   device: torch.device | str, from_checkpoint: bool = False
                   ) -> QuantReport | None:
    """Quantize `model`'s layers one at a time on `device` and move the model there.

    from_checkpoint: the checkpoint came quantized (fp8 or int8): its quantized layers are
    reported and the layers it left in full precision stay so.

    The model may sit on the CPU (load_model builds it there when quantizing on a GPU): each
    layer's full-precision weight goes to the device, is quantized there, and its host copy is
    dropped, so the GPU never holds more than one layer in full precision. A weight shared by
    two modules (tied embedding and LM head) is quantized once. Returns None without a mode.
    """
    device = torch.device(device)
    if mode is None:
        return None
    report = QuantReport(mode, str(next(model.parameters()).dtype).removeprefix("torch."),
                         from_checkpoint=from_checkpoint)
    done: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}    # id(original weight) -> result
    for name, module in model.named_modules():
        if hasattr(module, "quantize") and hasattr(module, "w13"):   # experts (layers/moe.py)
            if module.w13_scale is not None:                     # loaded quantized
                report.loaded(name, (module.w13, module.w2), (
                    module.w13_scale, module.w2_scale, module.w13_zero, module.w2_zero))
                continue
            if from_checkpoint or keep_matches(name, keep):
                report.kept.append(name)
                continue
            before, after = module.quantize(mode, device)
            report.bytes_before += before
            report.bytes_after += after
            report.quantized.append(name)
            continue
        if not quantizable(module):
            continue
        weight = module.weight
        if module.weight_scale is not None:                      # loaded quantized (Q8_0)
            report.loaded(name, (weight,), (module.weight_scale, module.weight_zero))
            module.to(device)
            continue
        if from_checkpoint or keep_matches(name, keep) or getattr(module, "keep_precision",
                                                                   False):
            report.kept.append(name)
            continue
        if id(weight) not in done:
            q, scale = quantize_weight(weight.data.to(device), mode)
            done[id(weight)] = (nn.Parameter(q, requires_grad=False),
                                nn.Parameter(scale, requires_grad=False))
            report.bytes_before += _nbytes(weight)
            report.bytes_after += _nbytes(q) + _nbytes(scale)
        module.weight, module.weight_scale = done[id(weight)]
        report.quantized.append(name)
    model.to(device)
    log.info("%s", report.summary())
    return report


def check_device(mode: str | None, device: torch.device) -> None:
    """fp8 runs on fp8 tensor cores (compute capability 8.9+), or on the CPU through the float32
    reference (slow: for tests and quality checks); an older GPU is refused at start."""
    if mode == "fp8" and device.type == "cuda":
        from conveyor.kernels.fp8_gemm import supported

        if not supported(device):
            cap = ".".join(map(str, torch.cuda.get_device_capability(device)))
            raise ValueError(f"quantization='fp8' needs a GPU with fp8 tensor cores (compute "
                             f"capability 8.9+, e.g. L4, H100); this one is {cap}: use "
                             f"quantization='int8'")
