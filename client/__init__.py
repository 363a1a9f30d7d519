"""kvpool.client: every client of kvpool's two protocols, one core each with a sync and an
asyncio transport (as redis-py splits ``redis`` and ``redis.asyncio``).

- the manager protocol (shared/protocol.py, PROTOCOL.md): ``manager_core.py`` (session state,
  requests, replies, errors, retry decisions), ``manager.py`` (``ManagerClient``, sync; its step
  replies taken by ``reply_receiver.py`` during the caller's compute), ``manager_async.py``
  (``AsyncManagerClient``, asyncio: the front door);
- the generate protocol (shared/generate.py, PROTOCOL.md section 12): ``generate_core.py``
  (request ids, messages, what a reply means for a stream), ``generate.py`` (``GenerateClient``,
  sync: ``kvpool generate``, tests), ``generate_async.py`` (``WorkerLink``, asyncio: the front door);
- ``retry.py``: the one ``RetryPolicy`` every retry loop runs on.

Imports only ``kvpool.shared``. Nothing else in the project builds these messages by hand
(tests/test_layout.py checks it).
"""
