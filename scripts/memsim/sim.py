"""The step loop every strategy shares, and the runs built on it: all strategies, block-size sweep."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict, replace

import numpy as np

from .contiguous import Contiguous
from .paged import Paged
from .trace import Seq, SimConfig, TraceRequest, make_trace, trace_stats

STRATEGIES = ("static", "doubling", "paged", "paged+prefix", "paged+host")
SWEEP_BLOCK_SIZES = (8, 16, 32, 64, 128)


def make_strategy(name: str, cfg: SimConfig) -> Contiguous | Paged:
    if name in ("static", "doubling"):
        return Contiguous(cfg, doubling=name == "doubling")
    if name in ("paged", "paged+prefix", "paged+host"):
        return Paged(cfg, sharing=name != "paged", host=name == "paged+host")
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
            "host_hit_rate": st.host_hit_tokens / st.lookup_tokens if paged and st.lookup_tokens else 0.0,
            "host_bytes_copied": st.host_bytes_copied if paged else 0,
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
    """The targets for paged+prefix (static is at cfg.max_model_len)."""
    p, s = results["paged+prefix"], results["static"]
    return {"waste_below_2pct": p["internal_waste_pct"] < 2.0,
            "peak_requests_4x_static": p["peak_requests"] >= 4 * s["peak_requests"],
            "mean_requests_4x_static": p["mean_requests"] >= 4 * s["mean_requests"]}



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
