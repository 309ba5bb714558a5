"""Build a model and fill its weights from a Hugging Face folder (*.safetensors) or a GGUF file,
or with random weights (load_format="dummy", worker/dummy_weights.py).

Checkpoint tensors arrive under Hugging Face names (GGUF names are mapped onto them in
worker/gguf_tensors.py); q/k/v and gate/up go into our fused layers through the model's
`packed_modules`, and every parameter's `weight_loader` takes this rank's slice. Any missing or
unexpected weight is an error.

With --quantization the layers are quantized after loading (layers/quantization.py); on a GPU
the model is built and loaded on the host and each layer goes to the device as it is quantized,
so the device never holds the whole model in full precision. GGUF Q8_0 tensors of linear layers
are then loaded as they are (int8 with one scale per 32 values) instead of dequantized, and so
are a quantized checkpoint's 1-byte weights (config.quantization "fp8" or "int8"; MoE experts'
too), with their per-tensor or per-channel `weight_scale` as one scale per row, or square block
scales as one per row and block of inputs; static `input_scale`s are not
used (fp8 activations are quantized per token as they come; int8 runs W8A16). gpt-oss's MXFP4
experts, from its checkpoint or a GGUF, stay in 4 bits (`_take_mxfp4`). Per-layer KV
cache scales (`self_attn.k_scale` / `v_scale`, or AutoFP8's `k_proj` / `v_proj.output_scale`)
become `model.checkpoint_kv_scales`, which an fp8 KV pool uses instead of calibrating. A pipeline
stage loads only the tensors of the modules it holds (layers/pipeline.py).
"""
from __future__ import annotations

import logging
import math
import re

import torch
from torch import nn

from conveyor.shared.model_config import INT4_FORMATS, ModelConfig
from conveyor.shared.model_files import ModelFiles
from conveyor.worker.bnb_checkpoint import bnb_weights, is_bitsandbytes
from conveyor.worker.checkpoint_files import Checkpoint, Weights
from conveyor.worker.gguf_tensors import expert_names, gguf_to_hf_name, gguf_weights
from conveyor.worker.layers.linear import LinearBase, default_weight_loader
from conveyor.worker.layers.moe import EXPERT_PARTS, FusedMoE
from conveyor.worker.layers.pipeline import stage_weight_name
from conveyor.worker.layers.quantization import Q8_0_GROUP, keep_matches, quantize_model
from conveyor.worker.models import get_model_class

log = logging.getLogger("conveyor.quantization")


