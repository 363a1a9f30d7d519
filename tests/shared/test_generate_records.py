"""The generate protocol's records (shared/generate.py) against PROTOCOL.md section 12 and the
wire maps the worker and its clients exchanged before the records existed."""

from __future__ import annotations

import json
import re
from dataclasses import fields
from pathlib import Path

import msgpack
import pytest

from kvpool.shared.generate import (
    Control,
    ErrorMessage,
    GenerateRequest,
    Heartbeat,
    Pong,
    StatsReply,
    TokenMessage,
    pack,
    parse_reply,
)
from kvpool.shared.sampling import TEXT_ONLY, SamplingParams

PROTOCOL = Path(__file__).resolve().parents[2] / "shared" / "PROTOCOL.md"


def doc_params() -> list[tuple[str, str]]:
    """(param, default) of every row of section 12's sampling-parameter table."""
    text = PROTOCOL.read_text()
    section = text[text.index("## 12."):]
    end = section.find("\n## ", 1)
    section = section if end < 0 else section[:end]
    table = section[section.index("| param | type | default | meaning |"):]
    rows = []
    for line in table.splitlines()[2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows.append((cells[0].strip("`"), cells[2]))
    return rows


def as_doc(value: object) -> str:
    if value is None:
        return "nil"
    if isinstance(value, bool):
        return json.dumps(value)
    if isinstance(value, tuple):
        return json.dumps(list(value))
    return repr(value)


def test_section_12_documents_every_sampling_parameter_with_its_default():
    wire = [f for f in fields(SamplingParams) if f.name not in TEXT_ONLY]
    assert len(wire) == 15  # the 12 of the first version, repetition_penalty, min_p and priority
    assert doc_params() == [(f.name, as_doc(f.default)) for f in wire]


def test_the_table_parser_reads_each_row_once():
    rows = doc_params()
    assert rows[0] == ("max_tokens", "16") and rows[-1] == ("logprobs", "nil")
    assert len({name for name, _ in rows}) == len(rows)
    assert re.fullmatch(r"[a-z_]+", rows[3][0])


def test_a_generate_request_is_the_same_map_as_before():
    req = GenerateRequest("fd-0", [5, 6], {"max_tokens": 4, "n": 2}, "tenant")
    assert pack(req.to_wire()) == msgpack.packb(
        {"op": "generate", "id": "fd-0", "prompt": [5, 6], "params": {"max_tokens": 4, "n": 2},
         "cache_salt": "tenant"}, use_bin_type=True)
    assert "cache_salt" not in GenerateRequest("x", [1], {}).to_wire()
    back = GenerateRequest.from_wire(req.to_wire())
    assert back.params == SamplingParams(max_tokens=4, n=2) and back.cache_salt == "tenant"
    typed = GenerateRequest("y", [1], SamplingParams(max_tokens=3, stop_token_ids=(7,)))
    assert GenerateRequest.from_wire(typed.to_wire()).params == typed.params


def test_a_bad_request_is_a_value_error():
    with pytest.raises(ValueError, match="unknown params"):
        GenerateRequest.from_wire({"op": "generate", "id": "a", "prompt": [1], "params": {"stop": "x"}})
    with pytest.raises(ValueError, match="prompt must be a list"):
        GenerateRequest.from_wire({"op": "generate", "id": "a", "prompt": "hi"})
    with pytest.raises(ValueError, match="cannot encode"):
        pack(GenerateRequest("a", [1 << 64], {}).to_wire())


def test_replies_round_trip_and_keep_their_maps():
    token = TokenMessage("r", 1, 42, True, "length", -0.5, [[42, -0.5]])
    assert token.to_wire() == {"id": "r", "index": 1, "token": 42, "finished": True, "reason": "length",
                               "logprob": -0.5, "top_logprobs": [[42, -0.5]]}
    assert list(TokenMessage("r", 0, 3).to_wire()) == ["id", "index", "token", "finished", "reason"]
    assert ErrorMessage("r", "no").to_wire() == {"id": "r", "error": "no", "finished": True}
    assert Heartbeat("r", "draining").to_wire() == {"id": "r", "heartbeat": True, "finished": False,
                                                    "waiting": "draining"}
    assert StatsReply("s", {"pool": "p"}).to_wire() == {"id": "s", "stats": {"pool": "p"}}
    assert Pong("p", "pool").to_wire() == {"id": "p", "pong": "pool"}
    assert Control("abort", "r").to_wire() == {"op": "abort", "id": "r"}
    for record in (token, TokenMessage("r"), ErrorMessage("r", "no"), Heartbeat("r", None),
                   StatsReply("s", {}), Pong("p", "pool")):
        assert parse_reply(msgpack.unpackb(pack(record.to_wire()))) == record
    assert parse_reply([1, 2]) is None
