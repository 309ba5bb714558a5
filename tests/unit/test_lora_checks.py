"""LoRA without an engine: the adapter checks (no torch needed), the registry, the scheduler's
cap on adapters a step, and the torch reference of the batched delta."""
import json
import struct

import pytest
import torch
from scheduler_util import Harness

from conveyor.shared.config import EngineConfig
from conveyor.shared.lora import LoRARegistry, LoRARequest, check_adapter
from conveyor.shared.messages.engine import AddRequest
from conveyor.shared.model_config import ModelConfig
from conveyor.shared.request_options import RequestOptions
from conveyor.shared.sampling_params import SamplingParams

MODEL = ModelConfig(architecture="LlamaForCausalLM", hidden_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    intermediate_size=128, vocab_size=256)


def write_adapter(path, tensors: dict[str, list[int]], **config):
    """An adapter folder whose safetensors header declares `tensors` (name -> shape)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 4, "lora_alpha": 8, **config}))
    header, offset = {}, 0
    for name, shape in tensors.items():
        size = 4 * shape[0] * shape[1]
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    (path / "adapter_model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw
                                                     + bytes(offset))
    return path


def q_proj(layer=0, a=(4, 64), b=(64, 4)) -> dict[str, list[int]]:
    stem = f"base_model.model.model.layers.{layer}.self_attn.q_proj"
    return {f"{stem}.lora_A.weight": list(a), f"{stem}.lora_B.weight": list(b)}


def test_check_adapter_reads_rank_scale_and_modules(tmp_path):
    info = check_adapter(write_adapter(tmp_path / "a", q_proj()), MODEL, 16)
    assert (info.rank, info.scale) == (4, 2.0)
    assert list(info.modules) == ["model.layers.0.self_attn.q_proj"]
    rs = check_adapter(write_adapter(tmp_path / "rs", q_proj(), use_rslora=True), MODEL, 16)
    assert rs.scale == 4.0                                      # alpha / sqrt(r)


@pytest.mark.parametrize("tensors,config,says", [
    (q_proj(), {"r": 32}, "rank 32 exceeds max_lora_rank 16"),
    (q_proj(a=(4, 32)), {}, "has shape [4, 32], the base model needs [4, 64]"),
    (q_proj(b=(32, 4)), {}, "needs [64, 4]"),
    (q_proj(layer=2), {}, "layer 2, but the base model has 2 layers"),
    ({"base_model.model.lm_head.lora_A.weight": [4, 64]}, {}, "unsupported tensor"),
    ({k: v for k, v in q_proj().items() if "lora_A" in k}, {}, "has no lora_B"),
    (q_proj(), {"use_dora": True}, "use_dora"),
    (q_proj(), {"bias": "all"}, "bias"),
    (q_proj(), {"r": 0}, "r must be a positive integer"),
])
def test_check_adapter_refuses_what_does_not_fit(tmp_path, tensors, config, says):
    with pytest.raises(ValueError, match=says.replace("[", r"\[").replace("]", r"\]")):
        check_adapter(write_adapter(tmp_path / "a", tensors, **config), MODEL, 16)


def test_check_adapter_refuses_unreadable_files(tmp_path):
    with pytest.raises(ValueError, match="not a PEFT LoRA adapter"):
        check_adapter(tmp_path, MODEL, 16)
    path = write_adapter(tmp_path / "a", q_proj())
    (path / "adapter_model.safetensors").write_bytes(b"\xff" * 8 + b"x")
    with pytest.raises(ValueError, match="not a safetensors file"):
        check_adapter(path, MODEL, 16)
    (path / "adapter_config.json").write_text("[1]")
    with pytest.raises(ValueError, match="not a JSON object"):
        check_adapter(path, MODEL, 16)


def test_registry_names_and_ids(tmp_path):
    path = str(write_adapter(tmp_path / "a", q_proj()))
    reg = LoRARegistry(MODEL, 16, base_names=("base",))
    first = reg.add_path("x", path)
    assert first.lora_int_id == 1
    assert not reg.add(first)                                   # the same again: nothing to do
    for bad, says in ((LoRARequest("x", 5, path), "already loaded"),
                      (LoRARequest("y", 1, path), "already used"),
                      (LoRARequest("base", 6, path), "base model"),
                      (LoRARequest("z", 0, path), "positive")):
        with pytest.raises(ValueError, match=says):
            reg.add(bad)
    reg.remove("x")
    with pytest.raises(ValueError, match="unknown LoRA adapter 'x'"):
        reg.resolve("x")
    assert reg.add_path("x", path).lora_int_id == 2             # ids are never reused


def test_engine_config_lora_checks():
    with pytest.raises(ValueError, match="enable_lora"):
        EngineConfig(lora_modules=("a=/x",))
    with pytest.raises(ValueError, match="name=path"):
        EngineConfig(enable_lora=True, lora_modules=("nopath",))
    with pytest.raises(ValueError, match="max_cpu_loras"):
        EngineConfig(enable_lora=True, max_loras=4, max_cpu_loras=2)
    assert EngineConfig(enable_lora=True, max_loras=3).cpu_loras == 3


def test_a_model_with_latent_attention_refuses_lora():
    """DeepSeek's MLA has no q/k/v projections: enable_lora is refused before anything runs."""
    from dataclasses import replace

    from conveyor.shared.lora import lora_registry

    mla = replace(MODEL, architecture="DeepseekV3ForCausalLM", extra={"kv_lora_rank": 32})
    config = EngineConfig(enable_lora=True)
    assert lora_registry(config, MODEL) is not None
    with pytest.raises(ValueError, match="not supported for DeepseekV3ForCausalLM"):
        lora_registry(config, mla)


