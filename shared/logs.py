"""Daemon logging: one line per event, plain text or one JSON object per line.

Both formatters keep a record on one line (a traceback's newlines are escaped), so journald,
``docker logs`` and log shippers see one event per line. The JSON form carries ``ts`` (RFC 3339,
UTC), ``level``, ``logger``, ``msg`` (the formatted message), ``exc`` when there is a traceback,
and any ``extra={...}`` fields the call passed.
"""

from __future__ import annotations

import json
import logging
import time

LEVELS = ("debug", "info", "warning", "error", "critical")
PLAIN_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# attributes every LogRecord has; anything else on a record came from ``extra=``
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "taskName"}


def _one_line(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


class OneLineFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__(PLAIN_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        return _one_line(super().format(record))


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        out: dict = {
            "ts": f"{ts}.{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        for key, value in vars(record).items():
            if key not in _STANDARD and key not in out:
                out[key] = value
        return json.dumps(out, default=str, separators=(",", ":"))


def check_level(level: str) -> str:
    if level.lower() not in LEVELS:
        raise ValueError(f"log_level must be one of {', '.join(LEVELS)}, got {level!r}")
    return level.lower()


def setup_logging(level: str = "info", json_logs: bool = False) -> None:
    """(Re)configures the root logger for a daemon: stderr, one line per record."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if json_logs else OneLineFormatter())
    logging.basicConfig(level=check_level(level).upper(), handlers=[handler], force=True)
