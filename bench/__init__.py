"""kvpool.bench: the benchmarks' reference workload and the in-process pool benchmark.

- ``workload.py``: ``TraceRequest``, the one request record of every benchmark workload (this
  reference trace, devcluster/loadgen.py's chat trace, scripts/memsim's trace), and its
  renderers (token ids, chat messages).
- ``trace.py``: the seeded reference request trace (token-id prompts, shared prefixes) that
  scripts/bench_pool.py, bench_manager.py, bench_worker.py and count_pool_work.py replay.
- ``pool.py``: that trace against an in-process ``Pool`` (``run_trace``, ``report_lines``),
  what `kvpool bench` and scripts/bench_pool.py print.

A package, not scripts/, because the installed `kvpool bench` command imports it; not in
``kvpool.manager.core`` or ``kvpool.shared``, because no product code runs a benchmark.
"""
