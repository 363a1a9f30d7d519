"""Layered service configuration: defaults < TOML file < KVPOOL_* environment < flags.

Each service's config is a dataclass that validates itself in ``__post_init__``; this module only
gathers values and remembers where each came from, so ``kvpool config show`` can print the
effective config with its sources. Environment variables are ``KVPOOL_<SERVICE>_<FIELD>``
(e.g. ``KVPOOL_MANAGER_SESSION_TIMEOUT_S=10``), parsed according to the field's type. A file is
TOML (a ``[<service>]`` table or top-level keys) or, for scripts, JSON with the same layout.
A field whose metadata has ``parse`` (e.g. a memory size) also accepts a string in a file or the
environment, turned into its value by that function.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import tomllib
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)
BYTES = {"parse": lambda text: parse_bytes(text)}  # a size field takes "64MiB" in a file or env


def parse_bytes(text: str | int) -> int:
    """'512MiB', '2GiB', '1.5G', '4096' -> bytes (K/M/G/T are powers of 1024)."""
    if isinstance(text, int):
        return text
    m = _SIZE_RE.match(text)
    if m is None:
        raise ValueError(f"cannot parse a memory size from {text!r}; write e.g. 512MiB or 2GiB")
    scale = 1024 ** "_kmgt".index(m.group(2).lower() or "_")
    return int(float(m.group(1)) * scale)




class ConfigError(ValueError):
    """A config value that cannot be used, with what to change."""


def _base_type(tp: Any) -> Any:
    """``int | None`` -> int; ``list[str]`` -> list."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _base_type(args[0]) if len(args) == 1 else str
    return origin or tp


def _parse_env(raw: str, tp: Any, name: str, parse: Any = None) -> Any:
    base = _base_type(tp)
    if parse is not None and raw.lower() not in ("", "none", "null"):
        return _parse_custom(parse, raw, name)
    if raw.lower() in ("", "none", "null") and type(None) in typing.get_args(tp):
        return None
    try:
        if base is bool:
            if raw.lower() in ("1", "true", "yes", "on"):
                return True
            if raw.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if base is list:
            return [p.strip() for p in raw.split(",") if p.strip()]
        return base(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a valid {getattr(base, '__name__', base)}") from None


def _parse_custom(parse: Any, raw: str, where: str) -> Any:
    try:
        return parse(raw)
    except ValueError as e:
        raise ConfigError(f"{where}: {e}") from None


def _read_file(p: Path, service: str) -> dict:
    try:
        if p.suffix == ".json":
            data = json.loads(p.read_text())
        else:
            data = tomllib.loads(p.read_text())
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
        kind = "JSON" if p.suffix == ".json" else "TOML"
        raise ConfigError(f"{p}: not valid {kind}: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: the top level must be a table/object")
    data = data.get(service, data)  # a [service] table or top-level keys
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: [{service}] must be a table")
    return data


def default_path(service: str) -> str | None:
    """``/etc/kvpool/<service>.toml`` when it exists (the packaged location), else None."""
    path = f"/etc/kvpool/{service}.toml"
    return path if os.path.isfile(path) else None


def _check_type(value: Any, tp: Any, where: str) -> Any:
    base = _base_type(tp)
    if value is None and type(None) in typing.get_args(tp):
        return None
    if base is float and type(value) is int:
        return float(value)
    if base in (int, float, str, bool, list, dict) and not (
        isinstance(value, base) and not (base is int and isinstance(value, bool))
    ):
        raise ConfigError(f"{where}: expected {base.__name__}, got {type(value).__name__} {value!r}")
    return value


def load(
    cls: type[T],
    service: str,
    path: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
    labels: Mapping[str, str] | None = None,
) -> tuple[T, dict[str, str]]:
    """Builds ``cls`` from the layers; returns it and ``{field: source}``.

    ``overrides`` are flag values; None means "flag not given". ``labels`` names the source of
    an override when it is not "flag" (e.g. a click option read from its own envvar). A missing
    ``path`` is fine when it was not asked for explicitly (``path=None``); an explicit path must
    exist.
    """
    env = os.environ if env is None else env
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    source = {name: "default" for name in fields}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist")
        data = _read_file(p, service)
        unknown = sorted(k for k in data if k.replace("-", "_") not in fields)
        if unknown:
            raise ConfigError(f"{p}: unknown keys {unknown}; known keys: {', '.join(sorted(fields))}")
        for key, value in data.items():
            name = key.replace("-", "_")
            parse = fields[name].metadata.get("parse")
            if parse is not None and isinstance(value, str):
                value = _parse_custom(parse, value, f"{p}: {key}")
            values[name] = _check_type(value, hints[name], f"{p}: {key}")
            source[name] = f"file {p}"
    prefix = f"KVPOOL_{service.upper()}_"
    for name in fields:
        var = prefix + name.upper()
        if var in env:
            values[name] = _parse_env(env[var], hints[name], var, fields[name].metadata.get("parse"))
            source[name] = f"env {var}"
    for name, value in (overrides or {}).items():
        if value is not None:
            if name not in fields:
                raise ConfigError(f"unknown option {name!r}")
            values[name] = value
            source[name] = (labels or {}).get(name, "flag")
    try:
        return cls(**values), source
    except (TypeError, ValueError) as e:
        raise ConfigError(str(e)) from None


def describe(cfg: Any, source: Mapping[str, str]) -> list[tuple[str, Any, str]]:
    """Rows ``(field, value, source)`` for ``kvpool config show``."""
    return [(f.name, getattr(cfg, f.name), source.get(f.name, "default")) for f in dataclasses.fields(cfg)]
