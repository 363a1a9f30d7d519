"""kvpool.cli: the `kvpool` command (click): one module per group of commands (``admin``: the
manager daemon and its queries; ``serve``: worker, generate, demo; ``state``: snapshot, restore;
``tools``: config show, events, keygen; ``bench``), and ``common`` (options, the manager
connection, output helpers, the one exit-status table).

Import rule: the CLI imports from ``kvpool.manager`` only ``kvpool.manager.core`` and the
manager's public entry points (``daemon.serve``, ``config.ManagerConfig``, ``snapshots``,
``event_client.EventTail``); it may import ``kvpool.worker``, ``kvpool.client`` and ``kvpool.shared`` freely.
tests/test_layout.py checks it.
"""
