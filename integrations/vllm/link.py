"""The connector's scheduler side to the manager: one ``ManagerClient`` (kvpool.client), the
node-tier ops for an engine that owns its device blocks (PROTOCOL.md section 5, *Engines on the
node tier*), and what happens when the manager is not there.

vLLM's scheduler calls the connector on its own thread between steps, so a manager that does
not answer must cost it little and never stop it: every call has a short timeout (``timeout_s``)
and after a failure the link stays *down* for ``retry_s`` (each call answers "nothing" at once:
no hits, no saves; vLLM computes everything itself). The next call after that tries again:
a new session (the client says hello again), ``node_join`` again (a restarted manager has no
tier until then) and the call itself. Reports of batches sent to a manager that is gone are
dropped: that manager's batches are gone with it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from kvpool.client.manager import ManagerClient, ManagerError, ManagerRestarted, ManagerUnavailable
from kvpool.shared.node_orders import Order, order_from_wire
from kvpool.shared.node_tier import NodeTierInfo

logger = logging.getLogger(__name__)


@dataclass
class LinkStats:
    calls: int = 0
    failures: int = 0  # calls that found no manager (timeouts, refusals)
    rejoins: int = 0  # node_join again after a manager restart or a new session
    skipped: int = 0  # calls answered "nothing" while the link was down


@dataclass
class ManagerLink:
    endpoint: str
    spec: dict  # the KV spec of this shard's blocks (wire form)
    node_model: str
    rank: int = 0
    world: int = 1
    timeout_s: float = 2.0
    retry_s: float = 5.0
    info: NodeTierInfo | None = None  # the tier joined, None until then (and after a failure)
    stats: LinkStats = field(default_factory=LinkStats)
    _client: ManagerClient | None = None
    _down_until: float = 0.0

    def usable(self) -> bool:
        """Whether a call may go out now (the link is not resting after a failure)."""
        if time.monotonic() < self._down_until:
            self.stats.skipped += 1
            return False
        return True

    def lookup(self, hashes: list[bytes]) -> int:
        return self._call("node_lookup", hashes=hashes)["blocks"] if hashes else 0

    def load(self, batch: int, hashes: list[bytes], priority: int, done: list[dict]) -> tuple[int, list[Order]]:
        body = self._call("node_load", batch=batch, hashes=hashes, priority=priority, node_done=done)
        return body["blocks"], [order_from_wire(o) for o in body["orders"]]

    def save(self, batch: int, blocks: list[int], hashes: list[bytes], parents: list[bytes | None],
             priority: int, done: list[dict]) -> list[Order]:
        body = self._call("node_save", batch=batch, blocks=blocks, hashes=hashes, parents=parents,
                          priority=priority, node_done=done)
        return [order_from_wire(o) for o in body["orders"]]

    def done(self, reports: list[dict]) -> None:
        self._call("node_done", reports=reports)

    def _call(self, op: str, **args: object) -> dict:
        """One op on the layout's tier; ManagerError when there is no answer to use (the link
        then rests ``retry_s``)."""
        self.stats.calls += 1
        try:
            try:
                return self._joined_call(op, args)
            except ManagerError as e:
                if not isinstance(e, ManagerRestarted) and e.code != "unknown_layout":
                    raise
            self.info = None  # a restarted manager, a lost session: one new join
            return self._joined_call(op, args)
        except ManagerError as e:
            self._fail(op, e)
            raise

    def _joined_call(self, op: str, args: dict) -> dict:
        layout = self._join().layout
        return self._client.call(op, layout=layout, **args)  # type: ignore[union-attr]

    def _join(self) -> NodeTierInfo:
        if self.info is None:
            if self._client is None:
                self._client = ManagerClient(self.endpoint, timeout_s=self.timeout_s, failover_s=0.0,
                                             identity=f"vllm-connector:{self.node_model}"[:128])
            body = self._client.call("node_join", spec=self.spec, node_model=self.node_model, rank=self.rank,
                                     world=self.world)
            self.info = NodeTierInfo.from_wire(body["node_tier"])
            self.stats.rejoins += 1
            logger.info("kvpool connector: node tier %s at %s (%d host slots)", self.info.layout, self.endpoint,
                        self.info.host_slots)
        return self.info

    def _fail(self, op: str, e: ManagerError) -> None:
        self.stats.failures += 1
        self._down_until = time.monotonic() + self.retry_s
        self.info = None
        if isinstance(e, ManagerUnavailable) and self._client is not None:
            self._client.close()  # a fresh socket and session next time
            self._client = None
        logger.warning("kvpool connector: %s failed (%s); vLLM computes without the node tier for %.0f s",
                       op, e, self.retry_s)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
