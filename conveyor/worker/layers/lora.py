"""The LoRA delta of one linear layer, for every adapter slot at once (worker/lora.py fills it).

A LoRA-capable linear layer (LinearBase) holds a `LoRALayer` as `.lora`; its forward adds
`lora(x, y)` to its output: for each token, (x A_s^T) B_s^T of the adapter in its device slot s,
nothing for tokens of the base model. A fused layer (qkv_proj: q, k, v; gate_up_proj: gate, up)
has one A and one block of B's rows per slice. Sharded as the base layer is: column-parallel
layers keep A whole and their rows of B, row-parallel ones their columns of A and B whole; so a
row-parallel layer's delta is a partial sum like its output, and the same all-reduce adds them.

Where the base weight is a plain float matrix, A rides under it: the layer holds one matrix
[W; A of every slot] (its weight and bias are views of the first rows), so one GEMM gives the
base output and every slot's shrink x A_s^T side by side, and only the expand is a kernel of its
own (each token reading its slot's shrink). That saves a shrink launch per layer and, for the
down projection, writing out silu(gate) * up a second time; the extra columns cost about
max_loras * slices * R / N of the GEMM, so it is done only up to STACK_MAX_SHARE of N. Quantized
base weights, and layers past that share, keep a shrink kernel reading x.

Which slot each token uses comes from the step's `LoRABatch`, set for the forward pass by
`LoRAState.step` (the model runner, or StepGraphs while capturing: then its tensors are the
graphs' static buffers).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from conveyor.kernels import triton_available
from conveyor.worker.layers.linear import linear


@dataclass
class LoRABatch:
    token_slots: torch.Tensor        # [T] int64: each token's adapter slot, -1: none
    order: torch.Tensor              # [T] int64: token rows grouped by slot (kernels/lora.py)
    starts: torch.Tensor             # [slots + 1] int64: slot s's rows are order[starts[s]:...]
    slots: list[int] | None          # the slots that occur (host side); None: unknown (graphs)


class LoRAState:
    """The current step's LoRABatch, shared by every LoRA layer of a model."""

    def __init__(self) -> None:
        self.batch: LoRABatch | None = None

    @contextlib.contextmanager
    def step(self, batch: LoRABatch | None):
        if self.batch is not None:
            raise RuntimeError("LoRAState.step does not nest")
        self.batch = batch
        try:
            yield
        finally:
            self.batch = None


# NOTE: A is stacked under W only while its rows add at most this share of W's: every step's
# GEMM computes every slot's shrink, so many slots of a high rank (32 slots of rank 64 would
# double a qkv projection) cost more than the shrink kernel, which computes a token's own slot
# only. At 1/8 a decode step's GEMM grows by about what a shrink launch costs (5-6 us on an
# H200 at the Llama-3.1-8B shape); 8 slots of rank 16 (6 % on qkv) measured a gain.
STACK_MAX_SHARE = 0.125


class LoRALayer:
    def __init__(self, state: LoRAState, num_slots: int, slice_sizes: list[int], in_local: int,
                 rank: int, dtype: torch.dtype, device: torch.device, base=None):
        """base: the LinearBase it belongs to; A is stacked under its weight if that is a plain
        float matrix [N, in_local] (N the slices' sum)."""
        self.state = state
        self.slice_sizes = slice_sizes
        n = self.n = sum(slice_sizes)
        self.stacked: torch.Tensor | None = None      # [W; A] with A's rows under W's
        self.stacked_bias: torch.Tensor | None = None
        extra = num_slots * len(slice_sizes) * rank
        if (base is not None and base.weight_scale is None and extra <= STACK_MAX_SHARE * n
                and base.weight.dtype.is_floating_point and base.weight.shape == (n, in_local)):
            self._stack(base, (num_slots, len(slice_sizes), rank))
        else:
            self.A = torch.zeros(num_slots, len(slice_sizes), rank, in_local, dtype=dtype,
                                 device=device)
        self.B = torch.zeros(num_slots, n, rank, dtype=dtype, device=device)  # scale folded in
        offsets = [0]
        for size in slice_sizes:
            offsets.append(offsets[-1] + size)
        self.offsets = torch.tensor(offsets, dtype=torch.int32, device=device)

    def _stack(self, base, a_shape: tuple[int, int, int]) -> None:
        """Move the base's weight (and bias) into [W; A] and point it at the first rows;
        a_shape: A's (slots, slices, rank)."""
        w = base.weight
        n, k = w.shape
        extra = a_shape[0] * a_shape[1] * a_shape[2]
        self.stacked = torch.zeros(n + extra, k, dtype=w.dtype, device=w.device)
        self.stacked[:n].copy_(w)
        base.weight = _view_parameter(self.stacked[:n], w)
        self.A = self.stacked[n:].view(*a_shape, k)
        if base.bias is not None:
            self.stacked_bias = torch.zeros(n + extra, dtype=base.bias.dtype,
                                            device=base.bias.device)
            self.stacked_bias[:n].copy_(base.bias)
            base.bias = _view_parameter(self.stacked_bias[:n], base.bias)

    def active(self) -> bool:
        """Whether the step in progress has tokens of an adapter (or may: a graph capture)."""
        b = self.state.batch
        return b is not None and b.slots != []

    def stacked_forward(self, x: torch.Tensor, bias: torch.Tensor | None,
                        silu_mul: bool = False) -> torch.Tensor:
        """The base output plus the delta, from one GEMM over [W; A] (a stacked layer; bias:
        the base's, or None where this rank adds none). The output is [T, N] with rows strided
        past the shrink's columns."""
        if not self.active():
            return linear(x, self.stacked[:self.n], bias, silu_mul)
        out = linear(x, self.stacked, None if bias is None else self.stacked_bias, silu_mul)
        h = out[:, self.n:].view(out.shape[0], *self.A.shape[:3])     # [T, S, slices, R]
        return self._expand(out[:, :self.n], h)

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (this layer's output for input x, [T, N]) plus the delta, in place (a layer whose
        weight is not stacked: the shrink reads x)."""
        if not self.active():
            return y
        b = self.state.batch
        if x.is_cuda and triton_available():
            from conveyor.kernels.lora import lora_shrink

            return self._expand(y, lora_shrink(x, self.A, b.order[:x.shape[0]], b.starts))
        from conveyor.kernels.lora import lora_ref

        return lora_ref(y, x, self.A, self.B, self.slice_sizes, *self._slots(x.shape[0]))

    def _expand(self, y: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        b, t = self.state.batch, y.shape[0]
        if y.is_cuda and triton_available():
            from conveyor.kernels.lora import lora_expand

            return lora_expand(y, h, self.B, self.offsets, max(self.slice_sizes), b.order[:t],
                               b.starts)
        from conveyor.kernels.lora import lora_expand_ref

        return lora_expand_ref(y, h, self.B, self.slice_sizes, *self._slots(t))

    def _slots(self, t: int) -> tuple[torch.Tensor, list[int]]:
        """(each token's slot, the slots that occur) of the step's first t tokens."""
        b = self.state.batch
        slots = b.slots if b.slots is not None else b.token_slots[:t].unique().tolist()
        return b.token_slots[:t], [s for s in slots if s >= 0]


def _view_parameter(data: torch.Tensor, old: torch.nn.Parameter) -> torch.nn.Parameter:
    """A parameter over `data` (a view) with the attributes of `old` (its weight_loader)."""
    param = torch.nn.Parameter(data, requires_grad=False)
    param.__dict__.update(old.__dict__)
    return param
