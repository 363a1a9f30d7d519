"""Prometheus text exposition and a tiny HTTP endpoint that serves a snapshot.

The owning loop (manager or worker) renders its metrics into text from time to time and hands
the string to ``MetricsServer.update``; the HTTP thread only ever reads that string, so no
loop state is shared across threads (STYLE rule 6).
"""

from __future__ import annotations

import bisect
import logging
import threading
from collections.abc import Iterable, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)

Sample = tuple[dict[str, str], float]


class Histogram:
    """Cumulative-bucket histogram in the Prometheus sense (owned by one thread)."""

    def __init__(self, buckets: Sequence[float] = LATENCY_BUCKETS) -> None:
        self.bounds = list(buckets)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    @classmethod
    def of(cls, buckets: Sequence[float], counts: list[int], total: float, count: int) -> Histogram:
        """A histogram with these counts (one per bucket, then +Inf), their sum and number."""
        out = cls(buckets)
        out.counts, out.sum, out.count = list(counts), total, count
        return out

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def samples(self, name: str, labels: dict[str, str] | None = None) -> list[tuple[str, dict, float]]:
        labels = labels or {}
        out, running = [], 0
        for bound, c in zip([*self.bounds, float("inf")], self.counts):
            running += c
            le = "+Inf" if bound == float("inf") else repr(bound)
            out.append((f"{name}_bucket", {**labels, "le": le}, running))
        out.append((f"{name}_sum", labels, self.sum))
        out.append((f"{name}_count", labels, self.count))
        return out


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    body = ",".join(f'{k}="{_escape(str(v))}"' for k, v in sorted(labels.items()))
    return "{" + body + "}"


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _num(v: float) -> str:
    if v == float("inf"):
        return "+Inf"
    return repr(float(v)) if isinstance(v, float) else str(v)


def family(name: str, kind: str, help_text: str, samples: Iterable[Sample]) -> str:
    """One metric family (``kind``: counter, gauge) in text format."""
    lines = [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
    lines += [f"{name}{_labels(lb)} {_num(v)}" for lb, v in samples]
    return "\n".join(lines) + "\n"


def histogram_family(name: str, help_text: str, hists: Iterable[tuple[dict[str, str], Histogram]]) -> str:
    lines = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
    for labels, h in hists:
        lines += [f"{n}{_labels(lb)} {_num(v)}" for n, lb, v in h.samples(name, labels)]
    return "\n".join(lines) + "\n"


def parse_text(text: str) -> dict[tuple[str, tuple], float]:
    """Parses exposition text into {(name, sorted label items): value} (tests and `kvpool stats`)."""
    out: dict[tuple[str, tuple], float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, value = line.rsplit(" ", 1)
        labels: tuple = ()
        if "{" in head:
            name, body = head.split("{", 1)
            pairs = [p.split("=", 1) for p in body.rstrip("}").split('",') if p]
            labels = tuple(sorted((k, v.strip('"')) for k, v in pairs))
        else:
            name = head
        out[(name, labels)] = float(value.replace("+Inf", "inf"))
    return out


class MetricsServer:
    """Serves the latest rendered text at ``/metrics`` from a daemon thread."""

    def __init__(self, host: str, port: int) -> None:
        self._text = b""
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                if self.path.split("?")[0] not in ("/metrics", "/"):
                    self.send_error(404, "try /metrics")
                    return
                body = server._text
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, fmt: str, *args: object) -> None:
                log.debug("metrics http: " + fmt, *args)

        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="metrics-http", daemon=True)
        self._thread.start()

    def update(self, text: str) -> None:
        self._text = text.encode()  # one reference swap: atomic for the reader thread

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
