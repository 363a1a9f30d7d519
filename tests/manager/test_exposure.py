"""Deployment defaults that expose nothing by accident: who may bind where, socket directories,
admin keys with CURVE, secrets kept off command lines and out of world-readable files."""

from __future__ import annotations

import os
import stat

import pytest
from click.testing import CliRunner
from helpers.manager import LiveServer

from kvpool.cli.main import cli
from kvpool.client.manager import ManagerClient
from kvpool.manager.config import ManagerConfig
from kvpool.manager.server import Server
from kvpool.shared.bind import (
    BindRefused,
    check_bind,
    check_private_dir,
    is_loopback_tcp,
    read_secret_file,
)
from kvpool.shared.curve import write_keypair
from kvpool.shared.protocol import encode_request, unpack
from kvpool.worker.config import WorkerConfig

ADMIN_KEY = "admin-key-0123"


@pytest.mark.parametrize("ep", ["tcp://127.0.0.1:5555", "tcp://127.8.9.1:1", "tcp://[::1]:5555",
                                "tcp://localhost:5555", "ipc:///tmp/x.sock"])
def test_loopback_and_ipc_endpoints_bind_without_curve(ep):
    assert is_loopback_tcp(ep)
    check_bind(ep, curve=False, insecure=False)


@pytest.mark.parametrize("ep", ["tcp://0.0.0.0:5555", "tcp://*:5555", "tcp://10.1.2.3:5555", "tcp://eth0:5555",
                                "tcp://[::]:5555", "tcp://manager:5555"])
def test_an_exposed_tcp_endpoint_needs_curve_or_insecure(ep):
    with pytest.raises(BindRefused, match="--insecure"):
        check_bind(ep, curve=False, insecure=False)
    check_bind(ep, curve=True, insecure=False)
    check_bind(ep, curve=False, insecure=True)


def test_manager_and_worker_configs_refuse_exposed_sockets_without_curve(tmp_path):
    with pytest.raises(ValueError, match="reachable from other hosts without CURVE"):
        ManagerConfig(endpoint="tcp://0.0.0.0:5555")
    assert ManagerConfig(endpoint="tcp://0.0.0.0:5555", insecure=True).insecure
    public, secret = write_keypair(tmp_path, "manager")
    ManagerConfig(endpoint="tcp://0.0.0.0:5555", curve_secret_key_file=str(secret),
                  curve_allowed_keys_dir=str(tmp_path))
    with pytest.raises(ValueError, match="events_endpoint"):  # the event sockets have no CURVE
        ManagerConfig(endpoint="tcp://0.0.0.0:5555", curve_secret_key_file=str(secret),
                      curve_allowed_keys_dir=str(tmp_path), events_endpoint="tcp://*:5557")
    with pytest.raises(ValueError, match="worker endpoint"):
        WorkerConfig(endpoint="tcp://0.0.0.0:5560")
    WorkerConfig(endpoint="tcp://0.0.0.0:5560", insecure=True)
    WorkerConfig(endpoint="tcp://0.0.0.0:5560", curve_secret_key_file=str(secret),
                  curve_allowed_keys_dir=str(tmp_path))  # the worker's own CURVE
    WorkerConfig(endpoint="tcp://127.0.0.1:5560")


@pytest.mark.parametrize("make", [ManagerConfig, WorkerConfig], ids=["manager", "worker"])
def test_curve_files_are_both_given_and_both_exist(make, tmp_path):
    """One rule for the manager's and the worker's CURVE files (shared/bind.check_curve_files)."""
    _, secret = write_keypair(tmp_path, "server")
    with pytest.raises(ValueError, match="needs both curve_secret_key_file"):
        make(curve_secret_key_file=str(secret))
    with pytest.raises(ValueError, match="needs both curve_secret_key_file"):
        make(curve_allowed_keys_dir=str(tmp_path))
    with pytest.raises(ValueError, match=r"curve_secret_key_file \S+nope does not exist; create it with `kvpool keygen`"):
        make(curve_secret_key_file=str(tmp_path / "nope"), curve_allowed_keys_dir=str(tmp_path))
    with pytest.raises(ValueError, match=r"curve_allowed_keys_dir \S+nope is not a directory"):
        make(curve_secret_key_file=str(secret), curve_allowed_keys_dir=str(tmp_path / "nope"))
    assert make(curve_secret_key_file=str(secret), curve_allowed_keys_dir=str(tmp_path)).curve_secret_key_file


