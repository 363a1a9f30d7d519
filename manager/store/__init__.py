"""kvpool.manager.store: persistence of the manager's state.

The memory store (``base``), the Redis store (journal + snapshots, its async writer, URL parsing),
the state-file codec, ``snapshots`` (verified state in and out of files and namespaces: what
`kvpool snapshot` / `restore` run) and ``recovery`` (the ``Recovery`` object the server owns).
Used by the daemon and, through ``snapshots``, by the CLI; the worker never imports it. The
store persists the registry (it imports it); the registry imports nothing of the store.
"""
