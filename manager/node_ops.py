"""The node tier's and the retention pins' ops: ``node_done`` (a worker's node-tier batches
run; a step message carries the same reports), and the admin ops ``pin``, ``unpin``, ``pins``
(PROTOCOL.md sections 5 and 6); an engine's ``node_done`` goes to manager/engine_ops.py. A mixin of ``Handlers`` (manager/handlers.py), registered with
``@op`` as the rest.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvpool.manager.core.node_tier import TierBatch
from kvpool.manager.core.retention import MAX_TTL_S
from kvpool.manager.guards import check_owner
from kvpool.manager.ops import Call, op
from kvpool.manager.state.entries import PoolEntry, Session
from kvpool.shared.node_orders import NodeReport, reports_from_wire
from kvpool.shared.protocol import bad_field, get_hashes, get_int

if TYPE_CHECKING:
    from kvpool.manager.registry import Registry

U63 = (1 << 63) - 1


def open_reports(reports: object, batch_of: Callable[[int], TierBatch | None]) -> list[NodeReport]:
    """The reports (a ``node_done`` list) whose batch ``batch_of`` still finds open, each checked
    against it first: ``bad_field`` for a failed or late order that is not its batch's, and then
    nothing may change. A batch no longer open (abandoned: an ended session, a re-formed pool, a
    manager restart) has nothing to finish."""
    out = []
    for r in reports_from_wire(reports):
        batch = batch_of(r.batch)
        if batch is None:
            continue
        for name, orders in (("failed", r.failed), ("late", r.late)):
            for order in orders:
                if order not in batch.orders:
                    raise bad_field(f"node_done.{name}", f"orders of batch {r.batch}", order.to_wire())
        out.append(r)
    return out


class NodeOps:
    reg: Registry

    @op()
    def node_done(self, call: Call) -> dict:
        """Node-tier batches a worker ran, when no step message carries them; with ``layout``
        instead of ``pool``, an engine's batches (manager/engine_ops.py)."""
        args, sess = call.args, call.sess
        if "layout" in args and "pool" not in args:
            return {"finished": self.finish_engine_batches(sess, args["layout"], args.get("reports"))}  # type: ignore[attr-defined]
        epoch = get_int(args, "epoch", 1, U63) if "epoch" in args else None
        entry, _ = self.reg.ready_pool(args.get("pool"), epoch)
        check_owner(self.reg, sess, entry)
        return {"finished": self.finish_node_batches(sess, entry, args.get("reports"))}

    def finish_node_batches(self, sess: Session, entry: PoolEntry, reports: object) -> int:
        """Validates every report against its batch first (nothing changes on bad input), then
        finishes each known batch; returns how many."""
        pool = entry.pool
        batches = pool.node.tier.batches if pool is not None and pool.node is not None else {}
        checked = open_reports(reports, lambda batch: batches.get((sess.sid, batch)))
        for r in checked:
            self.reg.node_finish(sess, entry, r.batch, [o.to_wire() for o in r.failed], [o.to_wire() for o in r.late])
        return len(checked)

    @op(admin=True)
    def pin(self, call: Call) -> dict:
        """Keeps a prefix's blocks from eviction for ``ttl_s`` seconds (manager/state/pins.py)."""
        args = call.args
        entry, _ = self.reg.ready_pool(args.get("pool"))
        hashes = get_hashes(args)
        if not hashes:
            raise bad_field("hashes", "at least one block hash", hashes)
        ttl = args.get("ttl_s")
        if type(ttl) not in (int, float) or not 0 < ttl <= MAX_TTL_S:
            raise bad_field("ttl_s", f"seconds in (0, {MAX_TTL_S:.0f}]", ttl)
        pin = self.reg.pin(entry, hashes, float(ttl), time.time())
        return pin.row(time.time())

    @op(admin=True)
    def unpin(self, call: Call) -> dict:
        pin_id = get_int(call.args, "pin_id", 1, U63)
        if pin_id not in self.reg.pins.pins:
            raise bad_field("pin_id", f"a pin's id (pins: {sorted(self.reg.pins.pins)[:20]})", pin_id)
        return {"unpinned": self.reg.unpin(pin_id)}

    @op(admin=True)
    def pins(self, call: Call) -> dict:
        now = time.time()
        return {"pins": [p.row(now) for p in self.reg.pins.pins.values()]}
