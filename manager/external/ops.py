"""The ops of external pools (PROTOCOL.md section 5): ``attach``, ``detach`` (admin) and
``externals``; ``locate`` adds their hits (manager/handlers.py). A mixin of ``Handlers``: the
feed (manager/external/feed.py) starts with the first attachment, or at the manager's start when
``vllm_events_endpoint`` is set."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import zmq

from kvpool.manager.external.feed import POLL_S, WINDOW_S, ExternalFeed
from kvpool.manager.ops import Call, op
from kvpool.manager.state.attachment import Attachment
from kvpool.shared.protocol import POOL_NAME, ManagerError, get_str

if TYPE_CHECKING:
    from kvpool.manager.registry import Registry

logger = logging.getLogger(__name__)


class ExternalOps:
    reg: Registry
    external: ExternalFeed | None = None
    configured: set[str]  # names attached from the config (Handlers sets it)
    # the manager's vllm_metrics_poll_s and vllm_events_window_s (manager/external/silence.py)
    external_poll_s: float = POLL_S
    external_window_s: float = WINDOW_S

    def configure_external(self, poll_s: float, window_s: float) -> None:
        self.external_poll_s, self.external_window_s = poll_s, window_s

    def external_feed(self) -> ExternalFeed:
        if self.external is None:
            self.external = ExternalFeed(zmq.Context.instance(), poll_s=self.external_poll_s,
                                         window_s=self.external_window_s)
        return self.external

    def start_external(self, bind: str) -> ExternalFeed:
        """The feed with its SUB socket bound at ``bind`` (the manager's vllm_events_endpoint)."""
        self.external = ExternalFeed(zmq.Context.instance(), bind=bind, poll_s=self.external_poll_s,
                                     window_s=self.external_window_s)
        return self.external

    def open_configured(self, events_endpoint: str | None, attach: list[dict]) -> None:
        """At the manager's start: the feed bound at ``vllm_events_endpoint`` (attached vLLM
        servers publish there), then the config's ``[[manager.attach]]`` servers."""
        if events_endpoint:
            try:
                feed = self.start_external(events_endpoint)
            except zmq.ZMQError as e:
                raise RuntimeError(f"cannot bind vllm_events_endpoint {events_endpoint}: {e}") from None
            logger.info("vLLM KV events of attached servers on %s", feed.bound)
        for entry in attach:  # checked by the config
            self.attach_configured(attachment(entry))

    def close_external(self) -> None:
        if self.external is not None:
            self.external.close()
            self.external = None

    def external_rows(self) -> list[dict]:
        return self.external.rows() if self.external is not None else []

    def external_hits(self, hashes: list[bytes]) -> dict[str, dict[str, int]]:
        """``locate``'s maps of attached servers: ``external`` {name: leading blocks in the device
        tier}, and ``external_cpu`` {name: blocks after those in its CPU tier} where there are any."""
        tiers = self.external.locate(hashes) if self.external is not None else {}
        return {"external": {n: d for n, (d, _) in tiers.items()},
                "external_cpu": {n: c for n, (_, c) in tiers.items() if c}}

    @op(admin=True)
    def attach(self, call: Call) -> dict:
        spec = attachment(call.args)
        if spec.name in self.reg.pools:
            raise ManagerError("name_taken", f"{spec.name!r} is the name of a kvpool pool: give the server another")
        self.attach_spec(spec)
        self.reg.attach(spec)  # journaled: a restarted or failed-over manager attaches it again
        return {"attached": spec.to_wire(), "events_endpoint": self.external_feed().bound}

    def attach_spec(self, spec: Attachment) -> None:
        try:
            self.external_feed().attach(spec)
        except ValueError as e:
            raise ManagerError("name_taken", str(e)) from None

    def attach_configured(self, spec: Attachment) -> None:
        """A ``[[manager.attach]]`` table's server: attached at each start, never journaled."""
        self.attach_spec(spec)
        self.configured.add(spec.name)

    @op(admin=True)
    def detach(self, call: Call) -> dict:
        name = get_str(call.args, "name", 64, pattern=POOL_NAME)
        if self.external is None or not self.external.detach(name):
            raise ManagerError("unknown_pool", f"no external pool named {name!r}")
        self.configured.discard(name)
        self.reg.detach(name)
        return {"detached": name}

    def sync_attachments(self) -> None:
        """After a state was loaded (a start, a failover, a reload): the feed follows the
        attachments the state keeps; a configured server of the same name keeps its config's."""
        kept = self.reg.attachments
        attached = self.external.specs() if self.external is not None else {}
        for name, spec in attached.items():
            if name not in self.configured and kept.get(name) != spec:
                self.external.detach(name)  # type: ignore[union-attr]
        for name, spec in kept.items():
            if name in self.configured:
                logger.warning("external pool %s is in the config and was attached by op: the config's is used", name)
            elif attached.get(name) != spec:
                try:
                    self.attach_spec(spec)
                    logger.info("external pool %s attached again from the stored state", name)
                except ManagerError as e:
                    logger.error("external pool %s (stored) cannot be attached again: %s", name, e.message)

    @op()
    def externals(self, call: Call) -> dict:
        feed = self.external
        return {"events_endpoint": feed.bound if feed is not None else None,
                "externals": feed.rows() if feed is not None else []}


def attachment(args: dict) -> Attachment:
    """The ``attach`` op's arguments (or one ``attach`` entry of the manager's config), checked."""
    return Attachment.from_wire(args)
