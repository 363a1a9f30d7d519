"""kvpool.kernels: paged KV-cache kernels (Triton) with plain-torch references.

The public API is this package's names: the three ops (dispatching to Triton or the torch
reference, see dispatch.py), the backend switch, and the typed attention metadata. The Triton
launch wrappers live in their own modules (``kvpool.kernels.paged_attention_triton`` ...) under
names that never collide with the public functions, so importing a kernel module cannot rebind
a name of this package.
"""

from .dispatch import copy_blocks, get_backend, paged_attention, reshape_and_cache, set_backend
from .metadata import AttentionInputError, AttentionMetadata

__all__ = [
    "AttentionInputError",
    "AttentionMetadata",
    "copy_blocks",
    "get_backend",
    "paged_attention",
    "reshape_and_cache",
    "set_backend",
]
