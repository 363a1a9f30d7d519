"""The ops of external pools (PROTOCOL.md section 5): ``attach``, ``detach`` (admin) and
``externals``; ``locate`` adds their hits (manager/handlers.py). A mixin of ``Handlers``: the
feed (manager/external/feed.py) starts with the first attachment, or at the manager's start when
``vllm_events_endpoint`` is set."""

from __future__ import annotations

from typing import TYPE_CHECKING

import zmq

from kvpool.manager.external.feed import Attachment, ExternalFeed, check_endpoint, check_url
from kvpool.manager.ops import Call, op
from kvpool.shared.protocol import POOL_NAME, ManagerError, get_int, get_str

if TYPE_CHECKING:
    from kvpool.manager.registry import Registry


class ExternalOps:
    reg: Registry
    external: ExternalFeed | None = None

    def external_feed(self) -> ExternalFeed:
        if self.external is None:
            self.external = ExternalFeed(zmq.Context.instance())
        return self.external

    def start_external(self, bind: str) -> ExternalFeed:
        """The feed with its SUB socket bound at ``bind`` (the manager's vllm_events_endpoint)."""
        self.external = ExternalFeed(zmq.Context.instance(), bind=bind)
        return self.external

    def close_external(self) -> None:
        if self.external is not None:
            self.external.close()
            self.external = None

    def external_rows(self) -> list[dict]:
        return self.external.rows() if self.external is not None else []

    def external_hits(self, hashes: list[bytes]) -> dict[str, int]:
        return self.external.locate(hashes) if self.external is not None else {}

    @op(admin=True)
    def attach(self, call: Call) -> dict:
        spec = attachment(call.args)
        if spec.name in self.reg.pools:
            raise ManagerError("name_taken", f"{spec.name!r} is the name of a kvpool pool: give the server another")
        self.attach_spec(spec)
        return {"attached": spec.to_wire(), "events_endpoint": self.external_feed().bound}

    def attach_spec(self, spec: Attachment) -> None:
        try:
            self.external_feed().attach(spec)
        except ValueError as e:
            raise ManagerError("name_taken", str(e)) from None

    @op(admin=True)
    def detach(self, call: Call) -> dict:
        name = get_str(call.args, "name", 64, pattern=POOL_NAME)
        if self.external is None or not self.external.detach(name):
            raise ManagerError("unknown_pool", f"no external pool named {name!r}")
        return {"detached": name}

    @op()
    def externals(self, call: Call) -> dict:
        feed = self.external
        return {"events_endpoint": feed.bound if feed is not None else None,
                "externals": feed.rows() if feed is not None else []}


def attachment(args: dict) -> Attachment:
    """The ``attach`` op's arguments (or one ``attach`` entry of the manager's config), checked."""
    name = get_str(args, "name", 64, pattern=POOL_NAME)
    try:
        return Attachment(name, get_str(args, "model", 512), check_url(args.get("url")),
                          get_int(args, "block_size", 1, 1 << 16), get_str(args, "topic", 256),
                          check_endpoint("events", args.get("events")), check_endpoint("replay", args.get("replay")))
    except ValueError as e:
        raise ManagerError("bad_field", str(e)) from None
