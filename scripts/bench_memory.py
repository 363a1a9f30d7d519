#!/usr/bin/env python3
"""KV memory strategies replayed on one trace under one KV budget, with plots (issue 9).

One seeded trace (long-tailed lognormal prompt and output lengths; a share of requests start with
one of a few shared system prompts; another share asks for n=4 parallel samples) is replayed
token by token against four strategies holding the same number of KV token slots:

  static         each sequence reserves max_model_len contiguous slots (first-fit allocator).
  doubling       each sequence holds a contiguous region of pow2 >= prompt+1 slots; when full it
                 is reallocated at twice the size (allocate new, copy the written KV, free old).
  paged          the real kvpool.manager.pool.Pool, enable_caching=False; n samples = n requests.
  paged+prefix   the real Pool with prefix caching; n samples = 1 allocation + (n-1) forks that
                 share the prompt copy-on-write (the worker copies a shared partial block).

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
  prefix hit rate      prompt tokens served from the prefix cache / prompt tokens looked up.
  steps                steps to drain the trace; useful decode tokens per step is a memory-bound
                       throughput proxy (it ignores that a bigger batch makes a slower step).
  preemptions          requests restarted; discarded_tokens: KV slots they had written.
  block-table entries  mean blocks per running sequence (paged); rows are max_model_len /
                       block_size entries wide.

    python scripts/bench_memory.py                   # default trace, PNGs + JSON in results/
    python scripts/bench_memory.py --out docs/img    # regenerate the figures of docs/results.md
    python scripts/bench_memory.py --quick --check   # small trace, accounting checked every step
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import time
from collections import deque
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from kvpool.manager.pool import Pool
from kvpool.shared.hashing import SEED, hash_block, hash_blocks, tokens_to_bytes

LLAMA3_8B_KV_BYTES = 2 * 32 * 8 * 128 * 2  # K and V * layers * kv heads * head size * bf16
STRATEGIES = ("static", "doubling", "paged", "paged+prefix")
SWEEP_BLOCK_SIZES = (8, 16, 32, 64, 128)


@dataclass(frozen=True)
class SimConfig:
    num_requests: int = 2000
    max_model_len: int = 4096
    budget_tokens: int = 65536  # 8 GiB of Llama-3-8B KV
    block_size: int = 16
    kv_bytes_per_token: int = LLAMA3_8B_KV_BYTES
    prompt_median: float = 128.0  # user part; lognormal, ShareGPT-like means
    prompt_sigma: float = 1.0
    output_median: float = 160.0
    output_sigma: float = 1.0
    system_share: float = 0.4
    num_system_prompts: int = 8
    system_min: int = 256
    system_max: int = 1024
    parallel_share: float = 0.2  # disjoint from the system-prompt share
    parallel_n: int = 4
    arrival_rate: float = 1.0  # Poisson arrivals, requests per step; 0: all at step 0
    watermark: float = 0.01
    vocab_size: int = 32000
    seed: int = 0

    def __post_init__(self) -> None:
        if self.budget_tokens < self.parallel_n * self.max_model_len:
            raise ValueError(f"budget_tokens {self.budget_tokens} cannot hold one n={self.parallel_n} request "
                             f"at max_model_len {self.max_model_len}: raise --budget-tokens")
        if self.budget_tokens % self.block_size:
            raise ValueError(f"budget_tokens {self.budget_tokens} is not a multiple of block_size {self.block_size}")
        if self.system_share + self.parallel_share > 1 or min(self.system_share, self.parallel_share) < 0:
            raise ValueError("need shares >= 0 with system_share + parallel_share <= 1")
        if not 1 <= self.system_min <= self.system_max < self.max_model_len // 2:
            raise ValueError("need 1 <= system_min <= system_max < max_model_len / 2")
        if self.num_requests < 1 or self.parallel_n < 1 or not 0 <= self.watermark < 0.5:
            raise ValueError("need num_requests >= 1, parallel_n >= 1, 0 <= watermark < 0.5")
        if self.arrival_rate < 0:
            raise ValueError(f"arrival_rate must be >= 0 (0: all at step 0), got {self.arrival_rate}")


@dataclass(frozen=True)
class TraceRequest:
    rid: int
    arrival: int  # step
    prompt: tuple[int, ...]
    out_lens: tuple[int, ...]  # one output length per parallel sample


def _lognormal(rng: np.random.Generator, median: float, sigma: float, size: int) -> np.ndarray:
    return np.rint(rng.lognormal(math.log(median), sigma, size)).astype(np.int64)


def make_trace(cfg: SimConfig) -> list[TraceRequest]:
    rng = np.random.default_rng(cfg.seed)
    systems = [rng.integers(0, cfg.vocab_size, rng.integers(cfg.system_min, cfg.system_max + 1)).tolist()
               for _ in range(cfg.num_system_prompts)]
    kind = rng.random(cfg.num_requests)
    gaps = rng.exponential(1 / cfg.arrival_rate, cfg.num_requests) if cfg.arrival_rate else np.zeros(cfg.num_requests)
    arrival = np.floor(np.cumsum(gaps)).astype(np.int64)
    user = np.clip(_lognormal(rng, cfg.prompt_median, cfg.prompt_sigma, cfg.num_requests), 1, cfg.max_model_len // 2)
    trace = []
    for rid in range(cfg.num_requests):
        head = systems[rng.integers(len(systems))] if kind[rid] < cfg.system_share else []
        prompt = (head + rng.integers(0, cfg.vocab_size, user[rid]).tolist())[: cfg.max_model_len - 1]
        n = cfg.parallel_n if cfg.system_share <= kind[rid] < cfg.system_share + cfg.parallel_share else 1
        outs = np.clip(_lognormal(rng, cfg.output_median, cfg.output_sigma, n), 1, cfg.max_model_len - len(prompt))
        trace.append(TraceRequest(rid, int(arrival[rid]), tuple(prompt), tuple(int(o) for o in outs)))
    return trace


class Seq:
    """The one mutable record of a running sequence (one parallel sample of a request)."""

    __slots__ = ("req", "idx", "uid", "out_len", "num_tokens", "generated", "start", "cap", "last_hash")

    def __init__(self, req: TraceRequest, idx: int, n_max: int) -> None:
        assert idx < n_max, f"request {req.rid} has more samples than parallel_n {n_max}"
        self.req, self.idx, self.uid = req, idx, req.rid * n_max + idx
        self.out_len = req.out_lens[idx]
        self.num_tokens = self.generated = 0  # KV slots written; decode tokens written
        self.start = self.cap = 0  # contiguous strategies: region [start, start + cap)
        self.last_hash = SEED  # paged+prefix: hash of the last full block

    def token(self, pos: int) -> int:
        """Token id at ``pos``: the prompt, then a deterministic stand-in for sampled tokens."""
        p = self.req.prompt
        return p[pos] if pos < len(p) else (self.uid * 1_000_003 + pos * 7919) % 32000


class FirstFit:
    """First-fit allocator over slots [0, size): sorted free extents, coalesced on release."""

    def __init__(self, size: int) -> None:
        self.starts, self.lens, self.free = [0], [size], size

    def alloc(self, n: int) -> int | None:
        for i, ln in enumerate(self.lens):
            if ln >= n:
                start = self.starts[i]
                if ln == n:
                    del self.starts[i], self.lens[i]
                else:
                    self.starts[i] += n
                    self.lens[i] -= n
                self.free -= n
                return start
        return None

    def release(self, start: int, n: int) -> None:
        i = bisect.bisect(self.starts, start)
        self.free += n
        if i and self.starts[i - 1] + self.lens[i - 1] == start:  # merge with the extent before
            i -= 1
            self.lens[i] += n
        else:
            self.starts.insert(i, start)
            self.lens.insert(i, n)
        if i + 1 < len(self.starts) and self.starts[i] + self.lens[i] == self.starts[i + 1]:
            self.lens[i] += self.lens.pop(i + 1)
            del self.starts[i + 1]


class Contiguous:
    """static (every region max_model_len) or doubling (pow2 regions, reallocated when full)."""

    def __init__(self, cfg: SimConfig, doubling: bool) -> None:
        self.cfg, self.doubling = cfg, doubling
        self.heap = FirstFit(cfg.budget_tokens)
        self.watermark = int(cfg.watermark * cfg.budget_tokens) if doubling else 0
        self.written = self.bytes_copied = self.copies = self.frag_refusals = 0
        self.lookup_tokens = self.hit_tokens = 0

    def _alloc(self, n: int) -> int | None:
        start = self.heap.alloc(n)
        if start is None and self.heap.free >= n:
            self.frag_refusals += 1
        return start

    def admit(self, req: TraceRequest, seqs: list[Seq]) -> bool:
        p = len(req.prompt)
        cap = self._region(p)
        if self.heap.free - cap * len(seqs) < self.watermark:
            return False
        got: list[Seq] = []
        for s in seqs:
            start = self._alloc(cap)
            if start is None:
                for g in got:
                    self.heap.release(g.start, cap)
                return False
            s.start, s.cap, s.num_tokens = start, cap, p
            got.append(s)
        self.written += p * len(seqs)
        return True

    def grow(self, s: Seq) -> bool:
        if s.num_tokens == s.cap:  # only doubling gets here: static holds max_model_len >= p + out
            new_cap = min(2 * s.cap, self.cfg.max_model_len)
            start = self._alloc(new_cap)  # the old region is held until the copy is done
            if start is None:
                return False
            self.bytes_copied += s.num_tokens * self.cfg.kv_bytes_per_token
            self.copies += 1
            self.heap.release(s.start, s.cap)
            s.start, s.cap = start, new_cap
        s.num_tokens += 1
        self.written += 1
        return True

    def release(self, s: Seq) -> None:
        self.heap.release(s.start, s.cap)
        self.written -= s.num_tokens

    def _region(self, prompt_len: int) -> int:
        mml = self.cfg.max_model_len
        return min(mml, 1 << prompt_len.bit_length()) if self.doubling else mml  # pow2 > prompt

    def usage(self, seqs: list[Seq], head: TraceRequest | None) -> tuple[int, int, int, int, int]:
        """(written, reserved unwritten, free, external fragmentation, block-table entries).

        External fragmentation: free slots in extents too small for the region the queue head
        needs (max_model_len when nothing waits).
        """
        heap = self.heap
        need = self._region(len(head.prompt)) if head else self.cfg.max_model_len
        frag = sum(n for n in heap.lens if n < need)
        return self.written, self.cfg.budget_tokens - heap.free - self.written, heap.free, frag, 0

    def recount_written(self, seqs: list[Seq]) -> int:
        """Written slots recounted; the regions and free extents must tile the pool (--check)."""
        extents = sorted([(s.start, s.cap) for s in seqs] + list(zip(self.heap.starts, self.heap.lens)))
        end = 0
        for start, n in extents:
            assert start == end, f"slots [{min(start, end)}, {max(start, end)}) lost or held twice"
            end = start + n
        assert end == self.cfg.budget_tokens, "extents do not cover the pool"
        assert all(s.num_tokens <= s.cap for s in seqs), "a sequence outgrew its region"
        return sum(s.num_tokens for s in seqs)


class Paged:
    """The real block-pool core. ``sharing``: prefix caching on and n samples forked (CoW)."""

    def __init__(self, cfg: SimConfig, sharing: bool) -> None:
        self.cfg, self.sharing, self.bs = cfg, sharing, cfg.block_size
        num_blocks = cfg.budget_tokens // cfg.block_size + 1  # + the null block
        self.pool = Pool(num_blocks, cfg.block_size, enable_caching=sharing)
        self.watermark = math.ceil(cfg.watermark * (num_blocks - 1))
        self.frag_refusals = 0
        self._hashes: dict[int, list[bytes]] = {}  # prompt hashes of the queue head, kept across steps

    @property
    def bytes_copied(self) -> int:
        return self.copies * self.bs * self.cfg.kv_bytes_per_token

    @property
    def copies(self) -> int:
        return self.pool.stats.cow_copies

    @property
    def lookup_tokens(self) -> int:
        return self.pool.stats.lookup_tokens

    @property
    def hit_tokens(self) -> int:
        return self.pool.stats.hit_tokens

    def admit(self, req: TraceRequest, seqs: list[Seq]) -> bool:
        p, bs, bp = len(req.prompt), self.bs, self.pool.blocks
        if self.sharing:
            hashes = self._hashes.get(req.rid) or self._hashes.setdefault(req.rid, hash_blocks(req.prompt, bs))
            hits = bp.lookup(hashes[: (p - 1) // bs])
            need = -(-p // bs) - len(hits) + bp.num_reclaimable(hits)
        else:
            hashes, need = [], -(-p // bs) * len(seqs)
        if need > bp.num_free - self.watermark:
            return False
        self._hashes.pop(req.rid, None)
        if self.sharing:
            assert self.pool.allocate(seqs[0].uid, hashes, p, p) is not None
            for s in seqs[1:]:
                self.pool.fork(seqs[0].uid, s.uid)
        else:
            for s in seqs:
                assert self.pool.allocate(s.uid, hashes, p, p) is not None
        last = hashes[-1] if hashes else SEED
        for s in seqs:
            s.num_tokens, s.last_hash = p, last
        return True

    def grow(self, s: Seq) -> bool:
        n, bs = s.num_tokens + 1, self.bs
        new_hashes: tuple[bytes, ...] = ()
        if self.sharing and n % bs == 0:  # the decode token fills a block: continue the chain
            data = tokens_to_bytes([s.token(i) for i in range(n - bs, n)])
            new_hashes = (hash_block(s.last_hash, data),)
        if self.pool.extend(s.uid, n, new_hashes) is None:
            return False
        if new_hashes:
            s.last_hash = new_hashes[0]
        s.num_tokens = n
        return True

    def release(self, s: Seq) -> None:
        self.pool.free(s.uid)

    def usage(self, seqs: list[Seq], head: TraceRequest | None) -> tuple[int, int, int, int, int]:
        bs, reqs = self.bs, self.pool.requests
        tails: dict[int, int] = {}  # partly written or empty blocks -> slots written (once if shared)
        entries = 0
        for s in seqs:
            r = reqs[s.uid]
            entries += len(r.blocks)
            for i in range(r.num_tokens // bs, len(r.blocks)):
                b = r.blocks[i]
                tails[b] = max(tails.get(b, 0), r.num_tokens - i * bs)
        unwritten = sum(bs - max(0, f) for f in tails.values())
        bp = self.pool.blocks
        return bp.num_used * bs - unwritten, unwritten, bp.num_free * bs, 0, entries

    def recount_written(self, seqs: list[Seq]) -> int:
        """Physical slots written, counted block by block (for --check)."""
        bs, fill = self.bs, {}
        for s in seqs:
            r = self.pool.requests[s.uid]
            assert r.num_tokens == s.num_tokens, f"seq {s.uid}: pool has {r.num_tokens}, sim {s.num_tokens}"
            for i, b in enumerate(r.blocks):
                fill[b] = max(fill.get(b, 0), min(bs, max(0, r.num_tokens - i * bs)))
        self.pool.check_invariants()
        return sum(fill.values())


def make_strategy(name: str, cfg: SimConfig) -> Contiguous | Paged:
    if name in ("static", "doubling"):
        return Contiguous(cfg, doubling=name == "doubling")
    if name in ("paged", "paged+prefix"):
        return Paged(cfg, sharing=name == "paged+prefix")
    raise ValueError(f"unknown strategy {name!r}; known: {STRATEGIES}")


Running = tuple[TraceRequest, list[Seq]]  # a running request and its live samples


class Sim:
    """The step loop shared by every strategy: FCFS admission, decode, preempt newest."""

    def __init__(self, cfg: SimConfig, trace: list[TraceRequest], name: str, check: bool = False) -> None:
        self.cfg, self.name, self.check = cfg, name, check
        self.strat = make_strategy(name, cfg)
        self.arriving: deque[TraceRequest] = deque(sorted(trace, key=lambda r: r.arrival))
        self.waiting: deque[TraceRequest] = deque()
        self.running: list[Running] = []
        self.done: dict[int, set[int]] = {}  # rid -> finished sample indices (kept over preemption)
        self.decode_tokens = self.discarded_decode = self.discarded_tokens = self.preemptions = 0
        self.cols: dict[str, list[int]] = {k: [] for k in
                                           ("requests", "seqs", "written", "unwritten", "free", "frag",
                                            "entries", "saturated")}

    def run(self) -> dict:
        t0, step = time.perf_counter(), 0
        while self.arriving or self.waiting or self.running:
            while self.arriving and self.arriving[0].arrival <= step:
                self.waiting.append(self.arriving.popleft())
            n_old = len(self.running)
            self._admit()
            if self.waiting and not self.running:
                raise RuntimeError(f"{self.name}: request {self.waiting[0].rid} fits no empty pool")
            self._decode(n_old)
            self._measure()
            step += 1
        return self._summary(time.perf_counter() - t0)

    def _admit(self) -> None:
        while self.waiting:
            req = self.waiting[0]
            fin = self.done.get(req.rid, ())
            seqs = [Seq(req, i, self.cfg.parallel_n) for i in range(len(req.out_lens)) if i not in fin]
            if not self.strat.admit(req, seqs):
                return
            self.waiting.popleft()
            self.running.append((req, seqs))

    def _decode(self, n_old: int) -> None:
        """One decode token for every sample of the requests admitted before this step."""
        running, i = self.running, 0
        while i < min(n_old, len(running)):
            req, seqs = running[i]
            for s in list(seqs):
                while not self.strat.grow(s):
                    victim = running.pop()
                    if not running:  # alone in the pool and still no room: it never will be
                        raise RuntimeError(f"{self.name}: request {req.rid} cannot grow in an empty pool; "
                                           "raise --budget-tokens")
                    self._preempt(victim)
                    if victim[1] is seqs:
                        return  # the oldest requests could not make room: this one was the newest
                s.generated += 1
                self.decode_tokens += 1
                if s.generated == s.out_len:
                    self.strat.release(s)
                    seqs.remove(s)
                    self.done.setdefault(req.rid, set()).add(s.idx)
            if seqs:
                i += 1
            else:
                running.pop(i)
                n_old -= 1

    def _preempt(self, victim: Running) -> None:
        req, seqs = victim
        for s in seqs:
            self.strat.release(s)
            self.discarded_decode += s.generated
            self.discarded_tokens += s.num_tokens
        self.preemptions += 1
        self.waiting.appendleft(req)  # recompute: back at the head, restarts from its prompt

    def _measure(self) -> None:
        live = [s for _, seqs in self.running for s in seqs]
        head = self.waiting[0] if self.waiting else None
        written, unwritten, free, frag, entries = self.strat.usage(live, head)
        if self.check:
            assert written + unwritten + free == self.cfg.budget_tokens, "slots do not add up to the pool"
            assert self.strat.recount_written(live) == written, "written slots miscounted"
        row = (len(self.running), len(live), written, unwritten, free, frag, entries, bool(self.waiting))
        for col, v in zip(self.cols.values(), row):
            col.append(v)

    def _summary(self, seconds: float) -> dict:
        a = {k: np.asarray(v, dtype=np.float64) for k, v in self.cols.items()}
        sat = a["saturated"] > 0
        if not sat.any():
            sat[:] = True
        pct = {k: 100 * float(a[k][sat].mean()) / self.cfg.budget_tokens
               for k in ("written", "unwritten", "free", "frag")}
        st, steps = self.strat, len(a["requests"])
        paged = isinstance(st, Paged)
        return {
            "strategy": self.name,
            "steps": steps,
            "peak_requests": int(a["requests"].max()),
            "mean_requests": float(a["requests"][sat].mean()),
            "peak_seqs": int(a["seqs"].max()),
            "mean_seqs": float(a["seqs"][sat].mean()),
            "written_pct": pct["written"],
            "internal_waste_pct": pct["unwritten"],
            "internal_waste_of_reserved_pct": 100 * float(a["unwritten"][sat].sum())
            / max(1.0, float((a["written"] + a["unwritten"])[sat].sum())),
            "ext_frag_pct": pct["frag"],
            "free_pct": pct["free"],
            "frag_refusals": st.frag_refusals,
            "bytes_copied": st.bytes_copied,
            "copies": st.copies,
            "prefix_hit_rate": st.hit_tokens / st.lookup_tokens if st.lookup_tokens else 0.0,
            "preemptions": self.preemptions,
            "discarded_tokens": self.discarded_tokens,
            "decode_tokens": self.decode_tokens,
            "useful_decode_tokens": self.decode_tokens - self.discarded_decode,
            "tokens_per_step": (self.decode_tokens - self.discarded_decode) / steps,  # useful ones
            "block_table_entries_per_seq": float(a["entries"][sat].sum() / a["seqs"][sat].sum()) if paged else None,
            "block_table_width": -(-self.cfg.max_model_len // self.cfg.block_size) if paged else None,
            "seconds": seconds,
            "series_requests": a["requests"].astype(np.int64).tolist(),
        }


def simulate(cfg: SimConfig, trace: list[TraceRequest], name: str, check: bool = False) -> dict:
    return Sim(cfg, trace, name, check).run()


def trace_stats(trace: list[TraceRequest]) -> dict:
    prompts = np.array([len(r.prompt) for r in trace])
    outs = np.array([o for r in trace for o in r.out_lens])
    return {
        "requests": len(trace),
        "sequences": len(outs),
        "parallel_requests": sum(len(r.out_lens) > 1 for r in trace),
        "prompt_mean": float(prompts.mean()), "prompt_p50": float(np.median(prompts)),
        "prompt_p99": float(np.percentile(prompts, 99)), "prompt_max": int(prompts.max()),
        "output_mean": float(outs.mean()), "output_p50": float(np.median(outs)),
        "output_p99": float(np.percentile(outs, 99)), "output_max": int(outs.max()),
        "output_tokens": int(outs.sum()),
    }


def sweep_block_sizes(cfg: SimConfig, trace: list[TraceRequest], sizes=SWEEP_BLOCK_SIZES) -> list[dict]:
    """paged+prefix at each block size: waste against block-table size (and hit rate, copies)."""
    rows = []
    for bs in sizes:
        r = simulate(replace(cfg, block_size=bs), trace, "paged+prefix")
        rows.append({"block_size": bs, **{k: r[k] for k in (
            "internal_waste_pct", "block_table_entries_per_seq", "block_table_width", "prefix_hit_rate",
            "mean_requests", "peak_requests", "bytes_copied", "preemptions", "steps")}})
    return rows


def ratios(results: dict[str, dict]) -> dict[str, dict]:
    base = results["static"]
    return {name: {"peak_requests": r["peak_requests"] / base["peak_requests"],
                   "mean_requests": r["mean_requests"] / base["mean_requests"],
                   "tokens_per_step": r["tokens_per_step"] / base["tokens_per_step"]}
            for name, r in results.items()}


def targets(cfg: SimConfig, results: dict[str, dict]) -> dict[str, bool]:
    """Issue 9's targets for paged+prefix (static is at cfg.max_model_len)."""
    p, s = results["paged+prefix"], results["static"]
    return {"waste_below_2pct": p["internal_waste_pct"] < 2.0,
            "peak_requests_4x_static": p["peak_requests"] >= 4 * s["peak_requests"],
            "mean_requests_4x_static": p["mean_requests"] >= 4 * s["mean_requests"]}


