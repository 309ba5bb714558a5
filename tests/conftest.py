"""Suite-wide hooks. The repository root is on pytest's pythonpath (setup.cfg), so tests import
`benchmarks` (and benchmarks.stresskit, whose scenarios the reliability tests run in small
form). Tests marked `gpu` are skipped without a CUDA GPU, except those also marked `interpreter`,
which run on CPU tensors through Triton's interpreter when TRITON_INTERPRET=1 is set and Triton
is installed (slow: seconds per test):

    TRITON_INTERPRET=1 pytest -m interpreter tests/kernels
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
