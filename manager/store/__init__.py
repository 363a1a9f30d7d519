"""kvpool.manager.store: persistence of the manager's state.

The memory store (``base``), the Redis store (journal + snapshots, its async writer, URL parsing),
the state-file codec and recovery. Used by the daemon and the admin CLI's snapshot/restore; the
worker never imports it.
"""
