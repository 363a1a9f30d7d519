"""CURVE on the manager's control socket: encryption plus a list of allowed client keys.

The server side lives in shared/curve.py (``CurveServer``), shared with the worker's generate
socket. Admin ops still need the admin key on top (``admin_key``, PROTOCOL.md section 4).
"""

from __future__ import annotations

from kvpool.shared.curve import ZAP_DOMAIN, CurveServer

__all__ = ["ZAP_DOMAIN", "CurveServer"]
