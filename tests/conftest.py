import os

import torch

# Triton reads TRITON_INTERPRET when a kernel module is imported, so it is set here, before any
# test module can import one. Only without CUDA: on a GPU the kernels must really compile.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
