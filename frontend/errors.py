"""Errors in OpenAI's shape as vLLM 0.33 writes it: ``{"error": {"message", "type", "param",
"code"}}`` with ``code`` the HTTP status as an integer (vLLM's ``ErrorInfo.code: int``), and
kvpool's machine-readable reason beside it (``reason``: ``no_worker``, ``too_large``, ...), which
clients that know only vLLM's fields ignore."""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.client.generate_core import WorkerLost  # a request's worker went away

__all__ = ["APIError", "WorkerLost", "bad_param"]

TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
         405: "invalid_request_error", 408: "invalid_request_error", 413: "invalid_request_error",
         503: "service_unavailable", 500: "internal_server_error"}


@dataclass
class APIError(Exception):
    status: int
    message: str
    param: str | None = None
    reason: str | None = None  # kvpool's reason code: no_worker, too_large, context_length_exceeded, ...

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": TYPES.get(self.status, "api_error"),
                          "param": self.param, "code": self.status, "reason": self.reason or str(self.status)}}


def bad_param(param: str, message: str) -> APIError:
    return APIError(400, message, param, "invalid_parameter")

