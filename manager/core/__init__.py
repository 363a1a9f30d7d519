"""kvpool.manager.core: the block-pool core (free queue, block pool, pool, KV-event records, step
executor, snapshot codec). The reference-trace benchmark that replays against it is kvpool.bench.

Pure Python with no I/O: no sockets, no Redis, no files. The daemon drives it from its loop; the
worker's in-process block manager and the benchmarks import it directly. This is the only part of
``kvpool.manager`` that the worker may import, and it imports nothing of the rest of the manager.
"""
