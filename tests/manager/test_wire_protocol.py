"""The wire contract: PROTOCOL.md's worked examples, the codec, validators, config, endpoints."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from helpers.manager import call, make_server

from kvpool.manager.config import ManagerConfig
from kvpool.shared import protocol as p
from kvpool.shared.hashing import hash_blocks

DOC = (Path(p.__file__).parent / "PROTOCOL.md").read_text()
INC = "0f1e2d3c4b5a69788796a5b4c3d2e1f0"
SID = "00112233445566778899aabbccddeeff"
H0 = hash_blocks(list(range(16)), 16)[0]
EXAMPLES = {
    "hello-request": {"v": 1, "id": 1, "op": "hello", "args": {"identity": "w0", "role": "worker", "versions": [1]}},
    "step-request": {"v": 1, "id": 2, "op": "step", "sid": SID, "args": {"pool": "llama", "epoch": 1, "ops": [
        {"op": "alloc", "req": 7, "hashes": [H0], "prompt_len": 20, "max_new": 20}, {"op": "free", "req": 3}]}},
    "step-reply": {"id": 2, "status": "ok", "inc": INC, "body": {"results": [
        {"ok": True, "cached": 0, "blocks": [1, 2]}, {"ok": False, "code": "unknown_request", "msg": "no request 3"}]}},
    "error-reply": {"id": 3, "status": "stale_epoch", "inc": INC, "msg": "pool 'llama' is at epoch 2, not 1",
                    "body": {"epoch": 2}},
}


def doc_bytes(name: str) -> bytes:
    m = re.search(rf"<!-- example:{name} -->\n```\n(.*?)```", DOC, re.S)
    assert m, f"PROTOCOL.md lacks example {name}"
    return bytes.fromhex(m.group(1).replace("\n", " "))


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_protocol_md_examples_are_the_exact_bytes(name):
    raw = doc_bytes(name)
    assert raw == p.pack(EXAMPLES[name])
    assert p.unpack(raw) == EXAMPLES[name]


def test_the_documented_hash_is_section_1s_vector():
    assert H0.hex() == "141e74053ed9be2e5aa5a0c5a5e68e5855c7f487dca83da79a918a12209d7995"


def test_the_hello_example_is_accepted_by_a_server():
    srv = make_server()
    reply = p.unpack(srv.handle_payload(doc_bytes("hello-request"), 0.0))
    assert (reply["id"], reply["status"], reply["body"]["version"]) == (1, "ok", 1)
    assert sorted(reply["body"]) == ["admin", "durable", "heartbeat_interval_s", "incarnation", "limits", "session",
                                     "session_timeout_s", "sid", "state_id", "version"]


def test_every_error_code_and_op_is_documented():
    for code in p.ERROR_CODES:
        assert f"| `{code}`" in DOC or f"`{code}`," in DOC, code
    from kvpool.manager.server import OPS

    for op in OPS:
        assert re.search(rf"^\| `{op}`", DOC, re.M), op


def test_raise_for_reply_maps_codes_to_exceptions():
    assert p.raise_for_reply({"status": "ok", "body": {"a": 1}}) == {"a": 1}
    with pytest.raises(p.StaleEpoch) as ei:
        p.raise_for_reply(EXAMPLES["error-reply"])
    assert ei.value.epoch == 2 and "epoch 2" in ei.value.message
    with pytest.raises(p.ManagerError) as ei:
        p.raise_for_reply({"status": "unknown_pool", "msg": "no pool"})
    assert type(ei.value) is p.ManagerError and ei.value.code == "unknown_pool"
    assert issubclass(p.SessionExpired, p.ManagerRestarted) and p.SessionExpired("x").code == "session_expired"


def test_validators_refuse_bools_floats_and_out_of_range():
    assert p.get_int({"n": 3}, "n", 0, 5) == 3
    for bad in (True, 3.0, -1, 6, None, "3"):
        with pytest.raises(p.ManagerError, match="'n' must be an int in"):
            p.get_int({"n": bad}, "n", 0, 5)
    with pytest.raises(p.ManagerError, match="got 'nothing'"):
        p.get_int({}, "n", 0, 5)
    assert p.get_str({}, "s", 4, default="abc") == "abc"
    with pytest.raises(p.ManagerError):
        p.get_str({"s": "toolong"}, "s", 4)
    with pytest.raises(p.ManagerError):
        p.get_str({"s": "-x"}, "s", 64, pattern=p.POOL_NAME)
    with pytest.raises(p.ManagerError) as ei:
        p.get_hashes({"hashes": [b"x" * 31]})
    assert ei.value.code == "bad_hash"


def test_block_bytes_matches_the_design_formula():
    spec = p.KVSpec.from_wire({"block_size": 16, "num_layers": 32, "num_kv_heads": 8, "head_size": 128, "dtype": "bfloat16"})
    assert spec.block_bytes == 2 * 16 * 8 * 128 * 2 * 32


def test_default_endpoint_uses_the_runtime_dir(monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/7")
    assert p.default_endpoint() == "ipc:///run/user/7/kvpool/manager.sock"
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert re.fullmatch(r"ipc:///tmp/kvpool-\d+/manager\.sock", p.default_endpoint())


def test_config_validates_with_actionable_messages(tmp_path):
    with pytest.raises(ValueError, match="tcp://HOST:PORT"):
        ManagerConfig(endpoint="udp://x")
    with pytest.raises(ValueError, match="PORT in 1..65535"):
        ManagerConfig(endpoint="tcp://127.0.0.1:99999")
    assert ManagerConfig(endpoint="tcp://[::1]:65535").endpoint.endswith("65535")
    with pytest.raises(ValueError, match="limit is 107"):
        ManagerConfig(endpoint="ipc:///" + "x" * 120)
    with pytest.raises(ValueError, match="session_timeout_s"):
        ManagerConfig(endpoint="tcp://127.0.0.1:5555", session_timeout_s=0)
    with pytest.raises(ValueError, match="max_sub_ops must be an int >= 1"):
        ManagerConfig(endpoint="tcp://127.0.0.1:5555", max_sub_ops=0)
    toml = tmp_path / "m.toml"
    toml.write_text('[manager]\nendpoint = "tcp://127.0.0.1:5555"\nsession_timeout_s = 2.5\n')
    cfg = ManagerConfig.from_file(str(toml), session_timeout_s=None, max_pools=3)
    assert (cfg.endpoint, cfg.session_timeout_s, cfg.max_pools) == ("tcp://127.0.0.1:5555", 2.5, 3)
    js = tmp_path / "m.json"
    js.write_text(json.dumps({"endpoint": "tcp://127.0.0.1:1", "bogus": 1}))
    with pytest.raises(ValueError, match=r"unknown keys \['bogus'\]"):
        ManagerConfig.from_file(str(js))


def test_a_request_from_encode_request_round_trips_through_the_server():
    srv = make_server()
    sid = call(srv, "hello")["body"]["sid"]
    assert call(srv, "heartbeat", sid) == {"id": 7, "status": "ok", "inc": srv.incarnation, "body": {}}


def raw_map(*pairs) -> bytes:
    """A msgpack map with exactly these pairs, in order (repeats kept: a dict could not hold them)."""
    assert len(pairs) < 16
    return bytes([0x80 | len(pairs)]) + b"".join(p.pack(k) + p.pack(v) for k, v in pairs)


def test_a_message_map_that_repeats_a_key_is_refused_not_read_as_its_last_value():
    srv = make_server()
    hello = {"identity": "w0", "role": "worker", "versions": [1]}
    dup = raw_map(("v", 1), ("id", 9), ("op", "heartbeat"), ("op", "hello"), ("args", hello))
    reply = p.unpack(srv.handle_payload(dup, 0.0))
    assert reply["status"] == "bad_message" and "repeated" in reply["msg"], reply
    once = raw_map(("v", 1), ("id", 10), ("op", "hello"), ("args", hello))
    assert p.unpack(srv.handle_payload(once, 0.0))["status"] == "ok"  # the same map without the repeat
    with pytest.raises(p.DuplicateKey):
        p.unpack(bytes([0xDE, 0, 2]) + p.pack("id") + p.pack(1) + p.pack("id") + p.pack(2), 1000)


def test_the_generate_socket_refuses_a_repeated_key_at_any_depth():
    from kvpool.shared.bounded import DuplicateKey, unpack_counted

    inner = raw_map(("max_tokens", 4), ("max_tokens", 400))
    payload = bytes([0x82]) + p.pack("op") + p.pack("generate") + p.pack("params") + inner
    with pytest.raises(DuplicateKey, match="max_tokens"):
        unpack_counted(payload, 64, "too many", unique_keys=True)
    assert unpack_counted(p.pack({"op": "generate", "params": {"max_tokens": 4}}), 64, "x", unique_keys=True) == \
        {"op": "generate", "params": {"max_tokens": 4}}
