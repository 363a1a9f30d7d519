"""kvpool.manager.store: persistence of the manager's state.

The memory store (``base``), the Redis store (``redis_store``: journal + snapshots; its Redis
calls in ``redis_link``, its snapshots in ``compaction``, its async writer, URL parsing),
the state-file codec, ``view`` (the ``StateView`` protocol: all the store sees of the registry)
and ``recovery`` (the ``Recovery`` object the server owns). The worker never imports it; the CLI
reaches it through ``kvpool.manager.snapshots``. It sits below the daemon: it imports the
registry's records (``kvpool.manager.state``) and the ``StateView`` protocol, never
``kvpool.manager``'s own modules; the registry implements the view.
"""