def test_kvpool_manager_refuses_an_exposed_endpoint_and_says_how_to_fix_it():
    res = CliRunner().invoke(cli, ["manager", "--manager", "tcp://0.0.0.0:5999"])
    assert res.exit_code == 1 and "--insecure" in res.output and "CURVE" in res.output, res.output


def test_a_socket_directory_must_be_this_users_alone(tmp_path, monkeypatch):
    d = tmp_path / "run"
    d.mkdir(mode=0o700)
    check_private_dir(str(d))
    os.chmod(d, 0o777)
    with pytest.raises(BindRefused, match="writable by group or others"):
        check_private_dir(str(d))
    os.chmod(d, 0o755)
    link = tmp_path / "link"
    link.symlink_to(d)
    with pytest.raises(BindRefused, match="not a directory"):
        check_private_dir(str(link))
    if os.getuid() == 0:  # root can hand the directory to someone else
        os.chown(d, 12345, 12345)
        with pytest.raises(BindRefused, match="belongs to uid 12345"):
            check_private_dir(str(d))
        os.chown(d, 0, 0)
    # the manager's default endpoint lives there: it refuses to bind, and the CLI to connect
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    (tmp_path / "kvpool").mkdir(mode=0o777)
    os.chmod(tmp_path / "kvpool", 0o777)
    srv = Server(ManagerConfig())
    with pytest.raises(BindRefused, match="chmod go-w"):
        srv.bind()
    srv.close()
    res = CliRunner().invoke(cli, ["status", "--admin-key", ADMIN_KEY], env={"KVPOOL_MANAGER": None})
    assert res.exit_code == 1 and "refusing to connect" in res.output, res.output


def test_with_curve_but_no_admin_key_admin_ops_are_refused(tmp_path):
    public, secret = write_keypair(tmp_path, "manager")
    srv = Server(ManagerConfig(endpoint=f"ipc://{tmp_path}/m.sock", curve_secret_key_file=str(secret),
                               curve_allowed_keys_dir=str(tmp_path)))

    def call(op: str, sid: str | None = None, **args) -> dict:
        return unpack(srv.handle_payload(encode_request(1, op, sid, args), 0.0))

    sid = call("hello", role="admin")["body"]["sid"]  # any allowed CURVE key gets this far
    reply = call("shutdown", sid)
    assert reply["status"] == "forbidden" and "needs admin_key" in reply["msg"]
    assert not srv._stop
    assert call("stats", sid)["status"] == "ok"  # the rest still works
    srv.close()


def test_admin_key_from_a_file_or_the_environment(sock_dir, tmp_path):
    live = LiveServer(f"ipc://{sock_dir}/m.sock", admin_key=ADMIN_KEY)
    try:
        key_file = tmp_path / "admin_key"
        key_file.write_text(ADMIN_KEY + "\n")
        os.chmod(key_file, 0o600)
        run = CliRunner().invoke
        env = {"KVPOOL_MANAGER": live.endpoint}
        assert run(cli, ["pools", "--admin-key-file", str(key_file)], env=env).exit_code == 0
        assert run(cli, ["pools"], env={**env, "KVPOOL_ADMIN_KEY_FILE": str(key_file)}).exit_code == 0
        assert run(cli, ["pools"], env={**env, "KVPOOL_ADMIN_KEY": ADMIN_KEY}).exit_code == 0
        refused = run(cli, ["pools"], env=env)
        assert refused.exit_code == 1 and "forbidden" in refused.output
        os.chmod(key_file, 0o644)
        res = run(cli, ["pools", "--admin-key-file", str(key_file)], env=env)
        assert res.exit_code == 2 and "chmod 600" in res.output, res.output
        help_text = run(cli, ["pools", "--help"]).output
        assert "KVPOOL_ADMIN_KEY" in help_text and "--admin-key-file" in help_text and "cmdline" in help_text
        os.chmod(key_file, 0o600)
        cfg = ManagerConfig(endpoint=f"ipc://{sock_dir}/x.sock", admin_key_file=str(key_file))
        assert cfg.admin_key == ADMIN_KEY == read_secret_file(str(key_file), "k")
        with ManagerClient(live.endpoint, role="admin", admin_key=ADMIN_KEY) as c:
            assert c.hello()["admin"]
    finally:
        live.stop()


