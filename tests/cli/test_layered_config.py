from dataclasses import dataclass, field

import pytest

from kvpool.shared.config import ConfigError, describe, load


@dataclass
class Svc:
    endpoint: str = "ipc:///tmp/x.sock"
    session_timeout: float = 10.0
    workers: int = 2
    json_logs: bool = False
    redis_url: str | None = None
    allowed: list[str] = field(default_factory=list)

    def __post_init__(self):
        if self.session_timeout <= 0:
            raise ValueError(f"session_timeout must be > 0, got {self.session_timeout}; raise it")


def test_layers_and_sources(tmp_path):
    p = tmp_path / "svc.toml"
    p.write_text('[svc]\nsession_timeout = 5\nworkers = 3\nendpoint = "tcp://0.0.0.0:5555"\n')
    env = {"KVPOOL_SVC_WORKERS": "4", "KVPOOL_SVC_JSON_LOGS": "yes", "KVPOOL_SVC_ALLOWED": "a, b"}
    cfg, src = load(Svc, "svc", p, env, {"endpoint": "ipc:///run/k.sock", "workers": None})
    assert cfg == Svc("ipc:///run/k.sock", 5.0, 4, True, None, ["a", "b"])
    assert src["endpoint"] == "flag" and src["workers"] == "env KVPOOL_SVC_WORKERS"
    assert src["session_timeout"] == f"file {p}" and src["redis_url"] == "default"
    assert ("workers", 4, "env KVPOOL_SVC_WORKERS") in describe(cfg, src)


@pytest.mark.parametrize(
    "toml, env, match",
    [
        ("[svc]\nworkers = 'x'\n", {}, "expected int"),
        ("[svc]\nbogus = 1\n", {}, r"unknown keys \[.bogus.\]"),
        ("[svc\n", {}, "not valid TOML"),
        ("", {"KVPOOL_SVC_WORKERS": "many"}, "not a valid int"),
        ("[svc]\nsession_timeout = -1\n", {}, "raise it"),
    ],
)
def test_errors_say_what_to_change(tmp_path, toml, env, match):
    p = tmp_path / "svc.toml"
    p.write_text(toml)
    with pytest.raises(ConfigError, match=match):
        load(Svc, "svc", p, env)


def test_missing_explicit_file():
    with pytest.raises(ConfigError, match="does not exist"):
        load(Svc, "svc", "/nonexistent/svc.toml", {})
