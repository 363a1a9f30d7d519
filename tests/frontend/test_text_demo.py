"""`kvpool demo`: text through the front door, sample completions and the routing report."""

from __future__ import annotations

import pytest

from kvpool.frontend.demo import TextDemoConfig, format_report, run_text_demo
from kvpool.frontend.loadgen import ChatTraceConfig, chat_trace

pytestmark = pytest.mark.slow


def test_the_trace_is_multi_tenant_and_seeded() -> None:
    cfg = ChatTraceConfig(num_requests=40, num_tenants=3, seed=5)
    trace = chat_trace(cfg)
    assert trace == chat_trace(cfg) and {r.tenant for r in trace} == {0, 1, 2}
    systems = {r.tenant: r.messages[0]["content"] for r in trace}
    assert all(r.messages[0]["content"] == systems[r.tenant] for r in trace)  # one system prompt per tenant
    assert sum(r.n == 2 for r in trace) == 5


def test_text_demo_report() -> None:
    cfg = TextDemoConfig(ChatTraceConfig(num_requests=24, num_tenants=2), max_inflight=8)
    r = run_text_demo(cfg, progress=False)
    assert r["requests"] == 24 and r["failed"] == 0
    assert r["generated_tokens"] >= 24 * cfg.trace.max_tokens[0]
    assert 0 < r["prefix_hit_rate"] < 1 and r["ttft_p50_s"] > 0
    assert sum(r["routing"]["by_reason"].values()) == 24 and r["routing"]["by_reason"].get("prefix", 0) > 0
    assert len(r["samples"]) == 3 and all(s["completion"] for s in r["samples"])
    text = format_report(r)
    assert "gibberish" in text and "routing (kv-aware)" in text
