"""A sparse mixture-of-experts MLP: a router (a replicated linear layer, E logits a token) and
every expert's gate/up and down projections in two stacked weights, run by the fused-MoE kernels
on CUDA (kernels/fused_moe.py) and by its torch reference elsewhere.

Tensor parallelism shards each expert's intermediate dimension, as a column- then row-parallel
MLP: each rank holds rows I/tp of every expert's gate and up, and those columns of its down, so
its output is a partial sum that the next norm all-reduces (like LlamaMLP's).

A shared expert (Qwen2-MoE's), where the model gives one, is a dense MLP every token runs, its
output scaled by sigmoid(shared_expert_gate(x)) (a replicated linear layer, one logit a token)
and added to the experts'; under tensor parallelism it shards as a dense MLP, its partial sums
scaled by the same whole gate on every rank.

gpt-oss's experts add options: biases on the router and on every expert's gate/up and down
(w13_bias sharded like w13's rows; w2_bias whole on every rank but added on rank 0 only, as a
row-parallel layer's bias), its clamped SwiGLU (`swiglu` = (alpha, limit)) in place of
SiLU-and-mul, and a softmax over the top K logits (`softmax_after_topk`).

Checkpoint tensors `experts.{e}.gate_proj|up_proj|down_proj.weight` (and `.bias`) load through
the shard ids (e, 0), (e, 1) and (e, 2) (loader.py maps the names; `expected_shards` lists them
all), and a quantized checkpoint's scales (and 4-bit zero points) beside them the same way
(`make_quantized`, `make_int4`, `make_mxfp4`).
"""
from __future__ import annotations

import torch
from torch import nn

from conveyor.kernels import triton_available
from conveyor.worker.layers.linear import ReplicatedLinear, default_weight_loader
from conveyor.worker.layers.parallel import divide, tp_rank, tp_size
from conveyor.worker.layers.router import route

# checkpoint name of an expert's projection -> its part (shard id's second item)
EXPERT_PARTS = {"gate_proj": 0, "up_proj": 1, "down_proj": 2}


def per_expert(name: str, stacked: torch.Tensor, kind: str = "weight", first: int = 0,
               interleaved: bool = False):
    """A checkpoint's stacked experts `...experts.gate_up_proj` or `down_proj` [E, rows, ...]
    (rows: gate and up, interleaved or gate's then up's; or the outputs of down) -> each
    expert's `experts.{e}.gate_proj.{kind}`, `up_proj`, or `down_proj` (numbered from
    `first`), the names FusedMoE loads."""
    prefix, proj = name.rsplit(".", 1)
    for i, w in enumerate(stacked):
        e = first + i
        if proj == "gate_up_proj":
            gate, up = (w[0::2], w[1::2]) if interleaved else w.chunk(2)
            yield f"{prefix}.{e}.gate_proj.{kind}", gate
            yield f"{prefix}.{e}.up_proj.{kind}", up
        else:
            yield f"{prefix}.{e}.down_proj.{kind}", w


def split_stacked(weights, transposed: bool = False):
    """A checkpoint's (name, tensor) pairs with its stacked experts (`...experts.gate_up_proj`,
    `...experts.down_proj`: [E, outputs, inputs], or [E, inputs, outputs] where `transposed`,
    Llama 4's) split per expert (`per_expert`); the other tensors as they are."""
    for name, tensor in weights:
        if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            yield from per_expert(name, tensor.transpose(1, 2) if transposed else tensor)
        else:
            yield name, tensor


