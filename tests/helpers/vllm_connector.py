"""scripts/vllm_connector_servers.py for the tests (the scripts are not a package: its folder goes
on sys.path, as running one does)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

from vllm_connector_servers import (  # noqa: E402
    BLOCK_SIZE,
    build_package,
    metric,
    start_manager,
    start_vllm,
)

__all__ = ["BLOCK_SIZE", "build_package", "metric", "start_manager", "start_vllm"]
