"""KVSpec: validated in one place, the same wire map both ways, the block-size arithmetic."""

from __future__ import annotations

import pytest

from kvpool.shared.protocol import KVSpec, ManagerError, pack

WIRE = {"block_size": 16, "num_layers": 2, "num_kv_heads": 4, "head_size": 64, "dtype": "float16"}


def test_the_wire_map_round_trips_byte_for_byte():
    spec = KVSpec.from_wire(dict(WIRE))
    assert spec == KVSpec(16, 2, 4, 64, "float16")
    assert pack(spec.to_wire()) == pack(WIRE)  # the journal and state files keep their bytes
    assert KVSpec.from_wire({**WIRE, "extra": 1}) == spec  # unknown keys are ignored


@pytest.mark.parametrize(("field", "value", "message"), [
    ("block_size", 0, "'block_size' must be an int in [1, 65536], got 0"),
    ("num_layers", True, "'num_layers' must be an int"),
    ("head_size", 4.0, "'head_size' must be an int"),
    ("num_kv_heads", None, "'num_kv_heads' must be an int"),
    ("dtype", "int8", "'dtype' must be one of ['bfloat16', 'float16', 'float32'], got 'int8'"),
    ("dtype", ["float16"], "'dtype' must be one of"),  # unhashable: never reaches a set lookup
    ("dtype", {"float16": 1}, "'dtype' must be one of"),
    ("max_model_len", 0, "'max_model_len' must be an int in [1, 16777216], got 0"),
    ("max_model_len", 2.5, "'max_model_len' must be an int"),
])
def test_a_bad_field_is_named_by_the_wire_path_and_the_constructor_alike(field, value, message):
    for build in (lambda: KVSpec.from_wire({**WIRE, field: value}), lambda: KVSpec(**{**WIRE, field: value})):
        with pytest.raises(ManagerError, match="bad_field") as e:
            build()
        assert message in e.value.message


def test_a_missing_field_or_a_non_map_is_refused():
    with pytest.raises(ManagerError, match="'head_size' must be an int in .*got 'nothing'"):
        KVSpec.from_wire({k: v for k, v in WIRE.items() if k != "head_size"})
    with pytest.raises(ManagerError, match="'spec' must be a map"):
        KVSpec.from_wire([16, 2, 4, 64, "float16"])


def test_block_bytes_is_k_and_v_over_every_layer():
    assert KVSpec(16, 2, 4, 64, "float32").block_bytes == 2 * 16 * 4 * 64 * 4 * 2


def test_a_declared_max_model_len_travels_on_the_wire_and_absent_stays_absent():
    spec = KVSpec.from_wire({**WIRE, "max_model_len": 4096})
    assert spec.max_model_len == 4096 and KVSpec.from_wire(spec.to_wire()) == spec
    assert "max_model_len" not in KVSpec.from_wire(WIRE).to_wire()
