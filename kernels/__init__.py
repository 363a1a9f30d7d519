"""kvpool.kernels: paged KV-cache kernels (Triton) with plain-torch references.

The public ops share their names with the modules holding their Triton kernels
(`kvpool.kernels.paged_attention` is both the dispatching function and a module). Importing a
submodule normally rebinds the package attribute to the module, which would turn
`from kvpool.kernels import paged_attention` into a module once the dispatcher (or a test) has
loaded the kernel. The package class below keeps the public functions bound; reach a kernel
module with `from kvpool.kernels.paged_attention import paged_attention as ...`.
"""

import sys
import types

from .dispatch import copy_blocks, get_backend, paged_attention, reshape_and_cache, set_backend

__all__ = ["copy_blocks", "get_backend", "paged_attention", "reshape_and_cache", "set_backend"]


class _KernelsPackage(types.ModuleType):
    def __setattr__(self, name: str, value: object) -> None:
        if name in __all__ and isinstance(value, types.ModuleType):
            return  # a kernel submodule was imported: keep the public function bound
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _KernelsPackage
