"""kvpool.manager: the daemon that owns every block pool's bookkeeping.

Four parts, with different rules:
- ``kvpool.manager.core``: the block-pool core, pure and without I/O (the worker may import it);
- ``kvpool.manager.state``: the registry's records (entries, journaled mutations), below the store;
- ``kvpool.manager.store``: persistence (memory and Redis stores, journal, state files, recovery);
- the daemon's own modules here: ``server`` (the loop), ``handlers`` (with ``admin_ops``),
  ``registry`` (all state, its one writer; its fields and commit protocol in ``registry_state``),
  ``snapshots`` (state in and out of files and namespaces), ``loop_hooks``
  (CURVE, KV-event sockets, metrics, notify), ``events`` (vLLM-format publisher) and
  ``event_client``, ``metrics``, ``auth``, ``stats``, ``config``.

Import rule: the worker imports only ``kvpool.manager.core``; the CLI only the core and the
public entry points listed in kvpool.cli's docstring; nothing in ``core`` imports the rest;
``state`` imports only ``core``; ``store`` only ``core`` and ``state``.
"""