def _gib(n: float) -> str:
    return f"{n / 2**30:,.1f} GiB"


def print_report(cfg: SimConfig, report: dict) -> None:
    t, res, rat = report["trace"], report["strategies"], report["ratios"]
    print(f"trace: {t['requests']} requests ({t['parallel_requests']} with n={cfg.parallel_n}, "
          f"{t['sequences']} sequences), prompt mean/p99/max {t['prompt_mean']:.0f}/{t['prompt_p99']:.0f}/"
          f"{t['prompt_max']}, output mean/p99/max {t['output_mean']:.0f}/{t['output_p99']:.0f}/{t['output_max']}")
    print(f"budget: {cfg.budget_tokens:,} token slots = {_gib(cfg.budget_tokens * cfg.kv_bytes_per_token)} "
          f"at {cfg.kv_bytes_per_token // 1024} KiB/token; max_model_len {cfg.max_model_len}, "
          f"block_size {cfg.block_size}")
    print(f"{'strategy':<13}{'peak req':>9}{'mean req':>9}{'x static':>9}{'written':>9}{'int.waste':>10}"
          f"{'of rsvd':>8}{'ext.frag':>9}{'free':>7}{'copied':>12}{'hit rate':>9}{'preempt':>8}{'steps':>7}{'x tok/s':>8}")
    for name, r in res.items():
        print(f"{name:<13}{r['peak_requests']:>9}{r['mean_requests']:>9.1f}{rat[name]['mean_requests']:>8.1f}x"
              f"{r['written_pct']:>8.1f}%{r['internal_waste_pct']:>9.1f}%{r['internal_waste_of_reserved_pct']:>7.1f}%"
              f"{r['ext_frag_pct']:>8.1f}%"
              f"{r['free_pct']:>6.1f}%{_gib(r['bytes_copied']):>12}{r['prefix_hit_rate']:>9.1%}"
              f"{r['preemptions']:>8}{r['steps']:>7}{rat[name]['tokens_per_step']:>7.1f}x")
    print("block-size sweep (paged+prefix):")
    print(f"{'block':>7}{'int.waste':>10}{'entries/seq':>12}{'row width':>10}{'hit rate':>9}{'mean req':>9}"
          f"{'copied':>12}")
    for row in report["sweep"]:
        print(f"{row['block_size']:>7}{row['internal_waste_pct']:>9.2f}%{row['block_table_entries_per_seq']:>12.1f}"
              f"{row['block_table_width']:>10}{row['prefix_hit_rate']:>9.1%}{row['mean_requests']:>9.1f}"
              f"{_gib(row['bytes_copied']):>12}")
    p, tg = res["paged+prefix"], report["targets"]
    print(f"target: paged+prefix internal waste {p['internal_waste_pct']:.2f}% of the pool < 2%: "
          f"{'met' if tg['waste_below_2pct'] else 'NOT met'}")
    print(f"target: paged+prefix concurrent requests vs static at max_model_len {cfg.max_model_len}: "
          f"peak {rat['paged+prefix']['peak_requests']:.1f}x, mean {rat['paged+prefix']['mean_requests']:.1f}x "
          f"(>= 4x): {'met' if tg['peak_requests_4x_static'] and tg['mean_requests_4x_static'] else 'NOT met'}")


