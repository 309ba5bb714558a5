"""LLM's offline defaults: a large prefill budget on a GPU, the engine's own elsewhere."""
from conveyor.llm import OFFLINE_GPU_TOKEN_BUDGET, offline_defaults
from conveyor.shared.config import EngineConfig


def test_gpu_offline_budget_is_large_and_the_users_value_wins():
    budget = offline_defaults({"device": "cuda"})["max_num_batched_tokens"]
    assert budget == OFFLINE_GPU_TOKEN_BUDGET
    assert OFFLINE_GPU_TOKEN_BUDGET > EngineConfig().max_num_batched_tokens
    args = {"device": "cuda", "max_num_batched_tokens": 512}
    assert offline_defaults(args)["max_num_batched_tokens"] == 512


def test_cpu_keeps_the_engine_default():
    for args in ({}, {"device": "cpu"}):
        config = EngineConfig.from_kwargs(**offline_defaults(args))
        assert config.max_num_batched_tokens == EngineConfig().max_num_batched_tokens
