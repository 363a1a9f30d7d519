"""kvpool.integrations: adapters that let other engines use kvpool's parts. ``vllm``: a KV
connector through which vLLM servers share and keep prefixes in kvpool's node tier.

Import rule: the shared records, the clients and the worker's node store (the bytes of the node
tier) only; nothing of the manager daemon (tests/test_layout.py checks it).
"""
