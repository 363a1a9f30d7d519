"""CURVE on the control socket: keygen, who gets in, admin ops, reloading the allowed keys."""

from __future__ import annotations

import json
import os
import shutil
import stat

import pytest
import zmq
from click.testing import CliRunner
from helpers.manager import SPEC, LiveServer, kv_bytes, wait_until

from kvpool.cli.main import cli
from kvpool.client.manager import ManagerClient, ManagerError, ManagerUnavailable
from kvpool.shared.curve import ClientKeys, read_keypair, read_public_key, write_keypair

ADMIN_KEY = "admin-key-0123"


@pytest.fixture
def keys(tmp_path):
    """Keypairs for the manager and three clients; worker and admin are allowed, stranger is not."""
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    out = {name: write_keypair(tmp_path, name) for name in ("manager", "worker", "admin", "stranger")}
    for name in ("worker", "admin"):
        shutil.copy(out[name][0], allowed)
    return tmp_path, allowed, out


@pytest.fixture
def secured(keys, sock_dir):
    _, allowed, k = keys
    live = LiveServer(endpoint=f"ipc://{sock_dir}/m.sock", curve_secret_key_file=str(k["manager"][1]),
                        curve_allowed_keys_dir=str(allowed), admin_key=ADMIN_KEY)
    clients: list[ManagerClient] = []

    def client(name: str | None, timeout_s: float = 5.0, **kw) -> ManagerClient:
        curve = ClientKeys.load(str(k["manager"][0]), str(k[name][1])) if name else None
        c = ManagerClient(live.endpoint, identity=name or "plain", timeout_s=timeout_s, curve=curve, **kw)
        clients.append(c)
        return c

    yield live, client, k
    for c in clients:
        c.close()
    live.stop()


def test_keygen_writes_a_public_file_and_a_0600_secret_file(tmp_path):
    res = CliRunner().invoke(cli, ["keygen", "--out", str(tmp_path / "k"), "--name", "w0", "--json"])
    assert res.exit_code == 0, res.output
    info = json.loads(res.output)
    secret, public = info["secret_file"], info["public_file"]
    assert stat.S_IMODE(os.stat(secret).st_mode) == 0o600
    assert "secret-key" not in open(public).read()
    assert read_keypair(secret)[0] == read_public_key(public) == info["public_key"].encode()
    assert read_public_key(info["public_key"]) == info["public_key"].encode()  # Z85 text works too
    again = CliRunner().invoke(cli, ["keygen", "--out", str(tmp_path / "k"), "--name", "w0"])
    assert again.exit_code == 1 and "--force" in again.output
    with pytest.raises(ValueError, match="needs both"):
        ClientKeys.load(public, None)
    with pytest.raises(ValueError, match="holds no secret key"):
        read_keypair(public)


def test_a_client_without_an_allowed_key_gets_nothing(secured):
    live, client, _ = secured
    for c in (client(None, 0.5), client("stranger", 0.5)):
        with pytest.raises(ManagerUnavailable):
            c.hello()
    ctx = zmq.Context()
    raw = ctx.socket(zmq.DEALER)  # plain ZeroMQ: even garbage goes unanswered, unread
    raw.connect(live.endpoint)
    raw.send(b"\xc1")
    assert not raw.poll(300)
    raw.close(0)
    ctx.term()
    assert live.server.stats.messages == 0 and not live.server.registry.sessions


def test_allowed_clients_step_and_only_the_admin_key_runs_admin_ops(secured):
    live, client, k = secured
    w = client("worker")
    epoch = w.register("p", shard_rank=0, shard_count=1, incarnation="i", spec=SPEC,
                       available_kv_bytes=kv_bytes(16))["epoch"]
    res = w.step("p", epoch, [{"op": "alloc", "req": 1, "hashes": [], "prompt_len": 9, "max_new": 9}])
    assert res[0]["ok"] and len(res[0]["blocks"]) == 3
    with pytest.raises(ManagerError, match="forbidden"):
        w.call("pools")
    with pytest.raises(ManagerError, match="forbidden"):
        client("admin", role="admin", admin_key="wrong-key-000").hello()
    admin = client("admin", role="admin", admin_key=ADMIN_KEY)
    assert admin.call("pools")["pools"][0]["pool"] == "p"
    # the CLI, with keys from its options; without them it cannot reach the manager at all
    base = ["status", "-m", live.endpoint, "--curve-server-key", str(k["manager"][0])]
    ok = CliRunner().invoke(cli, [*base, "--curve-key-file", str(k["admin"][1]), "--json"])
    assert ok.exit_code == 0, ok.output
    assert json.loads(ok.output)["healthy"]
    env = {"KVPOOL_CURVE_SERVER_KEY": str(k["manager"][0]), "KVPOOL_CURVE_KEY_FILE": str(k["admin"][1])}
    pools = CliRunner().invoke(cli, ["pools", "-m", live.endpoint, "--admin-key", ADMIN_KEY], env=env)
    assert pools.exit_code == 0 and "p " in pools.output, pools.output
    denied = CliRunner().invoke(cli, ["status", "-m", live.endpoint, "--timeout", "0.3"])
    assert denied.exit_code == 3, denied.output


def test_reloading_the_allowed_keys_admits_a_new_client(secured, keys):
    live, client, k = secured
    _, allowed, _ = keys
    stranger = client("stranger", 0.3)
    with pytest.raises(ManagerUnavailable):
        stranger.hello()
    shutil.copy(k["stranger"][0], allowed)
    live.server.hooks.request_reload()  # what SIGHUP does

    def admitted() -> bool:
        try:
            return bool(stranger.hello())
        except ManagerUnavailable:
            return False

    wait_until(admitted, 10, "the new key to be accepted")
    assert live.server.hooks.curve.num_allowed == 3
