"""kvpool.manager.state: the registry's records, below both the store and the daemon.

``entries`` (a session, a shard, a pool entry: what the registry holds) and ``mutations`` (its
journaled changes as typed records, with their one wire codec). Pure data over
``kvpool.manager.core`` and ``kvpool.shared``: the store persists these records and the daemon's
``Registry`` (manager/registry.py) is the one writer of their state; neither is imported here.
"""
