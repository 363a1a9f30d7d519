"""The tests' one KV spec (wire form): 4-token blocks, 2 layers, 2 KV heads of 8, float16.

Small on purpose: block bytes stay tiny, a 32-token prompt is 8 full blocks. The process
scripts (manager_procs.py, chaos_procs.py) import it as well, so every test registers the same
pool shape; a test that needs another shape writes ``{**SPEC, key: value}``.
"""

SPEC = {"block_size": 4, "num_layers": 2, "num_kv_heads": 2, "head_size": 8, "dtype": "float16"}
