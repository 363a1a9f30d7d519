"""Who may take over a pool's shard (the manager side of `kvpool worker --replace`).

Kept apart from the registry so the rule reads in one place: a new incarnation of a shard whose
registering session is still live is a second worker for the same pool, refused with
``shard_in_use`` unless its ``register`` says ``replace``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvpool.shared.protocol import ManagerError

if TYPE_CHECKING:
    from kvpool.manager.registry import Session, Shard


def refuse_live_owner(pool: str, shard: Shard, sid: str, sessions: dict[str, Session]) -> None:
    """A shard held by another live session (its worker runs) is not taken over silently: a
    second worker for the same pool is refused unless it asks to replace the first."""
    if shard.sid is None or shard.sid == sid or shard.sid not in sessions:
        return
    owner = sessions[shard.sid]
    raise ManagerError(
        "shard_in_use",
        f"shard {shard.rank} of pool {pool!r} is held by a live worker (session {owner.num}, "
        f"{owner.identity}); stop it first, or register with replace (kvpool worker --replace)",
    )
