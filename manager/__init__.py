"""kvpool.manager: the daemon that owns every block pool's bookkeeping.

Three parts, with different rules:
- ``kvpool.manager.core``: the block-pool core, pure and without I/O (the worker may import it);
- ``kvpool.manager.store``: persistence (memory and Redis stores, journal, state files, recovery);
- the daemon's own modules here: ``server`` (the loop), ``handlers``, ``registry`` (all state),
  ``mutations`` (its journaled records), ``loop_hooks`` (CURVE, KV-event sockets, metrics,
  notify), ``events`` (vLLM-format publisher) and ``event_client``, ``metrics``, ``auth``,
  ``stats``, ``config``.

Import rule: the worker imports only ``kvpool.manager.core``; the CLI only the core and the
public entry points listed in kvpool.cli's docstring; nothing in ``core`` imports the rest.
"""
