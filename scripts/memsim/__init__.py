"""Memory simulator of KV strategies on one trace under one KV budget (scripts/bench_memory.py).

trace.py       SimConfig, the seeded trace, the running-sequence record
contiguous.py  static and doubling over a first-fit allocator
paged.py       paged, paged+prefix and paged+host over the real kvpool.manager.core.pool.Pool
sim.py         the step loop, every strategy on one trace, the block-size sweep
report.py      the text report and the figures
e2e.py         the real worker's tokens/s at one KV budget (scripts/bench_worker.py)
"""

from .contiguous import Contiguous, FirstFit
from .paged import Paged
from .sim import STRATEGIES, SWEEP_BLOCK_SIZES, make_strategy, run_all, simulate, sweep_block_sizes
from .trace import SimConfig, TraceRequest, make_trace, trace_stats

__all__ = ["STRATEGIES", "SWEEP_BLOCK_SIZES", "Contiguous", "FirstFit", "Paged", "SimConfig",
           "TraceRequest", "make_strategy", "make_trace", "run_all", "simulate", "sweep_block_sizes",
           "trace_stats"]
