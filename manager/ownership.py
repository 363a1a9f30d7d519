"""Who may take over a pool's shard (the manager side of `kvpool worker --replace`).

Kept apart from the registry so the rule reads in one place: a new incarnation of a shard whose
registering session is still live is a second worker for the same pool, refused with
``shard_in_use`` unless its ``register`` says ``replace``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvpool.shared.protocol import ManagerError


def refuse_live_owner(pool: str, rank: int, holder: str | None, caller: str, sessions: Mapping[str, Any]) -> None:
    """Raises shard_in_use when shard ``rank`` is held by ``holder``, a live session other than
    ``caller`` (its worker runs): a second worker for the same pool is refused unless it asks
    to replace the first. ``sessions``: sid -> session (``num``, ``identity``)."""
    if holder is None or holder == caller or holder not in sessions:
        return
    owner = sessions[holder]
    raise ManagerError(
        "shard_in_use",
        f"shard {rank} of pool {pool!r} is held by a live worker (session {owner.num}, "
        f"{owner.identity}); stop it first, or register with replace (kvpool worker --replace)",
    )
