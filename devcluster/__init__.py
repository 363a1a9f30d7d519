"""kvpool.devcluster: kvpool on one machine, for the demo, the benchmarks and the tests.

- ``cluster.py``: ``DevCluster`` starts managers and CPU workers as child processes in a private
  directory (one spawn, one worker command line, one kill policy), ``ClusterConfig``.
- ``loadgen.py``: the HTTP load generator (streamed OpenAI chat completions, client-side TTFT)
  and its multi-tenant chat trace, as kvpool.bench's ``TraceRequest`` records.
- ``demo.py``: `kvpool demo`: a cluster, the front door, a chat trace through it, the report.

It sits above the product (it imports ``frontend`` and ``worker``); nothing in the product
imports it, only the CLI's demo command, scripts/ and tests/.
"""
