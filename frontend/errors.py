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


RETRY_AFTER_S = 5  # what a 503 for a manager outage, drain or shutdown tells clients to wait


@dataclass
class APIError(Exception):
    status: int
    message: str
    param: str | None = None
    reason: str | None = None  # kvpool's reason code: no_worker, too_large, context_length_exceeded, ...
    retry_after_s: int | None = None  # sent as the Retry-After header

    @property
    def headers(self) -> dict[str, str] | None:
        return {"Retry-After": str(self.retry_after_s)} if self.retry_after_s is not None else None

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": TYPES.get(self.status, "api_error"),
                          "param": self.param, "code": self.status, "reason": self.reason or str(self.status)}}


def bad_param(param: str, message: str) -> APIError:
    return APIError(400, message, param, "invalid_parameter")


UNAVAILABLE = {  # why a request cannot be served for now, in a 503's words
    "draining": "the manager is draining (kvpool drain): it admits no new request",
    "manager_unreachable": "the worker's manager cannot be reached (stopped, restarting, or the network)",
}


def unavailable(reason: str, detail: str = "") -> APIError:
    """The 503 of a request that cannot be served for now, with Retry-After."""
    return APIError(503, f"{UNAVAILABLE[reason]}{detail}; retry later", None, reason, RETRY_AFTER_S)

