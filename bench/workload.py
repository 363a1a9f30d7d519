"""One request record for every benchmark workload, and how each driver renders it.

Three seeded generators make kvpool's workloads, each for its own driver, all of them as
``TraceRequest`` records:

- bench/trace.py ``reference_trace``: token prompts with shared prefixes, for the pool, manager
  and worker benchmarks (``prompts`` renders the token ids);
- devcluster/loadgen.py ``chat_trace``: a multi-tenant chat trace for the front door, its text
  as word ids (``chat_messages`` renders a tenant's system prompt and the user's words, the
  load generator the HTTP body);
- scripts/memsim ``make_trace``: a ShareGPT-like trace with arrivals and output lengths, for
  the memory simulator.

A request's ``prompt`` starts with ``prefix_len`` ids shared by every request of its ``group``
(a shared prefix, a tenant's system prompt; ``group`` None: nothing shared).
"""

from __future__ import annotations

from dataclasses import dataclass

# The words a text workload's ids stand for (``chat_messages``): multi-byte UTF-8 included, so a
# detokenizer's handling of split characters is exercised.
WORDS = ("kv cache block pool prefix hash route worker tenant token stream prompt answer memory page "
         "Grüße naïve café 日本 データ über déjà vu").split()


@dataclass(frozen=True, slots=True)
class TraceRequest:
    rid: int  # arrival order
    arrival: int  # the step at which it arrives (the simulator's; 0: at once)
    prompt: tuple[int, ...]  # token ids (a text workload's: word ids, ``chat_messages``)
    out_lens: tuple[int, ...] = ()  # tokens each of its n samples generates; empty: the driver decides
    prefix_len: int = 0  # the first ``prefix_len`` are its group's shared prefix
    group: int | None = None  # which shared prefix (a text workload's tenant); None: none
    seed: int = 0  # the sampling seed a driver sends with it

    def __post_init__(self) -> None:
        if not 0 <= self.prefix_len <= len(self.prompt):
            raise ValueError(f"request {self.rid}: prefix_len {self.prefix_len} outside its "
                             f"{len(self.prompt)}-id prompt")
        if self.prefix_len and self.group is None:
            raise ValueError(f"request {self.rid}: a shared prefix names its group")

    @property
    def n(self) -> int:
        """Parallel samples it asks for."""
        return max(1, len(self.out_lens))

    @property
    def max_tokens(self) -> int:
        """The longest output of its samples (the request's ``max_tokens``)."""
        return max(self.out_lens, default=0)


def words(ids: tuple[int, ...] | list[int]) -> str:
    return " ".join(WORDS[i] for i in ids)


def system_prompt(tenant: int, ids: tuple[int, ...] | list[int]) -> str:
    """Tenant ``tenant``'s system prompt, whose rules are the words ``ids``."""
    return f"You are the assistant of tenant {tenant}. Rules: {words(ids)}."


def chat_messages(req: TraceRequest) -> list[dict]:
    """A text request as OpenAI chat messages: its group's system prompt, then its own words."""
    if req.group is None:
        raise ValueError(f"request {req.rid} has no tenant: not a chat request")
    return [{"role": "system", "content": system_prompt(req.group, req.prompt[: req.prefix_len])},
            {"role": "user", "content": words(req.prompt[req.prefix_len :])}]
