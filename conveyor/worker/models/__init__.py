"""The model registry: Hugging Face architecture name -> model class.

Adding a model is one file in this package plus one line here.
"""
from __future__ import annotations

from torch import nn

from conveyor.worker.models.apertus import ApertusForCausalLM
from conveyor.worker.models.arcee import ArceeForCausalLM
from conveyor.worker.models.cohere import CohereForCausalLM
from conveyor.worker.models.deepseek import (
    DeepseekV2ForCausalLM,
    DeepseekV3ForCausalLM,
    Mistral4ForCausalLM,
)
from conveyor.worker.models.dots1 import Dots1ForCausalLM
from conveyor.worker.models.ernie4_5 import Ernie4_5ForCausalLM
from conveyor.worker.models.exaone import ExaoneForCausalLM
from conveyor.worker.models.exaone4 import Exaone4ForCausalLM
from conveyor.worker.models.exaone_moe import ExaoneMoeForCausalLM
from conveyor.worker.models.gemma import GemmaForCausalLM
from conveyor.worker.models.gemma2 import Gemma2ForCausalLM
from conveyor.worker.models.gemma3 import Gemma3ForCausalLM
from conveyor.worker.models.glm4 import Glm4ForCausalLM, GlmForCausalLM
from conveyor.worker.models.glm4_moe import Glm4MoeForCausalLM
from conveyor.worker.models.gpt_oss import GptOssForCausalLM
from conveyor.worker.models.granite import GraniteForCausalLM
from conveyor.worker.models.granite_moe import GraniteMoeForCausalLM
from conveyor.worker.models.hunyuan import HunYuanDenseV1ForCausalLM, HunYuanMoEV1ForCausalLM
from conveyor.worker.models.llama import LlamaForCausalLM
from conveyor.worker.models.llama4 import Llama4ForCausalLM
from conveyor.worker.models.minimax_m2 import MiniMaxM2ForCausalLM
from conveyor.worker.models.mixtral import MixtralForCausalLM
from conveyor.worker.models.olmo2 import Olmo2ForCausalLM
from conveyor.worker.models.olmoe import FlexOlmoForCausalLM, OlmoeForCausalLM
from conveyor.worker.models.phi3 import Phi3ForCausalLM
from conveyor.worker.models.qwen2 import Qwen2ForCausalLM
from conveyor.worker.models.qwen2_moe import Qwen2MoeForCausalLM
from conveyor.worker.models.qwen3 import Qwen3ForCausalLM
from conveyor.worker.models.qwen3_moe import Qwen3MoeForCausalLM
from conveyor.worker.models.seed_oss import SeedOssForCausalLM
from conveyor.worker.models.starcoder2 import Starcoder2ForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "ApertusForCausalLM": ApertusForCausalLM,
    "ArceeForCausalLM": ArceeForCausalLM,
    "Cohere2ForCausalLM": CohereForCausalLM,          # sliding layers, NoPE full ones
    "CohereForCausalLM": CohereForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
    "Dots1ForCausalLM": Dots1ForCausalLM,
    "Ernie4_5ForCausalLM": Ernie4_5ForCausalLM,
    "Ernie4_5_MoeForCausalLM": Ernie4_5ForCausalLM,   # experts from moe_layer_start_index
    "ExaoneForCausalLM": ExaoneForCausalLM,
    "Exaone4ForCausalLM": Exaone4ForCausalLM,
    "ExaoneMoeForCausalLM": ExaoneMoeForCausalLM,
    "FlexOlmoForCausalLM": FlexOlmoForCausalLM,
    "GemmaForCausalLM": GemmaForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Glm4ForCausalLM": Glm4ForCausalLM,
    "GlmForCausalLM": GlmForCausalLM,
    "Glm4MoeForCausalLM": Glm4MoeForCausalLM,
    "Glm4MoeLiteForCausalLM": DeepseekV3ForCausalLM,   # MLA (deepseek.py)
    "GptOssForCausalLM": GptOssForCausalLM,
    "GraniteForCausalLM": GraniteForCausalLM,
    "GraniteMoeForCausalLM": GraniteMoeForCausalLM,
    "GraniteMoeSharedForCausalLM": GraniteMoeForCausalLM,     # a shared expert, ungated
    "HunYuanDenseV1ForCausalLM": HunYuanDenseV1ForCausalLM,
    "HunYuanMoEV1ForCausalLM": HunYuanMoEV1ForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "Llama4ForCausalLM": Llama4ForCausalLM,
    "InternLM3ForCausalLM": LlamaForCausalLM,    # qkv_bias / bias: Llama's biases
    "MiniMaxM2ForCausalLM": MiniMaxM2ForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,      # Llama with sliding_window (llama.py)
    "MinistralForCausalLM": LlamaForCausalLM,    # Mistral with layer_types
    "Ministral3ForCausalLM": LlamaForCausalLM,   # YaRN, queries scaled by position (llama.py)
    "Mistral4ForCausalLM": Mistral4ForCausalLM,  # MLA and experts (deepseek.py)
    "MixtralForCausalLM": MixtralForCausalLM,
    "Olmo2ForCausalLM": Olmo2ForCausalLM,
    "Olmo3ForCausalLM": Olmo2ForCausalLM,        # OLMo 2 with sliding layers (layer_types)
    "OlmoeForCausalLM": OlmoeForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "SeedOssForCausalLM": SeedOssForCausalLM,
    "SmolLM3ForCausalLM": LlamaForCausalLM,      # Llama with NoPE layers (llama.py)
    "Starcoder2ForCausalLM": Starcoder2ForCausalLM,
}


def get_model_class(architecture: str) -> type[nn.Module]:
    if architecture not in MODEL_REGISTRY:
        raise ValueError(f"model architecture {architecture!r} is not supported "
                         f"(supported: {', '.join(sorted(MODEL_REGISTRY))})")
    return MODEL_REGISTRY[architecture]
