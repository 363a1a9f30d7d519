"""The contiguous strategies: static (max_model_len regions) and doubling, over a first-fit heap."""

from __future__ import annotations

import bisect

from .trace import Seq, SimConfig, TraceRequest


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
