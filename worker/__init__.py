"""kvpool.worker: one process per GPU (or CPU): manager client, model, memory profiler, KV
tensors, scheduler, engine, generate service, tensor parallelism, demo.

Import rule: from the manager the worker imports only ``kvpool.manager.core`` (its in-process
block manager runs the same Pool and step executor as the daemon); tests/test_layout.py checks it.
"""
