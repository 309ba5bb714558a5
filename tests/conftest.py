"""Suite-wide hooks. The repository root is on pytest's pythonpath (setup.cfg), so tests import
`benchmarks` (and benchmarks.stresskit, whose scenarios the reliability tests run in small
form). Tests marked `gpu` are skipped without a CUDA GPU, except those also marked `interpreter`,
which run on CPU tensors through Triton's interpreter when TRITON_INTERPRET=1 is set and Triton
is installed (slow: seconds per test):

    TRITON_INTERPRET=1 pytest -m interpreter tests/kernels

It also builds the default model once per session: in-process with the default engine settings
(`default_llm`) and with serve_util.SMALL's (`small_llm`), and as transformers loads it
(`hf_default_model`).
"""
import importlib.util

import pytest
import torch

from conveyor.kernels import interpreting


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    interpret = interpreting() and importlib.util.find_spec("triton") is not None
    skip = pytest.mark.skip(reason="needs a CUDA GPU (tests marked interpreter: or "
                                   "TRITON_INTERPRET=1)")
    for item in items:
        if "gpu" in item.keywords and not (interpret and "interpreter" in item.keywords):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def hf_default_model():
    """transformers' own load of the default model's GGUF file (float32, eval mode), shared by
    every test that compares against it: one load takes ~15 s (metadata parsing and
    dequantizing). NOTE: shared, so a test must not change it; copy.deepcopy it first."""
    from transformers import AutoModelForCausalLM

    from conveyor.shared.model_files import default_model_path

    path = default_model_path()
    if not path.is_file():
        pytest.skip("default model not fetched (make model)")
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def default_llm():
    """`LLM()`: the default model in-process with the default engine settings (~5 s to build),
    shared by the test modules that need nothing else. NOTE: shared, so every request a test
    sends must have ended when it returns."""
    from conveyor import LLM
    from conveyor.shared.model_files import default_model_path

    if not default_model_path().is_file():
        pytest.skip("default model not fetched (make model)")
    return LLM()


@pytest.fixture(scope="session")
def small_llm():
    """The default model in-process with serve_util.SMALL's settings, one step at a time
    (async_scheduling=False): the reference for servers started with SMALL, which give its tokens
    with async scheduling or without. NOTE: shared, like default_llm."""
    from conveyor import LLM
    from conveyor.shared.model_files import default_model_path

    if not default_model_path().is_file():
        pytest.skip("default model not fetched (make model)")
    return LLM(max_num_seqs=64, kv_cache_memory_bytes=64 << 20, max_model_len=512,
               async_scheduling=False)