def load_model(config: ModelConfig, files: ModelFiles, dtype: torch.dtype,
               device: torch.device | str, quantization: str | None = None,
               keep: tuple[re.Pattern, ...] = (), load_format: str = "auto", seed: int = 0,
               first_layers: bool = False) -> nn.Module:
    """The model with its weights, on `device`, in eval mode; with `quantization` its layers
    not matching `keep` are quantized (or, from a quantized checkpoint, loaded so), and
    `model.quant_report` says what was done (None without quantization);
    `model.checkpoint_kv_scales` holds the checkpoint's KV cache scales, if it has them.
    load_format "dummy" draws random weights (worker/dummy_weights.py). With `first_layers` the
    model is the checkpoint's first config.num_hidden_layers decoder layers (a draft model made
    of the target's own layers): the checkpoint's later layers are skipped.
    """
    model_class = get_model_class(config.architecture)
    with torch.device("cpu" if quantization else device):
        model = model_class(config, dtype)
    model.checkpoint_kv_scales = None

    def fill(weights: Weights) -> None:
        load_weights(model, _below_layer(weights, config.num_hidden_layers)
                     if first_layers else weights)

    mxfp4 = config.quantization == "mxfp4" and _take_mxfp4(model)
    checkpoint = Checkpoint(files.path, text_only=bool(config.extra.get("text_of")))
    if load_format == "dummy":
        from conveyor.worker.dummy_weights import dummy_weights

        if config.quantization in INT4_FORMATS:
            raise ValueError(f"load_format dummy cannot stand in for a 4-bit {config.quantization} "
                             f"checkpoint (its layers take 4-bit words drawn from no checkpoint"
                             f"); a random 4-bit model comes from benchmarks.models."
                             f"build_random_quantized (the benchmark scripts' --int4 "
                             f"{config.quantization})")

        fill(dummy_weights(config, dtype, device, seed, mxfp4))
    elif files.is_gguf:
        from conveyor.shared.gguf_reader import open_gguf

        reader = open_gguf(files.path)
        int8_names = _keep_q8_0(model, reader, keep) if quantization == "int8" else set()
        fill(gguf_weights(reader, int8_names, mxfp4))
    elif config.quantization in INT4_FORMATS:
        fill(_take_int4(model, checkpoint, config, device))
    elif config.quantization == "mxfp4":
        fill(checkpoint.weights())                  # models/gpt_oss.py converts the experts
    else:
        block = _block_size(config)
        rows = _take_quantized(model, checkpoint, config.quantization, block)
        kv_scales: dict[tuple[int, str], float] = {}
        weights = (bnb_weights(checkpoint)
                   if is_bitsandbytes(config.extra.get("quantization_config"))
                   else checkpoint.weights())
        fill(_with_scales(weights, rows, kv_scales, block))
        model.checkpoint_kv_scales = _per_layer(kv_scales, config.num_hidden_layers)
    # dummy weights are drawn in full precision and quantized in the checkpoint's mode, but
    # MXFP4's experts are drawn as bytes (dummy_weights.py), the rest kept as the checkpoint's
    from_checkpoint = config.quantization is not None and (load_format != "dummy"
                                                           or config.quantization == "mxfp4")
    model.quant_report = quantize_model(model, quantization, keep, device, from_checkpoint)
    return model.eval()


_STORED = {"fp8": ("F8_E4M3", torch.float8_e4m3fn), "int8": ("I8", torch.int8)}


def _block_size(config: ModelConfig) -> int:
    """The side of an fp8 checkpoint's square scale blocks (0: per tensor or per channel):
    `weight_block_size` ("fp8", DeepSeek's layout), or compressed-tensors' block strategy."""
    qc = config.extra.get("quantization_config") or {}
    if qc.get("weight_block_size"):
        return int(qc["weight_block_size"][0])
    for group in (qc.get("config_groups") or {}).values():
        weights = group.get("weights") or {}
        if weights.get("strategy") == "block":
            return int(weights["block_structure"][0])
    return 0


