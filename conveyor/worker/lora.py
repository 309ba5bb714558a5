"""LoRA adapters on a worker: device slots and a host cache, both swapped in LRU order.

`LoRAManager` gives each of the model's q/k/v/o/gate/up/down projections a `LoRALayer`
(layers/lora.py) with `max_loras` slots of A and B, zero-padded to the rank R (max_lora_rank
rounded up to a power of two, at least 16). Before a step, `slots_for` makes every adapter of
the step resident: a resident one is marked used, another is copied into a free slot or into the
least recently used slot the step does not need, from the host cache (`max_cpu_loras` adapters,
LRU; an adapter not there is read from its folder). The scheduler admits at most `max_loras`
adapters among the running requests, so a step never needs more slots than there are; every
rank sees the same plans and so makes the same choices. NOTE: a slot is rewritten by copies
queued on the stream behind the steps before, so a step still running on the device never sees
the new weights.

Loading takes this rank's shard of each tensor through the base layer's own weight_loader, so
A and B are split exactly as the layer's weight is; the adapter's scale (alpha / r, or
alpha / sqrt(r) with rsLoRA) is folded into B.
"""
from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import torch
from torch import nn

from conveyor.kernels._util import next_pow2
from conveyor.shared.config import EngineConfig
from conveyor.shared.lora import LoRARequest, check_adapter
from conveyor.shared.model_config import ModelConfig
from conveyor.worker.layers.linear import (
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from conveyor.worker.layers.lora import LoRALayer, LoRAState
from conveyor.worker.loader import _packed_name

# our module (last part of its name) -> the checkpoint projections it holds, in slice order
_TARGETS = {"qkv_proj": ("q", "k", "v"), "gate_up_proj": (0, 1), "o_proj": (None,),
            "down_proj": (None,), "up_proj": (None,)}      # up_proj: an MLP without a gate

HostAdapter = dict[str, tuple[torch.Tensor, torch.Tensor]]   # module -> (A [slices, R, in], B)


class LoRAManager:
    def __init__(self, model: nn.Module, model_config: ModelConfig, config: EngineConfig,
                 dtype: torch.dtype, device: torch.device):
        self.model_config = model_config
        self.max_rank = config.max_lora_rank
        self.rank = max(16, next_pow2(config.max_lora_rank))
        self.num_slots = config.max_loras
        self.cpu_slots = config.cpu_loras
        self.dtype, self.device = dtype, device
        self.state = LoRAState()
        self.layers: dict[str, LinearBase] = {}
        self.shards: dict[str, tuple] = {}           # module name -> shard ids, slice order
        for name, module in model.named_modules():
            kind = name.rsplit(".", 1)[-1]
            if isinstance(module, LinearBase) and name.startswith("model.layers.") and \
                    kind in _TARGETS:
                module.lora = LoRALayer(self.state, self.num_slots, _slice_sizes(module),
                                        module.weight.shape[1], self.rank, dtype, device,
                                        base=module)
                self.layers[name] = module
                self.shards[name] = _TARGETS[kind]
        self.packed = model.packed_modules
        self.resident: OrderedDict[int, int] = OrderedDict()    # adapter id -> slot, LRU first
        self.free = list(range(self.num_slots - 1, -1, -1))
        self.host: OrderedDict[int, HostAdapter] = OrderedDict()
        self.num_loads = 0                           # adapters copied into a slot (tests, stats)

    def slots_for(self, loras: list[LoRARequest | None]) -> list[int]:
        """The device slot of each sequence's adapter (-1: none), loading what is missing."""
        needed = {lora.lora_int_id: lora for lora in loras if lora is not None}
        if len(needed) > self.num_slots:
            raise RuntimeError(f"a step uses {len(needed)} adapters, but max_loras is "
                               f"{self.num_slots}")
        for lid, lora in needed.items():
            if lid in self.resident:
                self.resident.move_to_end(lid)
                continue
            slot = self.free.pop() if self.free else self._evict(needed)
            self._write(slot, self._host_copy(lora))
            self.resident[lid] = slot
        return [-1 if lora is None else self.resident[lora.lora_int_id] for lora in loras]

    def _evict(self, needed: dict[int, LoRARequest]) -> int:
        lid = next(i for i in self.resident if i not in needed)      # least recently used
        return self.resident.pop(lid)

    def _write(self, slot: int, adapter: HostAdapter) -> None:
        self.num_loads += 1
        for name, layer in self.layers.items():
            lora = layer.lora
            if name in adapter:
                a, b = adapter[name]
                lora.A[slot].copy_(a, non_blocking=True)
                lora.B[slot].copy_(b, non_blocking=True)
            else:
                lora.A[slot].zero_()         # a layer the adapter leaves alone: no delta

    def _host_copy(self, lora: LoRARequest) -> HostAdapter:
        adapter = self.host.get(lora.lora_int_id)
        if adapter is not None:
            self.host.move_to_end(lora.lora_int_id)
            return adapter
        adapter = self.host[lora.lora_int_id] = self.load(lora)
        while len(self.host) > self.cpu_slots:
            self.host.popitem(last=False)
        return adapter

    def load(self, lora: LoRARequest) -> HostAdapter:
        """This rank's shards of an adapter, padded to the rank R, in host memory."""
        from safetensors.torch import load_file

        info = check_adapter(lora.lora_path, self.model_config, self.max_rank)
        tensors = load_file(Path(lora.lora_path) / "adapter_model.safetensors")
        pin = self.device.type == "cuda"
        out: HostAdapter = {}
        for module, (a_name, b_name) in info.modules.items():
            ours, shard = _packed_name(module + ".weight", self.packed)
            ours = ours.removesuffix(".weight")
            layer = self.layers[ours]
            if ours not in out:
                a_host = torch.zeros_like(layer.lora.A[0], device="cpu")
                b_host = torch.zeros_like(layer.lora.B[0], device="cpu")
                out[ours] = a_host, b_host
            a_host, b_host = out[ours]
            i = self.shards[ours].index(shard)
            a = torch.zeros(self.rank, tensors[a_name].shape[1], dtype=self.dtype)
            a[:info.rank] = tensors[a_name]
            b = torch.zeros(tensors[b_name].shape[0], self.rank, dtype=self.dtype)
            b[:, :info.rank] = tensors[b_name].float() * info.scale
            if isinstance(layer, RowParallelLinear):   # input features split: A's columns
                layer.weight_loader(a_host[i], a)
                b_host.copy_(b)
            else:                                      # output features split: B's rows
                a_host[i].copy_(a)
                layer.weight_loader(b_host, b, shard)
        if pin:
            out = {k: (a.pin_memory(), b.pin_memory()) for k, (a, b) in out.items()}
        return out


def _slice_sizes(layer: LinearBase) -> list[int]:
    """This rank's output features of each sub-projection of a (fused) layer."""
    if isinstance(layer, QKVParallelLinear):
        return [layer.q_size, layer.kv_size, layer.kv_size]
    if isinstance(layer, MergedColumnParallelLinear):
        return list(layer.output_sizes)
    return [layer.weight.shape[0]]
