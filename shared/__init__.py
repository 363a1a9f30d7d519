"""kvpool.shared: the contract between processes: the wire protocol and its records (``KVSpec``),
block hashing, layered config, metrics exposition, sd_notify, CURVE keys, the reference trace.

Import rule: shared imports nothing else of kvpool; every other package may import it.
"""
