"""A manager, CPU workers and a front door (in this process, in a thread) for the front door tests."""

from __future__ import annotations

from kvpool.devcluster.cluster import DevCluster
from kvpool.frontend.server import FrontDoorServer
from kvpool.frontend.service import FrontDoorConfig

# The managers' session timeout: a worker's heartbeats go out between its steps, and on a loaded
# machine (load 16, two cores) a step can take seconds; at 2 s a live worker's session expired
# and the front door dropped it mid-test ("left its manager"). A killed worker is out of the
# routing at once anyway (its link sees the disconnect); only its row waits for the expiry.
SESSION_TIMEOUT_S = 10


class Stack:
    def __init__(self, workers: int = 2, managers: int = 1, policy: str = "kv-aware", kv_blocks: int = 128,
                 silence_s: float = 30.0, **server: object) -> None:
        """``server``: FrontDoorServer's keywords (``limits``, ``api_keys``)."""
        self.cluster = DevCluster(prefix="kvpool-fd-")
        self.fd: FrontDoorServer | None = None
        try:
            self.managers = [self.cluster.manager(f"manager{i}", "--session-timeout", str(SESSION_TIMEOUT_S)) for i in range(managers)]
            for k in range(workers):
                self.cluster.worker(self.managers[k % managers], f"w{k}", kv_blocks=kv_blocks)
            self.fd = FrontDoorServer(FrontDoorConfig(tuple(self.managers), policy, poll_s=0.2,
                                                      silence_s=silence_s), **server).start()
            if workers:
                self.fd.wait_for_workers("tiny", workers)
        except BaseException:
            self.close()
            raise

    @property
    def url(self) -> str:
        return self.fd.url

    def close(self) -> None:
        if self.fd is not None:
            self.fd.stop()
        self.cluster.stop()
