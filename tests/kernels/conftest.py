import os

import torch

# Before anything imports triton (tests/conftest.py does the same; this keeps
# `pytest tests/kernels/...` right when run from another rootdir). On a GPU the kernels compile.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from kvpool.kernels import get_backend, set_backend  # noqa: E402


@pytest.fixture
def backend():
    """Set the kernel backend for one test: `backend("triton")`; restored afterwards."""
    before = get_backend()
    yield set_backend
    set_backend(before)
