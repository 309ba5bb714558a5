"""The LoRA delta of one linear layer, for every adapter slot at once (worker/lora.py fills it).

A LoRA-capable linear layer (LinearBase) holds a `LoRALayer` as `.lora`; its forward adds
`lora(x, y)` to its output: for each token, (x A_s^T) B_s^T of the adapter in its device slot s,
nothing for tokens of the base model. A fused layer (qkv_proj: q, k, v; gate_up_proj: gate, up)
has one A and one block of B's rows per slice. Sharded as the base layer is: column-parallel
layers keep A whole and their rows of B, row-parallel ones their columns of A and B whole; so a
row-parallel layer's delta is a partial sum like its output, and the same all-reduce adds them.

Which slot each token uses comes from the step's `LoRABatch`, set for the forward pass by
`LoRAState.step` (the model runner, or StepGraphs while capturing: then its tensors are the
graphs' static buffers).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from conveyor.kernels import triton_available


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


class LoRALayer:
    def __init__(self, state: LoRAState, num_slots: int, slice_sizes: list[int], in_local: int,
                 rank: int, dtype: torch.dtype, device: torch.device):
        self.state = state
        self.slice_sizes = slice_sizes
        n = sum(slice_sizes)
        self.A = torch.zeros(num_slots, len(slice_sizes), rank, in_local, dtype=dtype,
                             device=device)
        self.B = torch.zeros(num_slots, n, rank, dtype=dtype, device=device)  # scale folded in
        offsets = [0]
        for size in slice_sizes:
            offsets.append(offsets[-1] + size)
        self.offsets = torch.tensor(offsets, dtype=torch.int32, device=device)

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (this layer's output for input x, [T, N]) plus the delta, in place."""
        b = self.state.batch
        if b is None or b.slots == []:
            return y
        t = x.shape[0]
        if x.is_cuda and triton_available():
            from conveyor.kernels.lora import lora_expand, lora_shrink

            h = lora_shrink(x, self.A, b.order[:t], b.starts)
            return lora_expand(y, h, self.B, self.offsets, max(self.slice_sizes), b.order[:t],
                               b.starts)
        from conveyor.kernels.lora import lora_ref

        slots = b.slots if b.slots is not None else b.token_slots[:t].unique().tolist()
        return lora_ref(y, x, self.A, self.B, self.slice_sizes, b.token_slots[:t],
                        [s for s in slots if s >= 0])