COLORS = {"static": "#7f7f7f", "doubling": "#d62728", "paged": "#1f77b4", "paged+prefix": "#2ca02c"}


def plot(report: dict, series: dict[str, list[int]], out: Path) -> list[Path]:
    """Writes concurrency.png, waste.png and block_size.png into ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res, paths = report["strategies"], []

    fig, ax = plt.subplots(figsize=(8, 4))
    for name, ys in series.items():
        k = max(1, len(ys) // 4000)  # every k-th step keeps the PNG small
        ax.plot(range(0, len(ys), k), ys[::k], lw=0.9, color=COLORS[name], label=name)
    ax.set(xlabel="step (one decode token per running sequence)", ylabel="running requests",
           title="Concurrent requests under the same KV budget (same trace)")
    ax.legend()
    ax.grid(alpha=0.3)
    paths.append(_save(fig, out / "concurrency.png"))

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4), gridspec_kw={"width_ratios": [3, 2]})
    names = list(res)
    labels = [f"{n}\n{_gib(res[n]['bytes_copied'])} copied" for n in names]
    parts = [("written KV", [res[n]["written_pct"] for n in names], "#2ca02c"),
             ("internal waste", [res[n]["internal_waste_pct"] for n in names], "#d62728"),
             ("free, fragmented", [res[n]["ext_frag_pct"] for n in names], "#ff7f0e"),
             ("free", [res[n]["free_pct"] - res[n]["ext_frag_pct"] for n in names], "#c7c7c7")]
    bottom = np.zeros(len(names))
    for label, vals, color in parts:
        a1.bar(labels, vals, bottom=bottom, color=color, label=label)
        bottom += vals
    a1.set(ylabel="% of KV pool (mean over saturated steps)", ylim=(0, 114), title="Where the KV memory goes")
    a1.set_yticks(range(0, 101, 20))
    a1.legend(fontsize=8, loc="upper center", ncol=4, handlelength=1)
    a1.tick_params(axis="x", labelsize=8)
    x = np.arange(len(names))
    a2.bar(x - 0.2, [res[n]["mean_requests"] for n in names], 0.4, label="mean", color="#1f77b4")
    a2.bar(x + 0.2, [res[n]["peak_requests"] for n in names], 0.4, label="peak", color="#aec7e8")
    for i, n in enumerate(names):
        a2.text(i - 0.2, res[n]["mean_requests"], f"{report['ratios'][n]['mean_requests']:.1f}x",
                ha="center", va="bottom", fontsize=8)
    a2.set_xticks(x, names, fontsize=8)
    a2.set(ylabel="concurrent requests", title="Batch size (x = mean vs static)")
    a2.legend(fontsize=8)
    paths.append(_save(fig, out / "waste.png"))

    sw = report["sweep"]
    fig, ax = plt.subplots(figsize=(7, 4))
    bss = [r["block_size"] for r in sw]
    ax.plot(bss, [r["internal_waste_pct"] for r in sw], "o-", color="#d62728", label="internal waste (% of pool)")
    ax.set(xscale="log", xlabel="block size (tokens)", ylabel="internal waste, % of pool",
           title="Block size: waste against block-table size (paged+prefix)")
    ax.set_xticks(bss, [str(b) for b in bss])
    ax.minorticks_off()
    ax2 = ax.twinx()
    ax2.plot(bss, [r["block_table_entries_per_seq"] for r in sw], "s--", color="#1f77b4",
             label="block-table entries per sequence (mean)")
    ax2.set(yscale="log", ylabel="block-table entries per sequence")
    fig.legend(loc="upper center", bbox_to_anchor=(0.45, 0.86), fontsize=8)
    ax.grid(alpha=0.3)
    paths.append(_save(fig, out / "block_size.png"))
    return paths


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    fig.clf()
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def run_all(cfg: SimConfig, check: bool = False, sweep: bool = True, log=print) -> tuple[dict, dict]:
    """Every strategy and the block-size sweep on one trace: (report, concurrency series)."""
    trace = make_trace(cfg)
    results, series = {}, {}
    for name in STRATEGIES:
        r = simulate(cfg, trace, name, check)
        series[name] = r.pop("series_requests")
        log(f"  {name:<13} {r.pop('seconds'):5.1f} s")  # kept out of the JSON: it stays reproducible
        results[name] = r
    report = {"config": asdict(cfg), "trace": trace_stats(trace), "strategies": results,
              "ratios": ratios(results), "sweep": sweep_block_sizes(cfg, trace) if sweep else [],
              "targets": targets(cfg, results)}
    return report, series


def end_to_end(cfg: SimConfig) -> dict:
    """Issue 9 item 3 (not wired yet): tokens/s of the real worker at this KV budget.

    To reuse scripts/bench_worker.py once it exists, run it on one request trace with the
    worker's kv_cache_memory = budget_tokens * kv_bytes_per_token (bytes, no profiling) for
    paged (enable_prefix_caching=False) and paged+prefix (True), and for static emulated as the
    same worker capped at max_num_seqs = budget_tokens // max_model_len, the batch that static
    preallocation allows. Doubling has no worker. Put the results in
    report["end_to_end"][strategy] = {"tokens_per_s": ...} and draw them as a bar chart.
    """
    worker = Path(__file__).with_name("bench_worker.py")
    state = "exists but is not wired in yet" if worker.exists() else "does not exist yet"
    raise SystemExit(f"--e2e: {worker} {state}; see end_to_end() in {Path(__file__).name}")


QUICK = {"num_requests": 300, "budget_tokens": 32768}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = SimConfig()
    ap.add_argument("--quick", action="store_true", help=f"small trace for tests: {QUICK}")
    ap.add_argument("--out", type=Path, default=Path("results"), help="folder for the PNGs and bench_memory.json")
    ap.add_argument("--requests", type=int, default=None, help=f"default {d.num_requests}")
    ap.add_argument("--budget-tokens", type=int, default=None, help=f"KV token slots, default {d.budget_tokens}")
    ap.add_argument("--max-model-len", type=int, default=d.max_model_len)
    ap.add_argument("--block-size", type=int, default=d.block_size)
    ap.add_argument("--kv-bytes", type=int, default=d.kv_bytes_per_token, help="KV bytes per token")
    ap.add_argument("--arrival-rate", type=float, default=d.arrival_rate, help="requests per step; 0: all at once")
    ap.add_argument("--watermark", type=float, default=d.watermark)
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--check", action="store_true", help="check the accounting and pool invariants every step")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--json", action="store_true", help="print the JSON report instead of tables")
    ap.add_argument("--e2e", action="store_true", help="also measure the real worker (item 3; not wired yet)")
    args = ap.parse_args(argv)
    size = dict(QUICK) if args.quick else {}
    if args.requests is not None:
        size["num_requests"] = args.requests
    if args.budget_tokens is not None:
        size["budget_tokens"] = args.budget_tokens
    cfg = SimConfig(max_model_len=args.max_model_len, block_size=args.block_size, kv_bytes_per_token=args.kv_bytes,
                    arrival_rate=args.arrival_rate, watermark=args.watermark, seed=args.seed, **size)
    if args.e2e:
        end_to_end(cfg)
    report, series = run_all(cfg, check=args.check, log=(lambda *a: None) if args.json else print)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_memory.json").write_text(json.dumps(report, indent=2) + "\n")
    files = [] if args.no_plots else plot(report, series, args.out)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(cfg, report)
        print("wrote", ", ".join(str(p) for p in [args.out / "bench_memory.json", *files]))
    return report


if __name__ == "__main__":
    main()
