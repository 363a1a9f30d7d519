"""The tests' one helper package (importable as ``helpers``: tests/ is on sys.path through the
root conftest.py). Fixtures live in tests/conftest.py; these are plain functions and classes.

- ``helpers.manager``: the base KV spec, one request through a Server, ``LiveServer`` (a Server
  looping in a thread), metrics scraping, ``stop_process`` (a subscriber folds KV events
  with ``kvpool.manager.event_client.CachedView``).
- ``helpers.durable``: Redis namespaces, a journaling in-memory store, ``Daemon`` processes.
- ``helpers.worker`` / ``helpers.tp``: tiny engines and tensor-parallel pairs.
- ``helpers.kv_spec``: the one test KV spec (``SPEC``), also read by the process scripts.
- ``helpers.frontend``: ``Stack``, a ``kvpool.devcluster`` cluster behind an in-process front door
  (the multi-process tests start clusters with ``kvpool.devcluster.cluster.DevCluster``).
- ``helpers.vllm_structs``: vLLM's KV-event structs (0.33.0, 0.11.0, or a real wheel's own classes).
- ``helpers.hf``: tiny checkpoints saved by transformers itself, and its greedy ``generate``.
- ``manager_procs.py`` / ``chaos_procs.py``: scripts the multi-process tests run (``HELPERS``).
"""
