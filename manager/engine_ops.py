"""The node tier's ops for an engine that owns its device blocks (vLLM through kvpool's KV
connector, kvpool/integrations/vllm): ``node_join``, ``node_lookup``, ``node_load``,
``node_save``, and ``node_done`` with a ``layout`` (manager/node_ops.py dispatches it here).
PROTOCOL.md section 5, *Engines on the node tier*. A mixin of ``Handlers``
(manager/handlers.py), registered with ``@op`` as the rest; the bookkeeping is
manager/core/engine_node.py, the mutations manager/registry_node.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvpool.manager.core.engine_node import engine_plan
from kvpool.manager.node_ops import open_reports
from kvpool.manager.ops import Call, op
from kvpool.manager.registry_node import ENGINE
from kvpool.manager.state.entries import Session
from kvpool.shared.hashing import HASH_BYTES
from kvpool.shared.node_orders import MAX_SLOT
from kvpool.shared.node_tier import MAX_MODEL_ID
from kvpool.shared.protocol import (
    MAX_HASHES,
    KVSpec,
    bad_field,
    get_hashes,
    get_int,
    get_map,
    get_str,
)

if TYPE_CHECKING:
    from kvpool.manager.registry import Registry

U63 = (1 << 63) - 1
PRIORITY = 1 << 31  # vLLM's request priority, any int32


class EngineOps:
    reg: Registry

    @op()
    def node_join(self, call: Call) -> dict:
        args = call.args
        spec = KVSpec.from_wire(get_map(args, "spec"))
        model = get_str(args, "node_model", MAX_MODEL_ID)
        world = get_int(args, "world", 1, 4096, default=1)
        rank = get_int(args, "rank", 0, world - 1, default=0)
        return {"node_tier": self.reg.node_join(call.sess, spec, model, rank, world).to_wire()}

    @op()
    def node_lookup(self, call: Call) -> dict:
        """How many leading ``hashes`` the layout's tier can bring up now (no side effects)."""
        tier = self.reg.engine_tier(call.args.get("layout"))
        return {"blocks": engine_plan(tier, get_hashes(call.args))}

    @op()
    def node_load(self, call: Call) -> dict:
        args, sess = call.args, call.sess
        layout, batch = self._engine_batch(sess, args)
        hashes = get_hashes(args)
        priority = get_int(args, "priority", -PRIORITY, PRIORITY - 1, default=0)
        finished = self.finish_engine_batches(sess, layout, args.get("node_done", []))
        n, orders = self.reg.engine_load(sess, layout, batch, hashes, priority)
        return {"blocks": n, "orders": [o.to_wire() for o in orders], "finished": finished}

    @op()
    def node_save(self, call: Call) -> dict:
        args, sess = call.args, call.sess
        layout, batch = self._engine_batch(sess, args)
        hashes = get_hashes(args)
        blocks, parents = args.get("blocks"), args.get("parents")
        if type(blocks) is not list or len(blocks) != len(hashes) or any(
                type(b) is not int or not 0 < b <= MAX_SLOT for b in blocks):
            raise bad_field("blocks", f"one block id in [1, {MAX_SLOT}] per hash ({len(hashes)})", blocks)
        if type(parents) is not list or len(parents) != len(hashes) or any(
                p is not None and (type(p) is not bytes or len(p) != HASH_BYTES) for p in parents):
            raise bad_field("parents", f"one {HASH_BYTES}-byte bin or nil per hash ({len(hashes)})", parents)
        priority = get_int(args, "priority", -PRIORITY, PRIORITY - 1, default=0)
        finished = self.finish_engine_batches(sess, layout, args.get("node_done", []))
        orders = self.reg.engine_save(sess, layout, batch, blocks, hashes, parents, priority)
        return {"orders": [o.to_wire() for o in orders], "finished": finished}

    def _engine_batch(self, sess: Session, args: dict) -> tuple[str, int]:
        """The call's layout (which must have a tier) and a batch id this session has not open."""
        layout = args.get("layout")
        tier = self.reg.engine_tier(layout)
        batch = get_int(args, "batch", 0, U63)
        if (sess.sid, ENGINE, batch) in tier.batches:
            raise bad_field("batch", "a batch id not open (unreported) in this session", batch)
        if len(args.get("hashes") or ()) > MAX_HASHES:
            raise bad_field("hashes", f"at most {MAX_HASHES} hashes", len(args["hashes"]))
        return layout, batch  # type: ignore[return-value]

    def finish_engine_batches(self, sess: Session, layout: object, reports: object) -> int:
        """Validates every report against its batch first (nothing changes on bad input), then
        finishes each known batch; returns how many."""
        tier = self.reg.engine_tier(layout)
        checked = open_reports(reports, lambda batch: tier.batches.get((sess.sid, ENGINE, batch)))
        for r in checked:
            self.reg.engine_finish(sess, layout, r.batch, [o.to_wire() for o in r.failed],  # type: ignore[arg-type]
                                   [o.to_wire() for o in r.late])
        return len(checked)