def _take_quantized(model: nn.Module, checkpoint: Checkpoint, mode: str | None,
                    block: int = 0) -> dict[str, int]:
    """For a checkpoint quantized in `mode` ("fp8" or "int8"): make the linear layers whose
    checkpoint weights are stored in it take 1-byte weights and one scale per row (with
    `block`-square scales: one per row and block of columns); returns {checkpoint weight name:
    its rows} of those weights ({} for other checkpoints)."""
    if mode is None:
        return {}
    stored, dtype = _STORED[mode]
    rows, is_stored = {}, {}                 # checkpoint weight name -> rows, -> stored in mode
    for name, t in checkpoint.headers():     # no tensor is read
        if name.endswith(".weight"):
            rows[name], is_stored[name] = t.get_shape()[0], t.get_dtype() == stored
    taken = {}
    for module_name, (module, parts) in _by_module(model, is_stored).items():
        if not any(parts.values()):
            continue
        if isinstance(module, FusedMoE) and all(parts.values()):
            module.make_quantized(dtype, block)
            taken.update({name: rows[name] for name in parts})
            continue
        if not (isinstance(module, LinearBase) and all(parts.values())):
            raise ValueError(f"{module_name}: {mode} checkpoint weights load only into linear "
                             f"layers or experts whose every part is {mode}")
        k = module.weight.shape[1]
        if block and k % block:
            raise ValueError(f"{module_name}: {k} inputs (on this rank) are not whole scale "
                             f"blocks of {block}")
        module.make_quantized(dtype, k // block if block else 1)
        taken.update({name: rows[name] for name in parts})
    return taken


def _take_int4(model: nn.Module, checkpoint: Checkpoint, config: ModelConfig,
               device: torch.device | str) -> Weights:
    """For an AWQ, GPTQ or compressed-tensors W4A16 checkpoint: make the linear layers with
    4-bit words take them (LinearBase.make_int4), and return the checkpoint's tensors with
    those layers' parts converted to the W4A16 layout on `device` (worker/int4_checkpoint.py)."""
    from conveyor.shared.model_config import gptq_bits, int4_format
    from conveyor.worker.int4_checkpoint import int4_weights, packed_layers

    qc = config.extra["quantization_config"]
    group, zero_offset, act_order = int4_format(qc)
    int8 = gptq_bits(qc) == 8               # 8-bit GPTQ: int8 weights, one scale a group
    fmt = "gptq8" if int8 else config.quantization
    packed, has_g_idx, has_zero = packed_layers(fmt, checkpoint.names())
    layers = dict.fromkeys(packed, True)
    for module_name, (module, _) in _by_module(model, layers).items():
        if isinstance(module, FusedMoE):
            (module.make_quantized(torch.int8, group) if int8
             else module.make_int4(group, act_order))
            continue
        if not isinstance(module, LinearBase):
            raise ValueError(f"{module_name}: 4-bit checkpoint weights load only into linear "
                             f"layers and experts")
        groups = module.weight.shape[1] // group if group else 1
        module.make_quantized(torch.int8, groups) if int8 else module.make_int4(groups, act_order)
    weights = int4_weights(checkpoint.weights(), fmt, zero_offset, has_g_idx, device,
                           has_zero)
    if not act_order:      # GPTQ's g_idx then only repeats the groups: no column order
        weights = ((n, t) for n, t in weights if not n.endswith(".weight_perm"))
    return weights


def _take_mxfp4(model: nn.Module) -> bool:
    """For gpt-oss's MXFP4 checkpoint: make the experts take 4-bit words and block scales
    (FusedMoE.make_mxfp4), if this rank's share of each is whole blocks of 32 inputs; else
    they stay in the model dtype, the blocks dequantized as they load (gpt-oss-120b's and
    -20b's intermediate size 2880 at TP 4 and 8: 720 and 360), which the log and the
    report's "kept" say. Returns whether they take them."""
    from conveyor.worker.mxfp4_checkpoint import BLOCK

    experts = {name: m for name, m in model.named_modules() if isinstance(m, FusedMoE)}
    if not all(m.whole_groups(BLOCK, 8) for m in experts.values()):
        inter = next(iter(experts.values())).inter
        log.warning("MXFP4 experts dequantized to the model dtype: their intermediate size "
                    "on this rank (%d) is not whole blocks of %d (use a tensor-parallel size "
                    "that splits it so, e.g. 2 for gpt-oss)", inter, BLOCK)
        return False
    for m in experts.values():
        m.make_mxfp4()
    return bool(experts)


def _by_module(model: nn.Module, flags: dict[str, bool]
               ) -> dict[str, tuple[nn.Module | None, dict[str, bool]]]:
    """Checkpoint weights grouped by the module of ours they load into (q/k/v into qkv_proj):
    module name -> (the module, or None if we have none; {checkpoint name: its flag})."""
    modules = dict(model.named_modules())
    grouped: dict[str, tuple[nn.Module | None, dict[str, bool]]] = {}
    layers, tied = model.config.num_hidden_layers, model.config.tie_word_embeddings
    rename = getattr(model, "checkpoint_name", None)       # Mixtral's w1/w2/w3 experts
    for name, flag in flags.items():
        if stage_weight_name(name, layers, tied) is None:
            continue                             # another pipeline stage's
        ours = rename(name) if rename else name
        if m := _EXPERT.match(ours):             # an expert's: its layer's FusedMoE
            module = m.group(1)
        else:
            module = _packed_name(ours, model.packed_modules)[0].removesuffix(".weight")
        grouped.setdefault(module, (modules.get(module), {}))[1][name] = flag
    return grouped


_KV_SCALE = re.compile(r"model\.layers\.(\d+)\.self_attn\."
                       r"(?:([kv])_scale|([kv])_proj\.output_scale)$")


def _with_scales(weights: Weights, rows_of: dict[str, int],
                 kv_scales: dict[tuple[int, str], float], block: int = 0) -> Weights:
    """A quantized checkpoint's tensors as load_weights takes them: each weight_scale (one per
    tensor, or one per channel) as float32 [rows, 1], or with `block`-square scales
    ([ceil(rows / block), columns / block], also named weight_scale_inv) each block row's
    scales repeated for its rows, [rows, columns / block]; input_scale dropped; the KV cache
    scales put in kv_scales[(layer, "k" or "v")]. Other checkpoints' tensors pass unchanged."""
    for name, tensor in weights:
        if not rows_of:
            yield name, tensor
        elif name.endswith(".input_scale"):
            continue
        elif m := _KV_SCALE.match(name):
            kv_scales[int(m.group(1)), m.group(2) or m.group(3)] = float(tensor.float().max())
        elif block and name.endswith((".weight_scale", ".weight_scale_inv")):
            weight = name.removesuffix("_inv").removesuffix("_scale")
            rows = rows_of.get(weight)
            if rows is None or tensor.dim() != 2 or tensor.shape[0] != -(-rows // block):
                raise ValueError(f"{name}: expected [{-(-(rows or 0) // block)}, K / {block}] "
                                 f"block scales for a quantized weight, got "
                                 f"{tuple(tensor.shape)}")
            scale = tensor.float().repeat_interleave(block, dim=0)[:rows].contiguous()
            yield weight + "_scale", scale
        elif name.endswith(".weight_scale"):
            rows = rows_of.get(name.removesuffix("_scale"))
            if rows is None:
                raise ValueError(f"{name}: a scale for a weight that is not quantized")
            if tensor.numel() not in (1, rows):
                raise ValueError(f"{name}: expected one scale or {rows} (one per row), got "
                                 f"{tuple(tensor.shape)}")
            yield name, tensor.float().reshape(-1, 1).expand(rows, 1).contiguous()
        else:
            yield name, tensor


def _keep_q8_0(model: nn.Module, reader, keep: tuple[re.Pattern, ...]) -> set[str]:
    """Make the linear layers (and experts) whose every checkpoint weight is GGUF Q8_0 take int8
    weights and group scales (layers matched by `keep`, or whose input is not whole blocks, are
    left as they are); returns the checkpoint names to load without dequantizing."""
    import gguf

    arch = reader.fields["general.architecture"].contents()
    is_q8_0 = {}                              # checkpoint weight name -> stored as Q8_0
    for tensor in reader.tensors:
        for name in expert_names(tensor) or [gguf_to_hf_name(tensor.name, arch)]:
            if name is not None and name.endswith(".weight"):
                is_q8_0[name] = tensor.tensor_type == gguf.GGMLQuantizationType.Q8_0
    names = set()
    for module_name, (module, parts) in _by_module(model, is_q8_0).items():
        if (isinstance(module, FusedMoE) and all(parts.values())
                and not keep_matches(module_name, keep)
                and module.whole_groups(Q8_0_GROUP)):
            module.make_quantized(torch.int8, Q8_0_GROUP)     # scales a row and 32 inputs
            names.update(parts)
        elif (isinstance(module, LinearBase) and all(parts.values())
                and not keep_matches(module_name, keep)
                and not getattr(module, "keep_precision", False)     # an MoE router
                and module.weight.shape[1] % Q8_0_GROUP == 0):
            module.make_quantized(torch.int8, module.weight.shape[1] // Q8_0_GROUP)
            names.update(parts)
    return names


_EXPERT = re.compile(r"(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\."
                     r"(?:weight(_scale|_zero)?|(bias))$")


def _packed_name(name: str, packed: dict) -> tuple[str, object]:
    """A checkpoint name in our fused modules, and its shard id (None if not fused): an MoE
    expert's projection (and its scales and zero points, or its bias) goes into its layer's
    stacked w13 (gate, up) or w2 (down) with shard id (expert, part) (layers/moe.py)."""
    if m := _EXPERT.match(name):
        part = EXPERT_PARTS[m.group(3)]
        suffix = m.group(4) or ("_bias" if m.group(5) else "")
        return (f"{m.group(1)}.{'w2' if part == 2 else 'w13'}{suffix}",
                (int(m.group(2)), part))
    for part, (fused, shard) in packed.items():
        if f".{part}." in name:
            return name.replace(f".{part}.", f".{fused}."), shard
    return name, None


def load_weights(model: nn.Module, weights: Weights) -> None:
    """Fill the model from (checkpoint name, tensor) pairs; a model whose checkpoint lays
    tensors out otherwise (Phi-3's fused qkv) maps them first (`convert_weights`)."""
    if hasattr(model, "convert_weights"):
        weights = model.convert_weights(weights)
    packed = model.packed_modules
    params = dict(model.named_parameters())
    tied = model.config.tie_word_embeddings
    layers = model.config.num_hidden_layers
    loaded: dict[str, set] = {}
    unexpected = []
    for name, tensor in weights:
        if name.endswith("rotary_emb.inv_freq") or (tied and name == "lm_head.weight"):
            continue
        name = stage_weight_name(name, layers, tied)
        if name is None:
            continue                             # another pipeline stage's
        name, shard_id = _packed_name(name, packed)
        param = params.get(name)
        if param is None:
            unexpected.append(name)
            continue
        loader = getattr(param, "weight_loader", None)
        try:
            if loader is None:
                default_weight_loader(param, tensor)
            else:
                loader(param, tensor, shard_id)
        except ValueError as e:
            raise ValueError(f"cannot load {name} (shard {shard_id}): {e}") from None
        loaded.setdefault(name, set()).add(shard_id)
    missing = []
    for name, param in params.items():
        fused = name.split(".")[-2]
        want = (getattr(param, "expected_shards", None)
                or {s for f, s in packed.values() if f == fused} or {None})
        missing += [f"{name} (shard {s})" if s is not None else name
                    for s in sorted(want - loaded.get(name, set()), key=str)]
    if missing or unexpected:
        raise ValueError(f"checkpoint does not match {type(model).__name__}: "
                         f"missing {_brief(missing)}; unexpected {_brief(unexpected)}")


_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def _below_layer(weights: Weights, num_layers: int) -> Weights:
    """The weights, without those of decoder layers num_layers and later."""
    for name, tensor in weights:
        m = _LAYER.match(name)
        if m is None or int(m.group(1)) < num_layers:
            yield name, tensor


def _brief(names: list[str], limit: int = 8) -> str:
    if not names:
        return "none"
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def _per_layer(kv_scales: dict[tuple[int, str], float], layers: int
               ) -> list[tuple[float, float]] | None:
    """[(k_scale, v_scale)] per layer, if the checkpoint gave both for every layer."""
    if not kv_scales:
        return None
    if len(kv_scales) != 2 * layers or any(s <= 0 or not math.isfinite(s)
                                           for s in kv_scales.values()):
        raise ValueError(f"the checkpoint's KV cache scales must be positive, one k and one v "
                         f"for each of the {layers} layers; got {len(kv_scales)}")
    return [(kv_scales[i, "k"], kv_scales[i, "v"]) for i in range(layers)]
