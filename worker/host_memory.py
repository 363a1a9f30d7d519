"""What the machine can still give a worker's KV cache, checked before the pool is registered.

A KV cache larger than the device (or, on CPU, the host) can hold would be registered, then
allocated until the kernel's OOM killer fires: a whole-host event. ``check_kv_request`` refuses
it at start-up, naming both numbers and the setting to change.

- CUDA: the device's free memory now (``torch.cuda.mem_get_info``), after the model is loaded.
- CPU: the host's ``MemAvailable`` (/proc/meminfo), lowered to the cgroup's room
  (``memory.max - memory.current``, v2; ``memory.limit_in_bytes - memory.usage_in_bytes``, v1)
  when the process runs under a memory limit (containers, systemd's MemoryMax=).
"""

from __future__ import annotations

import os

import torch

from kvpool.worker.profiler import KVMemoryError

GiB = float(1 << 30)
CGROUP_ROOT = "/sys/fs/cgroup"


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max": no limit


def mem_available(meminfo: str = "/proc/meminfo") -> int | None:
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def cgroup_room(root: str = CGROUP_ROOT, self_cgroup: str = "/proc/self/cgroup") -> int | None:
    """Bytes this process's memory cgroup may still take; None without a limit."""
    rel = "/"
    try:
        with open(self_cgroup) as f:
            for line in f:
                if line.startswith("0::"):
                    rel = line.strip()[3:] or "/"
    except OSError:
        pass
    for base in (os.path.join(root, rel.lstrip("/")), root):
        limit, used = _read_int(os.path.join(base, "memory.max")), _read_int(os.path.join(base, "memory.current"))
        if limit is not None:
            return max(limit - (used or 0), 0)
    v1 = os.path.join(root, "memory")
    limit, used = _read_int(os.path.join(v1, "memory.limit_in_bytes")), _read_int(os.path.join(v1, "memory.usage_in_bytes"))
    if limit is not None and limit < 1 << 60:  # v1 says "no limit" with a huge number
        return max(limit - (used or 0), 0)
    return None


def host_available() -> tuple[int | None, str]:
    """(bytes the host can still give this process, where that figure comes from)."""
    avail, room = mem_available(), cgroup_room()
    if room is not None and (avail is None or room < avail):
        return room, "the memory cgroup's limit"
    return avail, "available host memory (MemAvailable)"


def device_available(device: torch.device) -> tuple[int | None, str]:
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the profile's forward left cached blocks: they are free for the KV cache
        free, _ = torch.cuda.mem_get_info(device)
        return free, f"free memory on {device}"
    return host_available()


def check_kv_request(kv_bytes: int, device: torch.device, setting: str) -> None:
    """Raises KVMemoryError when ``kv_bytes`` exceed what ``device`` can give now."""
    available, what = device_available(device)
    if available is not None and kv_bytes > available:
        raise KVMemoryError(
            f"the KV cache would take {kv_bytes / GiB:.2f} GiB ({kv_bytes} bytes) but {what} is "
            f"{available / GiB:.2f} GiB ({available} bytes): lower {setting}")
