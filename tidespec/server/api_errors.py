"""OpenAI error objects: the one shape every refusal of the server takes.

Why this exists: the routes (``app``), the ASGI guards in front of them (``guard``: API key, body
size and time, admission while loading or draining) and the raw 408 of the header timer
(``graceful``) all answer ``{"error": {"message", "type", "param", "code"}}`` with the status's
OpenAI ``type``; one definition keeps them the same.

Worked example::

    error_body(429, "server is at capacity", code="rate_limit_exceeded")
    # {"error": {"message": "server is at capacity", "type": "rate_limit_error", "param": None,
    #            "code": "rate_limit_exceeded"}}
    raise ApiError(400, "max_tokens must be >= 1", param="max_tokens")   # answered by the app's handler
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from tidespec.server.protocol import ErrorInfo, ErrorResponse

STATUS_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 403: "invalid_request_error",
                404: "invalid_request_error", 405: "invalid_request_error", 408: "invalid_request_error",
                413: "invalid_request_error", 415: "invalid_request_error", 429: "rate_limit_error",
                500: "server_error", 503: "server_error"}


class ApiError(Exception):
    """An error answered as an OpenAI error object (``headers``: extra response headers)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type_ or STATUS_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
        self.headers = headers


def error_body(status: int, message: str, param: str | None = None, code: str | None = None,
               type_: str | None = None) -> dict[str, Any]:
    err = ApiError(status, message, param, code, type_)
    return ErrorResponse(error=ErrorInfo(message=err.message, type=err.type, param=err.param,
                                         code=err.code)).model_dump()


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)