def test_snapshot_files_are_private(tmp_path):
    """`kvpool snapshot -o` writes 0600 whatever the umask (the file holds every bearer sid)."""
    from kvpool.manager.registry import Registry
    from kvpool.manager.store.state_file import dump_registry, encode_state

    src = tmp_path / "in.kvps"
    src.write_bytes(encode_state(dump_registry(Registry("x", session_timeout_s=1.0), 0)))
    out = tmp_path / "out.kvps"
    old = os.umask(0o022)
    try:
        res = CliRunner().invoke(cli, ["snapshot", "--input", str(src), "-o", str(out)])
    finally:
        os.umask(old)
    assert res.exit_code == 0, res.output
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o600


def test_packaged_configs_expose_nothing_without_curve():
    from pathlib import Path

    yaml = pytest.importorskip("yaml")
    root = Path(__file__).resolve().parents[2] / "docker"  # tests/manager/ -> the repository root
    cfg = ManagerConfig.from_file(str(root / "config" / "manager.toml"))  # validates: nothing exposed
    assert is_loopback_tcp(cfg.endpoint) and cfg.metrics_host == "127.0.0.1" and not cfg.insecure
    services = yaml.safe_load((root / "compose.yaml").read_text())["services"]
    env = services["manager"]["environment"]
    assert env["KVPOOL_MANAGER_ENDPOINT"].startswith("tcp://0.0.0.0")
    assert env["KVPOOL_MANAGER_CURVE_SECRET_KEY_FILE"] and env["KVPOOL_MANAGER_CURVE_ALLOWED_KEYS_DIR"]
    assert env["KVPOOL_MANAGER_ADMIN_KEY_FILE"]  # CURVE on: admin ops need the admin key
    assert "kvpool keygen" in " ".join(services["keys"]["command"])  # the init step
    for name, svc in services.items():
        assert all(str(p).startswith("127.0.0.1:") for p in svc.get("ports", [])), (name, svc["ports"])
        assert "insecure" not in str(svc).lower()
        env = svc.get("environment") or {}
        if "KVPOOL_WORKER_ENDPOINT" in env:  # a generate socket on the compose network: CURVE on it
            assert not is_loopback_tcp(env["KVPOOL_WORKER_ENDPOINT"])
            assert env["KVPOOL_WORKER_CURVE_SECRET_KEY_FILE"] and env["KVPOOL_WORKER_CURVE_ALLOWED_KEYS_DIR"]
        if name.startswith("worker"):
            assert svc["environment"]["KVPOOL_CURVE_KEY_FILE"] and svc["environment"]["KVPOOL_CURVE_SERVER_KEY"]


def test_the_worker_default_endpoint_needs_a_private_directory(tmp_path, monkeypatch):
    import click

    from kvpool.cli.serve import default_worker_endpoint

    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert default_worker_endpoint("p0") == f"ipc://{tmp_path}/kvpool/worker-p0.sock"
    assert stat.S_IMODE(os.stat(tmp_path / "kvpool").st_mode) == 0o700  # created private
    os.chmod(tmp_path / "kvpool", 0o777)
    with pytest.raises(click.ClickException, match="writable by group or others"):
        default_worker_endpoint("p0")
