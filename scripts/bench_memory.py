#!/usr/bin/env python3
"""KV memory strategies replayed on one trace under one KV budget, with plots.

One seeded trace (long-tailed lognormal prompt and output lengths; a share of requests start with
one of a few shared system prompts; another share asks for n=4 parallel samples) is replayed
token by token against five strategies holding the same number of KV token slots:

  static         each sequence reserves max_model_len contiguous slots (first-fit allocator).
  doubling       each sequence holds a contiguous region of pow2 >= prompt+1 slots; when full it
                 is reallocated at twice the size (allocate new, copy the written KV, free old).
  paged          the real kvpool.manager.core.pool.Pool, enable_caching=False; n samples = n requests.
  paged+prefix   the real Pool with prefix caching; n samples = 1 allocation + (n-1) forks that
                 share the prompt copy-on-write (the worker copies a shared partial block).
  paged+host     paged+prefix with the pool's host tier behind the device blocks (--host-budget-x
                 times as many host blocks, default 4: 32 GiB of host memory at the default budget;
                 --host-policy, default demote): evicted cached blocks are saved there and a prefix
                 found there is loaded back. Host memory is outside the budget: the device metrics
                 are paged+prefix's, the prefix hit rate counts the host tier's hits too.

Time is in steps. Requests arrive as a Poisson stream (--arrival-rate per step, default 1: faster
than any strategy serves them, so memory limits the batch; 0: all at step 0). A step: (1) admit
FCFS from the queue head while the strategy fits it (the prompt is prefilled, all n samples at
once); (2) every running sequence writes one decode token's KV, oldest request first; a sequence
that reaches its output length frees its memory. A growing strategy that cannot grow a sequence
preempts the newest running request (all its samples; recompute: it restarts from its prompt at
the queue head), as vLLM does. Growing strategies admit only while a watermark (1% of the pool)
stays free; static reserves everything up front and needs none.

Metrics, all over the same pool of ``budget_tokens`` slots (paged: (num_blocks - 1) * block_size):
  peak / mean concurrent requests   running requests (an n=4 request counts once; sequences are
                                    reported too); mean over the *saturated* steps, those that end
                                    with requests still waiting (memory is the bottleneck).
  written %            slots holding live KV (a slot shared by forks or prefix hits counts once).
  internal waste %     slots reserved by a sequence but not (yet) holding KV: static's slots past
                       the sequence's length, doubling's unused capacity, paged's empty tail of
                       the last block of each sequence. Mean over saturated steps, % of the pool;
                       also given as % of reserved slots.
  external frag. %     free slots in extents too small for the region the queue head needs
                       (max_model_len when none waits), % of the pool; 0 for paged by construction.
                       frag_refusals counts allocations refused although enough slots were free.
  free %               slots in no reservation (paged: free blocks, cached ones included).
                       written + internal waste + free = 100% at every step (checked with --check).
  bytes copied         doubling: written KV moved by reallocations; paged+prefix: whole blocks
                       copied on copy-on-write; others 0. KV bytes per token: --kv-bytes (default
                       Llama-3-8B, 2 * 32 layers * 8 kv heads * 128 * 2 bytes = 128 KiB).
  prefix hit rate      prompt tokens served from the prefix cache / prompt tokens looked up
                       (paged+host: host_hit_rate of them from the host tier, and
                       host_bytes_copied between the tiers: saves, writes and loads).
  steps                steps to drain the trace; useful decode tokens per step is a memory-bound
                       throughput proxy (it ignores that a bigger batch makes a slower step).
  preemptions          requests restarted; discarded_tokens: KV slots they had written.
  block-table entries  mean blocks per running sequence (paged); rows are max_model_len /
                       block_size entries wide.

    python scripts/bench_memory.py                   # default trace, PNGs + JSON in results/
    python scripts/bench_memory.py --out docs/img    # regenerate the figures of docs/results.md
    python scripts/bench_memory.py --quick --check   # small trace, accounting checked every step
    python scripts/bench_memory.py --out docs/img --e2e-only   # the real worker only (e2e.png)

End to end (--e2e): tokens/s of the real worker (scripts/bench_worker.py) in its
static, paged and paged+prefix modes at one KV budget, on a trace with shared system prompts; its
results go into the JSON under "end_to_end" and into e2e.png. Doubling has no real worker;
the host tier's real-worker comparison is scripts/bench_tier.py.
The code lives in scripts/memsim/ (trace, contiguous, paged, sim, report, e2e).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from memsim.e2e import E2E_QUICK, end_to_end, plot_e2e, print_e2e
from memsim.report import plot, print_report
from memsim.sim import run_all
from memsim.trace import SimConfig

QUICK = {"num_requests": 300, "budget_tokens": 32768}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = SimConfig()
    ap.add_argument("--quick", action="store_true", help=f"small trace for tests: {QUICK}; tiny model for --e2e")
    ap.add_argument("--out", type=Path, default=Path("results"), help="folder for the PNGs and bench_memory.json")
    ap.add_argument("--requests", type=int, default=None, help=f"default {d.num_requests}")
    ap.add_argument("--budget-tokens", type=int, default=None, help=f"KV token slots, default {d.budget_tokens}")
    ap.add_argument("--max-model-len", type=int, default=d.max_model_len)
    ap.add_argument("--block-size", type=int, default=d.block_size)
    ap.add_argument("--kv-bytes", type=int, default=d.kv_bytes_per_token, help="KV bytes per token")
    ap.add_argument("--arrival-rate", type=float, default=d.arrival_rate, help="requests per step; 0: all at once")
    ap.add_argument("--watermark", type=float, default=d.watermark)
    ap.add_argument("--host-budget-x", type=float, default=d.host_budget_x,
                    help="paged+host: host tier blocks per device block")
    ap.add_argument("--host-policy", choices=("demote", "write_through"), default=d.host_policy,
                    help="paged+host: when blocks are copied to the host tier")
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--check", action="store_true", help="check the accounting and pool invariants every step")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--json", action="store_true", help="print the JSON report instead of tables")
    ap.add_argument("--e2e", action="store_true", help="also measure the real worker's tokens/s (item 3)")
    ap.add_argument("--e2e-only", action="store_true",
                    help="measure only the real worker; keeps the simulator results already in --out")
    return ap.parse_args(argv)


def sim_config(args: argparse.Namespace) -> SimConfig:
    size = dict(QUICK) if args.quick else {}
    if args.requests is not None:
        size["num_requests"] = args.requests
    if args.budget_tokens is not None:
        size["budget_tokens"] = args.budget_tokens
    return SimConfig(max_model_len=args.max_model_len, block_size=args.block_size, kv_bytes_per_token=args.kv_bytes,
                     arrival_rate=args.arrival_rate, watermark=args.watermark, seed=args.seed,
                     host_budget_x=args.host_budget_x, host_policy=args.host_policy, **size)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    cfg = sim_config(args)
    log = (lambda *a: None) if args.json else print
    path = args.out / "bench_memory.json"
    report, series = {}, None
    if args.e2e_only:
        report = json.loads(path.read_text()) if path.exists() else {}
    else:
        report, series = run_all(cfg, check=args.check, log=log)
    if args.e2e or args.e2e_only:
        report["end_to_end"] = end_to_end(args.seed, E2E_QUICK if args.quick else None, log)
    args.out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    files = []
    if not args.no_plots:
        files += plot(report, series, args.out) if series is not None else []
        files += [plot_e2e(report["end_to_end"], args.out)] if "end_to_end" in report else []
    if args.json:
        print(json.dumps(report, indent=2))
        return report
    if series is not None:
        print_report(cfg, report)
    if args.e2e or args.e2e_only:
        print_e2e(report["end_to_end"])
    print("wrote", ", ".join(str(p) for p in [path, *files]))
    return report


if __name__ == "__main__":
    main()