def test_scheduler_runs_at_most_max_loras_adapters_at_once():
    """With 2 slots, a third adapter's request waits while base and known-adapter requests
    behind it go first; it runs once an adapter's requests have finished."""
    h = Harness(max_num_seqs=8, budget=64, enable_lora=True, max_loras=2)
    loras = {n: LoRARequest(n, i + 1, f"/{n}") for i, n in enumerate("abc")}
    for rid, name in (("a1", "a"), ("b1", "b"), ("c1", "c"), ("base", None), ("a2", "a")):
        msg = AddRequest(id=rid, token_ids=[5, 6, 7], sampling=SamplingParams(max_tokens=3),
                         arrival=h.now, lora=None if name is None else loras[name],
                         options=RequestOptions(lora=name))
        h.collect(h.sched.add(msg))
    plan = h.step()
    assert {s.lora.lora_name if s.lora else None for s in plan.new} == {"a", "b", None}
    assert [r.id for r in h.sched.waiting] == ["c1"]
    seen = set()
    while h.sched.has_work() or h.sched.num_in_flight:
        plan = h.step()
        if plan is not None:
            running = {r.lora.lora_int_id for r in h.sched.running if r.lora is not None}
            assert len(running) <= 2
            seen |= {s.lora.lora_name for s in plan.new if s.lora}
    assert "c" in seen and all(h.out[r].num_finishes == 1 for r in ("a1", "b1", "c1", "a2"))


