"""The worker's host KV tier: pinned host tensors and the block copies to and from them.

A host cache mirrors the device cache's per-layer layout ``[2, blocks, block_size, heads,
head_size]`` with the host tier's block count, in host memory (pinned on CUDA so copies run
asynchronously). ``HostCopier`` runs each step's orders: its ``saves`` (device -> host) before
its ``loads`` (host -> device), both before the step's copy-on-write copies and forward pass,
and its ``writes`` (device -> host, the write-through policy) after that forward, which computes
their K/V (worker/runner.py); one batched transfer per kind: the manager's ordering rules
(manager/core/host_tier.py) assume it. ``HostCopyStats`` counts them and the time they take.

One ordering logic for both devices; only where the work runs differs. On CUDA the copies run
on a side stream and the forward pass waits on an event (``ready``) instead of the host thread;
on CPU every call completes when it returns, the same steps in the same order:

1. ``settle``: the previous step's saves and writes land in the host tensors (on CUDA after its
   ``done`` event: the device -> host transfers finished). Every step starts with it, so a load
   never gathers a host block whose save or write is still in flight, and the host staging of a
   step is only released once its transfers are over.
2. the side stream waits for the main stream: the last forward pass wrote the device blocks a
   save reads, and may still read the ones a load overwrites.
3. saves: the device blocks are gathered into one device buffer (``[layers, 2, n, ...]``).
4. loads: the host blocks are gathered on the host into one staging buffer, sent in one
   transfer, and scattered into their device blocks; a load of a host block saved in this same
   step (the manager may demote a hash and load it back in one step) copies from the saves'
   device buffer instead, since that save lands only at the next settle.
5. ``ready`` is recorded and the main stream waits on it: the forward pass overwrites no block
   before its save was gathered, and attention reads no loaded block before it landed.
6. the saves' buffer goes to host staging in one transfer, behind the forward pass.
7. writes (``write``, once the forward's work is enqueued): the side stream waits on an event
   recorded on the main stream after that work, gathers the written blocks into one device
   buffer and sends it to host staging in one transfer; ``done`` is recorded after the step's
   last transfer, and step 1 of the next step scatters the staging into the host blocks. The
   next forward pass starts after that settle, so it overwrites no block before its write.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch


@dataclass
class HostCopyStats:
    """What the host tier's copies cost this worker: blocks per direction and the time spent in
    them (wall: the step waits for them; CPU: this process, all threads)."""

    saves: int = 0  # device -> host before the forward (demotions)
    loads: int = 0  # host -> device before the forward
    writes: int = 0  # device -> host after the forward (write-through)
    wall_s: float = 0.0
    cpu_s: float = 0.0


def allocate_host_caches(device_caches: list[torch.Tensor], num_blocks: int) -> list[torch.Tensor]:
    """Host tensors of ``num_blocks`` blocks shaped like ``device_caches`` (this shard's slice)."""
    pin = device_caches[0].device.type == "cuda"
    return [torch.zeros((c.shape[0], num_blocks, *c.shape[2:]), dtype=c.dtype, pin_memory=pin)
            for c in device_caches]


def host_bytes(host_caches: list[torch.Tensor]) -> int:
    return sum(c.numel() * c.element_size() for c in host_caches)


@dataclass
class InFlight:
    """One step's device -> host copies between ``HostCopier.run`` / ``write`` and the next
    ``settle``, in the order they were issued (saves, then writes)."""

    done: torch.cuda.Event | None = None  # after the step's last transfer; None on CPU (done already)
    # (K/V [layers, 2, n, block_size, heads, head_size] on the host, the host blocks [n] it lands in)
    landing: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    keep: list[torch.Tensor] = field(default_factory=list)  # buffers a transfer still reads


class HostCopier:
    """The host tier of one shard: its tensors and the step's block copies to and from them."""

    def __init__(self, device_caches: list[torch.Tensor], num_blocks: int) -> None:
        self.device_caches = device_caches
        self.host_caches = allocate_host_caches(device_caches, num_blocks)
        self.device = device_caches[0].device
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.in_flight: InFlight | None = None
        self.stats = HostCopyStats()

    @property
    def num_blocks(self) -> int:
        return self.host_caches[0].shape[1]

    @torch.inference_mode()
    def run(self, saves: list[tuple[int, int]], loads: list[tuple[int, int]]) -> None:
        """Issues a step's orders (``(device, host)`` saves, ``(host, device)`` loads); the
        current stream waits for them before whatever it runs next (the forward pass)."""
        if self.in_flight is None and not saves and not loads:
            return
        self._check(saves, "save")
        self._check([(d, h) for h, d in loads], "load")
        with self._timed():
            self.settle()
            if not saves and not loads:
                return
            side, main = self._streams()
            step = self.in_flight = InFlight()
            saved_at = {h: i for i, (_, h) in enumerate(saves)}
            with _on(side):
                if side is not None:
                    side.wait_stream(main)
                gathered = self._gather(self.device_caches, [d for d, _ in saves], self.device) if saves else None
                from_host = [(h, d) for h, d in loads if h not in saved_at]
                if from_host:
                    step.keep.append(self._load(from_host))
                if len(from_host) < len(loads):  # host blocks this step saves: not landed yet
                    self._load_saved(gathered, [(saved_at[h], d) for h, d in loads if h in saved_at])
                ready = _record(side)
                if gathered is not None:
                    self._send(step, gathered, [h for _, h in saves])
            if main is not None:
                main.wait_event(ready)
            self.stats.saves += len(saves)
            self.stats.loads += len(loads)

    @torch.inference_mode()
    def write(self, writes: list[tuple[int, int]]) -> None:
        """Issues a step's write-through orders (``(device, host)``) once the forward pass that
        computes those blocks is enqueued on the current stream; they land at the next settle."""
        if not writes:
            return
        self._check(writes, "write")
        with self._timed():
            side, main = self._streams()
            if self.in_flight is None:
                self.in_flight = InFlight()
            with _on(side):
                if side is not None:
                    side.wait_event(_record(main))  # after the forward's K/V writes
                gathered = self._gather(self.device_caches, [d for d, _ in writes], self.device)
                self._send(self.in_flight, gathered, [h for _, h in writes])
            self.stats.writes += len(writes)

    @torch.inference_mode()
    def settle(self) -> None:
        """Waits for the last step's transfers and puts its saves and writes into the host blocks."""
        step, self.in_flight = self.in_flight, None
        if step is None:
            return
        if step.done is not None:
            step.done.synchronize()
        for kv, dst in step.landing:
            for layer, host in enumerate(self.host_caches):
                host.index_copy_(1, dst, kv[layer])

    def _check(self, orders: list[tuple[int, int]], what: str) -> None:
        """Every ``(device, host)`` pair in range, before anything is issued: on CUDA an index out
        of range is a device-side assert that leaves the context unusable, not an exception."""
        dev_n, host_n = self.device_caches[0].shape[1], self.num_blocks
        for d, h in orders:
            if not (0 <= d < dev_n and 0 <= h < host_n):
                raise ValueError(f"host tier {what} ({d} device, {h} host) out of range: "
                                 f"{dev_n} device blocks, {host_n} host blocks")

    def _streams(self) -> tuple[torch.cuda.Stream | None, torch.cuda.Stream | None]:
        """(side, main); the main stream is read outside the side's context. None, None on CPU."""
        if self.stream is None:
            return None, None
        return self.stream, torch.cuda.current_stream(self.device)

    def _send(self, step: InFlight, gathered: torch.Tensor, host_blocks: list[int]) -> None:
        """The gathered device blocks to host staging in one transfer, on the current (side)
        stream; ``done`` moves behind it."""
        step.landing.append((gathered.to("cpu", non_blocking=True), torch.tensor(host_blocks, dtype=torch.int64)))
        step.keep.append(gathered)
        step.done = _record(self.stream)

    @contextlib.contextmanager
    def _timed(self):
        """The time the host thread spends issuing and settling copies, into ``stats``."""
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            self.stats.wall_s += time.perf_counter() - wall
            self.stats.cpu_s += time.process_time() - cpu

    def _load_saved(self, gathered: torch.Tensor, loads: list[tuple[int, int]]) -> None:
        """Loads of host blocks saved earlier in this step (the manager may demote a hash and load
        it back in one step: saves run before loads): from the saves' device buffer, since those
        saves reach the host tensors only at the next settle."""
        src, dst = _index([i for i, _ in loads], self.device), _index([d for _, d in loads], self.device)
        for layer, cache in enumerate(self.device_caches):
            cache.index_copy_(1, dst, gathered[layer].index_select(1, src))

    def _load(self, loads: list[tuple[int, int]]) -> torch.Tensor:
        """Host blocks into device blocks: one gather on the host, one transfer, one scatter per
        layer on the device; returns the host staging the transfer reads."""
        staging = self._gather(self.host_caches, [h for h, _ in loads], torch.device("cpu"),
                               pin=self.device.type == "cuda")
        moved = staging.to(self.device, non_blocking=True)
        dst = _index([d for _, d in loads], self.device)
        for layer, cache in enumerate(self.device_caches):
            cache.index_copy_(1, dst, moved[layer])
        return staging

    @staticmethod
    def _gather(caches: list[torch.Tensor], blocks: list[int], device: torch.device,
                pin: bool = False) -> torch.Tensor:
        """Blocks ``blocks`` of every layer of ``caches`` in one tensor [layers, 2, n, ...]."""
        first = caches[0]
        idx = _index(blocks, device)
        out = torch.empty((len(caches), first.shape[0], len(blocks), *first.shape[2:]), dtype=first.dtype,
                          device=device, pin_memory=pin)
        for layer, cache in enumerate(caches):
            torch.index_select(cache, 1, idx, out=out[layer])
        return out


def _index(blocks: list[int], device: torch.device) -> torch.Tensor:
    """Block ids on ``device``; to CUDA from pinned memory, so the host thread does not wait for
    the side stream (a copy from pageable memory synchronizes the stream it is issued on)."""
    idx = torch.tensor(blocks, dtype=torch.int64)
    return idx.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else idx


def _on(stream: torch.cuda.Stream | None):
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def _record(stream: torch.cuda.Stream | None) -> torch.cuda.Event | None:
    if stream is None:
        return None
    event = torch.cuda.Event()
    event.record(stream)
    return event
