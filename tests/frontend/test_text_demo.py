"""`kvpool demo`: text through the front door, sample completions and the routing report."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time

import pytest

from kvpool.bench.workload import chat_messages
from kvpool.devcluster.demo import TextDemoConfig, format_report, run_text_demo
from kvpool.devcluster.loadgen import ChatTraceConfig, chat_trace
from kvpool.shared.procs import CLI

pytestmark = pytest.mark.slow


def test_the_trace_is_multi_tenant_and_seeded() -> None:
    cfg = ChatTraceConfig(num_requests=40, num_tenants=3, seed=5)
    trace = chat_trace(cfg)
    assert trace == chat_trace(cfg) and {r.group for r in trace} == {0, 1, 2}
    systems = {r.group: chat_messages(r)[0]["content"] for r in trace}
    assert all(chat_messages(r)[0]["content"] == systems[r.group] for r in trace)  # one system prompt per tenant
    assert sum(r.n == 2 for r in trace) == 5


def test_text_demo_report() -> None:
    cfg = TextDemoConfig(ChatTraceConfig(num_requests=24, num_tenants=2), max_inflight=8)
    r = run_text_demo(cfg, progress=False)
    assert r["requests"] == 24 and r["failed"] == 0
    assert r["generated_tokens"] >= 24 * cfg.trace.max_tokens[0]
    assert 0 < r["prefix_hit_rate"] < 1 and r["ttft_p50_s"] > 0
    # every request routed, for a reason the report names; how many went by prefix depends on
    # timing (8 start at once: when all are routed before any is admitted, both workers cache
    # both tenants and no later choice is decided by a prefix), so that is tested where it is
    # deterministic: tests/frontend/test_routing.py
    assert sum(r["routing"]["by_reason"].values()) == 24 and set(r["routing"]["by_reason"]) <= {"prefix", "load"}
    assert len(r["samples"]) == 3 and all(s["completion"] for s in r["samples"])
    for p in r["pools"]:
        assert 0 < p["peak_blocks"] < p["static_blocks"]
    text = format_report(r)
    assert "gibberish" in text and "routing (kv-aware)" in text
    for figure in ("tokens/s", "prefix-cache hits", "preemptions", "routing", "peak ... blocks"):
        assert f"\n  {figure}" in text, f"the report explains {figure}"
    out = subprocess.run(CLI + ["demo", "--requests", "8", "--json"], capture_output=True, text=True,
                         timeout=120, check=True)
    assert "tokens_per_s" in out.stdout


def test_demo_says_what_starts_and_stops_at_once_on_ctrl_c() -> None:
    p = subprocess.Popen(CLI + ["demo", "--requests", "5000"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, start_new_session=True)  # its own group: a failure kills its children too
    try:
        first = p.stderr.readline()
        assert first.startswith("starting a manager") and "seeded random weights" in first, first
        assert "waiting for the workers" in p.stderr.readline()
        assert p.stderr.readline().startswith("ready in")
        time.sleep(1.0)
        p.send_signal(signal.SIGINT)
        t0 = time.monotonic()
        assert p.wait(15) == 130
        assert time.monotonic() - t0 < 10
        rest = p.stderr.read()
        assert "Traceback" not in rest
        lines = [ln for ln in rest.replace("\r", "\n").splitlines() if ln.strip() and "/s]" not in ln
                 and "requests" not in ln and "?" not in ln]
        assert lines == ["interrupted: the demo's manager and workers are stopped"], lines
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def test_kvpool_demo_with_a_host_tier_reports_hits_by_tier() -> None:
    """`kvpool demo --host-kv-memory`: small device pools push blocks out, the host tier serves
    some of them back, and the report splits each pool's hits into device and host."""
    import re

    from click.testing import CliRunner

    from kvpool.cli.main import cli
    from kvpool.worker.config import PRESETS

    tiny = PRESETS["tiny"]
    block_bytes = 2 * 16 * tiny.num_kv_heads * tiny.head_size * 4 * tiny.num_layers  # fp32, block 16
    help_text = CliRunner().invoke(cli, ["demo", "--help"]).output
    assert "--host-kv-memory" in help_text and "hits by tier" in help_text
    out = CliRunner().invoke(cli, ["demo", "--requests", "24", "--tenants", "6", "--max-inflight", "4",
                                   "--kv-blocks", "40", "--host-kv-memory", str(256 * block_bytes)])
    assert out.exit_code == 0, out.output
    tiers = re.findall(r"pool (demo-\d) +host tier (\d+)/255 blocks cached; hits ([\d.]+)% device \+ "
                       r"([\d.]+)% host; (\d+) saves, (\d+) loads", out.output)
    assert [t[0] for t in tiers] == ["demo-0", "demo-1"], out.output
    assert sum(int(t[4]) for t in tiers) > 0 and sum(int(t[5]) for t in tiers) > 0
    assert sum(float(t[3]) for t in tiers) > 0  # prompt tokens served by loads from host memory


@pytest.mark.slow
def test_kvpool_demo_with_a_node_tier_reports_hits_by_level():
    """Two workers sharing the manager's node tier: the report splits each pool's hits by level,
    and a tenant's prefix one worker computed is loaded by the other at least once."""
    import re

    from click.testing import CliRunner

    from kvpool.cli.main import cli

    assert "--node-tier-memory" in CliRunner().invoke(cli, ["demo", "--help"]).output
    out = CliRunner().invoke(cli, ["demo", "--requests", "40", "--tenants", "4", "--max-inflight", "4",
                                   "--kv-blocks", "40", "--node-tier-memory", "8MiB"])
    assert out.exit_code == 0, out.output
    levels = re.findall(r"pool (demo-\d) +hits ([\d.]+)% device \+ ([\d.]+)% host \+ ([\d.]+)% node host \+ "
                        r"([\d.]+)% node disk", out.output)
    assert [lv[0] for lv in levels] == ["demo-0", "demo-1"], out.output
    assert sum(float(lv[3]) for lv in levels) > 0, out.output  # prompt tokens loaded from the node tier
