"""Worker edges an operator meets: sizes as strings, request ids, oversized integers, and the
memory check that refuses a KV cache the machine cannot give."""

from __future__ import annotations

import os

import pytest
import torch
from helpers.worker import make_engine, make_prompt

from kvpool.client.generate import GenerateClient
from kvpool.worker import host_memory
from kvpool.worker.config import WorkerConfig
from kvpool.worker.profiler import KVMemoryError


def test_worker_config_takes_sizes_as_strings_like_the_cli():
    cfg = WorkerConfig(kv_cache_memory="16MiB", cpu_memory_budget="1.5GiB")
    assert cfg.kv_cache_memory == 16 << 20 and cfg.cpu_memory_budget == 3 << 29
    with pytest.raises(ValueError, match="cannot parse a memory size from 'lots'"):
        WorkerConfig(kv_cache_memory="lots")


def test_request_ids_are_consecutive():
    engine = make_engine()
    assert [engine.add_request(make_prompt(5, i)) for i in range(3)] == ["req-0", "req-1", "req-2"]


def test_an_integer_beyond_64_bits_is_a_clear_error(tmp_path):
    client = GenerateClient(f"ipc://{tmp_path}/none.sock")
    try:
        with pytest.raises(ValueError, match="integers must fit in 64 bits"):
            client.submit([5, 1 << 64])
    finally:
        client.close()


def write(path, text: str) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    return str(path)


def test_cgroup_room_and_mem_available_are_read_from_the_kernel_files(tmp_path):
    meminfo = write(tmp_path / "meminfo", "MemTotal: 100 kB\nMemAvailable:   2048 kB\n")
    assert host_memory.mem_available(meminfo) == 2048 * 1024
    root, self_cg = tmp_path / "cg", write(tmp_path / "self", "0::/svc.slice/w.service\n")
    write(root / "svc.slice/w.service/memory.max", "1000000\n")
    write(root / "svc.slice/w.service/memory.current", "400000\n")
    assert host_memory.cgroup_room(str(root), self_cg) == 600000
    write(root / "svc.slice/w.service/memory.max", "max\n")  # no limit here: none at the root either
    assert host_memory.cgroup_room(str(root), self_cg) is None


def test_a_kv_cache_beyond_what_the_host_has_is_refused_naming_both_numbers_and_the_flag(monkeypatch):
    monkeypatch.setattr(host_memory, "host_available", lambda: (3 << 30, "available host memory (MemAvailable)"))
    host_memory.check_kv_request(2 << 30, torch.device("cpu"), "--kv-cache-memory")
    with pytest.raises(KVMemoryError) as e:
        host_memory.check_kv_request(1 << 40, torch.device("cpu"), "--kv-cache-memory")
    msg = str(e.value)
    assert "1024.00 GiB" in msg and "3.00 GiB" in msg and "lower --kv-cache-memory" in msg


def test_on_cuda_the_device_free_memory_is_the_limit(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (10 << 30, 80 << 30))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    with pytest.raises(KVMemoryError, match=r"free memory on cuda:0 is 10.00 GiB .*: lower --memory-utilization"):
        host_memory.check_kv_request(30 << 30, torch.device("cuda", 0), "--memory-utilization")
