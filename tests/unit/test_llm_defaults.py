"""Engine defaults that depend on the device and the use: the device ("auto": CUDA when there is
one) and the token budget (a large prefill budget offline on a GPU, vLLM's 8192 for a GPU server,
short steps on a CPU); a value the user gives always wins."""
import pytest

from conveyor.shared.config import TOKEN_BUDGETS, EngineConfig


@pytest.mark.parametrize("cuda", [False, True])
def test_auto_picks_cuda_when_there_is_one_and_cpu_forces(cuda):
    assert EngineConfig().with_defaults(offline=False, cuda=cuda).device == (
        "cuda" if cuda else "cpu")
    assert EngineConfig(device="cpu").with_defaults(offline=False, cuda=True).device == "cpu"


def test_gpu_offline_budget_is_large_and_the_users_value_wins():
    offline = EngineConfig().with_defaults(offline=True, cuda=True).max_num_batched_tokens
    server = EngineConfig().with_defaults(offline=False, cuda=True).max_num_batched_tokens
    assert offline == TOKEN_BUDGETS["cuda", True] > server == 8192
    mine = EngineConfig(max_num_batched_tokens=512)
    assert mine.with_defaults(offline=True, cuda=True).max_num_batched_tokens == 512


def test_cpu_budget_is_the_same_offline_and_served():
    for offline in (False, True):
        config = EngineConfig(device="cpu").with_defaults(offline=offline)
        assert config.max_num_batched_tokens == TOKEN_BUDGETS["cpu", offline] == 2048


def test_llm_samples_with_the_models_generation_config_unless_told_otherwise(tmp_path):
    import json

    from models_util import make_tiny_model

    from conveyor import LLM, SamplingParams

    model = make_tiny_model("llama", tmp_path / "m")
    (model / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.0, "max_new_tokens": 3, "top_k": 5}))
    common = dict(skip_tokenizer_init=True, device="cpu", num_kv_blocks=16, max_num_seqs=2)
    llm = LLM(str(model), **common)
    assert llm.get_default_sampling_params() == SamplingParams(temperature=0.0, max_tokens=3,
                                                               top_k=5)
    one, two = llm.generate([[3, 4, 5], [3, 4, 5]], use_tqdm=False)
    assert len(one.outputs[0].token_ids) == 3
    assert one.outputs[0].token_ids == two.outputs[0].token_ids           # greedy
    plain = LLM(str(model), generation_config="vllm", **common)
    assert plain.get_default_sampling_params() == SamplingParams()
    [out] = plain.generate([[3, 4, 5]], SamplingParams(max_tokens=4, ignore_eos=True),
                           use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 4


@pytest.mark.parametrize("args,name", [
    ({"tensor_parallel_size": 2}, "tensor_parallel_size"),
    ({"pipeline_parallel_size": 2}, "pipeline_parallel_size"),
    ({"data_parallel_size": 2}, "data_parallel_size"),
    ({"distributed_executor_backend": "ray"}, "distributed_executor_backend")])
def test_llm_refuses_what_only_the_server_runs(args, name):
    """LLM runs one engine in its process: more ranks, stages or replicas are refused by name
    before anything loads (tensor_parallel_size=2 once crashed deep in the first forward)."""
    from conveyor import LLM

    with pytest.raises(ValueError, match=f"^{name}: .*conveyor serve"):
        LLM(device="cpu", **args)
