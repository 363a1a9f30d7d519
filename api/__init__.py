"""kvpool: a PagedAttention KV-cache memory system.

The offline API, for batch use without any server (an in-process block manager)::

    from kvpool import LLM, SamplingParams
    llm = LLM("tiny")                                   # a preset, or a checkpoint directory
    for out in llm.generate(["Hello", "Bonjour"], SamplingParams(max_tokens=16)):
        print(out.outputs[0].text)

Everything else lives in the subpackages (kvpool.manager, kvpool.worker, kvpool.frontend, kvpool.llm, ...);
these names are imported lazily so ``import kvpool.shared`` stays light.
"""

from __future__ import annotations

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]


def __getattr__(name: str):
    if name in __all__:
        from kvpool.llm import offline

        return getattr(offline, name)
    raise AttributeError(f"module 'kvpool' has no attribute {name!r}")