class FusedMoE(nn.Module):
    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool, dtype: torch.dtype, bias: bool = False,
                 swiglu: tuple[float, float] | None = None, softmax_after_topk: bool = False,
                 weight_inputs: bool = False):
        """bias, swiglu, softmax_after_topk: gpt-oss's options (the module docstring);
        weight_inputs: the router weights scale each expert's input, not its output
        (Llama 4's; kernels/fused_moe.py)."""
        super().__init__()
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.weight_inputs = weight_inputs
        self.swiglu, self.softmax_after_topk = swiglu, softmax_after_topk
        self.intermediate_size = intermediate_size               # each expert's, unsharded
        inter = divide(intermediate_size, tp_size())
        self.inter = inter
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden_size, dtype=dtype),
                                requires_grad=False)              # gate rows, then up rows
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, inter, dtype=dtype),
                               requires_grad=False)
        self._expect(self.w13, self.w2)
        self.register_parameter("w13_bias", None)
        self.register_parameter("w2_bias", None)
        if bias:                                   # [E, 2I] (gate, then up) and [E, H]
            self.w13_bias = nn.Parameter(torch.empty(num_experts, 2 * inter, dtype=dtype),
                                         requires_grad=False)
            self.w2_bias = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=dtype),
                                        requires_grad=False)
            self._expect(self.w13_bias, self.w2_bias)
        # float32 once quantized: [E, 2I, G] and [E, H, G], one scale a row and group of K / G
        # inputs (G = 1: a scale a row); MXFP4's uint8 e8m0 bytes
        self.register_parameter("w13_scale", None)
        self.register_parameter("w2_scale", None)
        # 4-bit checkpoints: w13 and w2 int32 words of 8 values along the inputs, and float32
        # zero points beside the scales (W = (q - zero) * scale, kernels/w4a16_gemm.py's layout)
        self.register_parameter("w13_zero", None)
        self.register_parameter("w2_zero", None)
        self.fp4 = False            # the words hold MXFP4's e2m1 codes (no zero points)

    def _expect(self, w13: nn.Parameter, w2: nn.Parameter) -> None:
        for param, parts in ((w13, (0, 1)), (w2, (2,))):
            param.weight_loader = self.weight_loader
            param.expected_shards = {(e, p) for e in range(self.num_experts) for p in parts}

    def make_quantized(self, dtype: torch.dtype, block: int) -> None:
        """Load a checkpoint's 1-byte experts as they are (fp8 or int8 checkpoints, GGUF
        Q8_0): `dtype` weights and float32 scales, one a row (block = 0: per tensor or per
        channel, loader.py gives them one a row), or one a row and block of inputs (square
        block scales, each block row's repeated for its rows by loader.py; Q8_0's 32)."""
        self._make(dtype, block, 1, "scale blocks")

    def make_int4(self, group: int, act_order: bool) -> None:
        """Load an AWQ or GPTQ checkpoint's experts (each converted to the W4A16 layout by
        worker/int4_checkpoint.py): int32 words of 8 values [E, rows, inputs / 8] and float32
        scales and zero points [E, rows, inputs / group] (group 0: one a row)."""
        if act_order:
            raise ValueError("GPTQ act-order (desc_act) experts are not supported: their "
                             "inputs' order differs from expert to expert")
        self._make(torch.int32, group, 8, "groups", zeros=True)

    def make_mxfp4(self) -> None:
        """Load gpt-oss's MXFP4 experts in 4 bits (worker/mxfp4_checkpoint.py's mxfp4_words):
        int32 words of 8 e2m1 codes [E, rows, inputs / 8] and the checkpoint's uint8 e8m0
        scales [E, rows, inputs / 32]; W = e2m1(q) * 2^(s - 127). This rank's inputs must be
        whole blocks of 32 (`whole_groups(32, 8)`)."""
        from conveyor.worker.mxfp4_checkpoint import BLOCK

        self._make(torch.int32, BLOCK, 8, "MXFP4 blocks", scale_dtype=torch.uint8)
        self.fp4 = True

    def whole_groups(self, group: int, per_word: int = 1) -> bool:
        """Whether this rank's experts' inputs split into whole groups of `group` (0: one a
        row) and words of `per_word` values."""
        h = self.w13.shape[2]
        return not ((group and (h % group or self.inter % group)) or self.inter % per_word)

    def _make(self, dtype: torch.dtype, group: int, per_word: int, what: str,
              zeros: bool = False, scale_dtype: torch.dtype = torch.float32) -> None:
        e, two_i, h = self.w13.shape
        if not self.whole_groups(group, per_word):
            raise ValueError(f"experts of {h} inputs and {self.inter} intermediate rows on "
                             f"this rank are not whole {what} of {group or per_word}")
        device = self.w13.device

        def param(shape, dt=torch.float32):
            return nn.Parameter(torch.empty(shape, dtype=dt, device=device),
                                requires_grad=False)

        self.w13 = param((e, two_i, h // per_word), dtype)
        self.w2 = param((e, h, self.inter // per_word), dtype)
        self.w13_scale = param((e, two_i, h // group if group else 1), scale_dtype)
        self.w2_scale = param((e, h, self.inter // group if group else 1), scale_dtype)
        self._expect(self.w13, self.w2)
        self._expect(self.w13_scale, self.w2_scale)
        if zeros:
            self.w13_zero, self.w2_zero = param(self.w13_scale.shape), param(self.w2_scale.shape)
            self._expect(self.w13_zero, self.w2_zero)

    def quantize(self, mode: str, device: torch.device) -> tuple[int, int]:
        """--quantization int8 / fp8: every expert's rows quantized (one scale a row, as
        layers/quantization.py does for linear layers), on `device`. Returns the bytes before
        and after."""
        from conveyor.worker.layers.quantization import quantize_weight

        before = after = 0
        for name in ("w13", "w2"):
            w = getattr(self, name).data.to(device)
            e, n, k = w.shape
            q, scale = quantize_weight(w.reshape(e * n, k), mode)
            before += w.numel() * w.element_size()
            after += q.numel() * q.element_size() + scale.numel() * 4
            setattr(self, name, nn.Parameter(q.view(e, n, k), requires_grad=False))
            setattr(self, f"{name}_scale", nn.Parameter(scale.view(e, n, 1),
                                                        requires_grad=False))
        return before, after

    def weight_loader(self, param, loaded_weight, shard_id) -> None:
        """An expert's projection, or its scales or zero points [rows, G] (a row's G groups of
        inputs), or its bias [rows]."""
        expert, part = shard_id
        if part == 2 and loaded_weight.dim() == 1:      # down_proj's bias [H]: whole
            default_weight_loader(param[expert], loaded_weight)
        elif part == 2:                    # down_proj [H, I]: this rank's columns
            cols = param.shape[2]          # I / tp, its words or groups (one a row: whole)
            start = tp_rank() * cols if loaded_weight.shape[1] > cols else 0
            default_weight_loader(param[expert], loaded_weight.narrow(1, start, cols))
        else:
            start = tp_rank() * self.inter
            default_weight_loader(param[expert].narrow(0, part * self.inter, self.inter),
                                  loaded_weight.narrow(0, start, self.inter))

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """x [T, H], router logits [T, E] -> this rank's partial sums [T, H]."""
        return self.mix(x, *route(router_logits, self.top_k, self.renormalize, x.dtype,
                                  self.softmax_after_topk))

    def mix(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, H], each token's K experts' weights and ids [T, K] -> this rank's partial
        sums [T, H]."""
        from conveyor.kernels.fused_moe import fused_moe, fused_moe_ref

        scales = (self.w13_scale, self.w2_scale, self.w13_zero, self.w2_zero)
        # the down bias joins one rank's partial sums only: the reduction adds it once
        extra = dict(w13_bias=self.w13_bias, w2_bias=self.w2_bias if tp_rank() == 0 else None,
                     swiglu=self.swiglu, fp4=self.fp4, weight_inputs=self.weight_inputs)
        if x.is_cuda and triton_available() and x.dtype != torch.float32:
            return fused_moe(x, self.w13, self.w2, weights, ids, None, *scales, **extra)
        return fused_moe_ref(x, self.w13, self.w2, weights, ids, *scales, **extra)


class SparseMoeBlock(nn.Module):
    """The router (`gate`) and the experts, under Hugging Face's names (Qwen3-MoE's `mlp`), and
    the `shared_expert` with its `shared_expert_gate` where one is given (Qwen2-MoE's; without
    the gate where `gated_shared` is false, GraniteMoE-Shared's). `moe_options` go to FusedMoE;
    with its `bias` the router has one too (gpt-oss)."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool, dtype: torch.dtype, shared_expert: nn.Module | None = None,
                 gated_shared: bool = True, **moe_options):
        super().__init__()
        self.gate = ReplicatedLinear(hidden_size, num_experts,
                                     bias=moe_options.get("bias", False), dtype=dtype)
        # NOTE: the router stays in the model dtype under --quantization: its weights are a
        # sliver of the layer's, and a rounded logit flips an expert choice (a different MLP)
        self.gate.keep_precision = True
        self.experts = FusedMoE(num_experts, top_k, hidden_size, intermediate_size, renormalize,
                                dtype, **moe_options)
        self.shared_expert = shared_expert
        self.shared_expert_gate = None
        if shared_expert is not None and gated_shared:
            self.shared_expert_gate = ReplicatedLinear(hidden_size, 1, dtype=dtype)
            self.shared_expert_gate.keep_precision = True        # one row: nothing to save

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> this rank's partial sums [T, H]."""
        out = self.experts(x, self.gate(x))
        if self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        elif self.shared_expert is not None:
            out = out + self.shared_expert(x)
        return out
