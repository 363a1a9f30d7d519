"""kvpool.worker: one process per GPU (or CPU): model, memory profiler, KV tensors, scheduler,
engine, generate service (the answering side of shared/generate.py's messages), tensor
parallelism. Its manager client is ``kvpool.client.manager.ManagerClient``.

Import rule: from the manager the worker imports only ``kvpool.manager.core`` (its in-process
block manager runs the same Pool and step executor as the daemon); tests/test_layout.py checks it.
"""