def test_reference_delta_equals_per_token_loop():
    """lora_ref (grouped by slot, fused slices) against one token at a time."""
    from conveyor.kernels.lora import lora_ref

    g = torch.Generator().manual_seed(0)
    slices, k, r, slots = [12, 5, 5], 20, 16, 3
    x = torch.randn(9, k, generator=g)
    A = torch.randn(slots, len(slices), r, k, generator=g)
    B = torch.randn(slots, sum(slices), r, generator=g)
    token_slots = torch.tensor([2, -1, 0, 0, 2, -1, 1, 2, 0])
    y0 = torch.randn(9, sum(slices), generator=g)
    got = lora_ref(y0.clone(), x, A, B, slices, token_slots, [0, 1, 2])
    want = y0.clone()
    for t, s in enumerate(token_slots.tolist()):
        if s < 0:
            continue
        off = 0
        for i, n in enumerate(slices):
            want[t, off:off + n] += (x[t] @ A[s, i].T) @ B[s, off:off + n].T
            off += n
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_stacked_layer_equals_the_shrink_on_x(monkeypatch):
    """A float layer carries A under its weight ([W; A], weight and bias views of it): one GEMM
    gives output and every slot's shrink, and the layer's output with the delta equals the base
    output plus the reference delta on x; with no adapter in the step, the base output alone."""
    import numpy as np

    from conveyor.kernels.lora import group_by_slot, lora_ref
    from conveyor.worker.layers import lora as lora_layers
    from conveyor.worker.layers.linear import ReplicatedLinear
    from conveyor.worker.layers.lora import LoRABatch, LoRALayer, LoRAState

    monkeypatch.setattr(lora_layers, "STACK_MAX_SHARE", float("inf"))   # a narrow layer
    g = torch.Generator().manual_seed(1)
    layer = ReplicatedLinear(20, 22, bias=True)
    layer.weight.data.copy_(torch.randn(22, 20, generator=g))
    layer.bias.data.copy_(torch.randn(22, generator=g))
    W, bias = layer.weight.detach().clone(), layer.bias.detach().clone()
    state = LoRAState()
    layer.lora = LoRALayer(state, 3, [12, 10], 20, 16, torch.float32, torch.device("cpu"),
                           base=layer)
    lora = layer.lora
    assert lora.stacked is not None and lora.stacked.shape == (22 + 3 * 2 * 16, 20)
    assert layer.weight.data_ptr() == lora.stacked.data_ptr() and torch.equal(layer.weight, W)
    lora.A.copy_(torch.randn(lora.A.shape, generator=g))
    lora.B.copy_(torch.randn(lora.B.shape, generator=g))
    x = torch.randn(9, 20, generator=g)
    ts = np.array([2, -1, 0, 0, 2, -1, 1, 2, 0])
    order, starts = (torch.from_numpy(a) for a in group_by_slot(ts, 3))
    with state.step(LoRABatch(torch.from_numpy(ts), order, starts, [0, 1, 2])):
        got = layer(x)
    want = lora_ref(x @ W.T + bias, x, lora.A, lora.B, [12, 10], torch.from_numpy(ts), [0, 1, 2])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    with state.step(LoRABatch(torch.from_numpy(ts), order, starts, [])):
        torch.testing.assert_close(layer(x), x @ W.T + bias)


def test_stacking_stops_at_its_share():
    """Slots whose A rows would add more than STACK_MAX_SHARE of the weight's rows keep the
    shrink kernel (the weight stays as it was)."""
    from conveyor.worker.layers.linear import ReplicatedLinear
    from conveyor.worker.layers.lora import STACK_MAX_SHARE, LoRALayer, LoRAState

    n = 1024
    fits = int(STACK_MAX_SHARE * n) // (2 * 16)              # slots of 2 slices of rank 16
    for slots, stacked in ((fits, True), (fits + 1, False)):
        layer = ReplicatedLinear(32, n)
        weight = layer.weight
        layer.lora = LoRALayer(LoRAState(), slots, [n // 2, n // 2], 32, 16, torch.float32,
                               torch.device("cpu"), base=layer)
        assert (layer.lora.stacked is not None) == stacked
        assert (layer.weight is weight) != stacked


def test_adapters_on_mlps_the_model_lacks_are_refused(tmp_path):
    """Arcee's, Apertus's and StarCoder2's MLPs have no gate: an adapter on gate_proj names
    what the model lacks (the worker would find no layer for it), one on up_proj loads."""
    import dataclasses

    arcee = dataclasses.replace(MODEL, architecture="ArceeForCausalLM")
    stem = "base_model.model.model.layers.0.mlp"
    gate = {f"{stem}.gate_proj.lora_A.weight": [4, 64], f"{stem}.gate_proj.lora_B.weight": [128, 4]}
    up = {name.replace("gate_proj", "up_proj"): shape for name, shape in gate.items()}
    with pytest.raises(ValueError, match="ArceeForCausalLM has no gate_proj"):
        check_adapter(write_adapter(tmp_path / "gate", gate), arcee, 16)
    assert check_adapter(write_adapter(tmp_path / "up", up), arcee, 16).rank == 4
    check_adapter(write_adapter(tmp_path / "llama", gate), MODEL, 16)
    # a mixture of experts: its MLPs are experts, which take no adapter (the worker would find
    # no gate_up_proj); attention adapters load
    moe = dataclasses.replace(MODEL, architecture="Qwen3MoeForCausalLM",
                              extra={"num_experts": 8})
    for adapter in ("gate", "up"):
        with pytest.raises(ValueError, match="mixture of experts: LoRA adapts its attention"):
            check_adapter(tmp_path / adapter, moe, 16)
    check_adapter(write_adapter(tmp_path / "q", q_proj()), moe, 16)
