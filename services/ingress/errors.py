"""Errors in OpenAI's JSON shape: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import orjson

from schemas.events import RequestCancelled, RequestFailed

# HTTP status of each failure code a gateway can report; unknown codes count as our fault (500).
_FAILURE_STATUS = {
    "no_worker": 503,
    "worker_lost": 502,
    "incomplete_stream": 502,
    "engine_error": 500,
    "invalid_request": 400,
    "timeout": 504,
}
_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    431: "invalid_request_error",
    500: "server_error",
    502: "server_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPE_BY_STATUS.get(status, "server_error")
        self.headers: list[tuple[bytes, bytes]] = []
        """HTTP headers the answer carries besides its content type."""

    def body(self) -> bytes:
        return orjson.dumps(
            {
                "error": {
                    "message": self.message,
                    "type": self.type,
                    "param": self.param,
                    "code": self.code,
                }
            }
        )


class InvalidRequest(ApiError):
    """A 400 that names the offending request field, as OpenAI does."""

    def __init__(self, message: str, param: str | None, code: str | None = None) -> None:
        super().__init__(400, message, param=param, code=code)


def model_not_found(model: str) -> ApiError:
    return ApiError(
        404,
        f"The model `{model}` does not exist or you do not have access to it.",
        param="model",
        code="model_not_found",
    )


def body_too_large(limit: int) -> ApiError:
    return ApiError(
        413,
        f"The request body is larger than this server's limit of {limit} bytes "
        "(LANEWAY_MAX_BODY_BYTES).",
        code="request_too_large",
    )


def headers_too_large(max_bytes: int, max_headers: int) -> ApiError:
    return ApiError(
        431,
        f"The request's headers are larger than this server's limit of {max_bytes} bytes or "
        f"{max_headers} headers (LANEWAY_MAX_HEADER_BYTES, LANEWAY_MAX_HEADERS).",
        code="request_header_fields_too_large",
    )


def head_timeout(timeout_s: float) -> ApiError:
    return ApiError(
        408,
        f"The request's headers did not arrive within {timeout_s:g} s (LANEWAY_HEADER_TIMEOUT_S).",
        code="request_timeout",
    )


# Seconds a client refused for the head buffer is told to wait: heads complete within a round trip
# or are cut off within LANEWAY_HEADER_TIMEOUT_S, so room comes back soon.
HEAD_BUFFER_RETRY_AFTER_S = 1


def head_buffer_full() -> ApiError:
    """A 503, not a 431: the request is within every limit of its own, and the server is what is
    short; clients (the openai SDK among them) retry a 503 after its Retry-After."""
    error = ApiError(
        503,
        "The server is holding as many unfinished request headers as it allows "
        "(LANEWAY_HEAD_BUFFER_BYTES) and cannot take this request now; retry after "
        f"{HEAD_BUFFER_RETRY_AFTER_S} s.",
        code="head_buffer_full",
    )
    error.headers = [(b"retry-after", str(HEAD_BUFFER_RETRY_AFTER_S).encode())]
    return error


def unsupported_media_type(content_type: str) -> ApiError:
    return ApiError(
        415,
        f"Unsupported Content-Type '{content_type}': the body must be JSON, sent with "
        "'Content-Type: application/json' (curl: -H 'Content-Type: application/json').",
        code="unsupported_media_type",
    )


class Overloaded(ApiError):
    """A 429 for a cluster at capacity: the client may retry after ``retry_after_s``."""

    def __init__(self, retry_after_s: int) -> None:
        super().__init__(
            429,
            "The server is at capacity and cannot take this request now; retry after "
            f"{retry_after_s} s.",
            code="server_overloaded",
        )
        self.headers = [(b"retry-after", str(retry_after_s).encode())]


def request_timeout() -> ApiError:
    return ApiError(504, "The request timed out before the model finished.", code="timeout")


def from_terminal(event: RequestFailed | RequestCancelled) -> ApiError:
    if isinstance(event, RequestFailed):
        return ApiError(_FAILURE_STATUS.get(event.code, 500), event.message, code=event.code)
    # We only stop reading after asking for a cancellation ourselves, so a cancellation that
    # reaches the client was decided elsewhere in the cluster.
    if event.reason == "timeout":
        return request_timeout()
    return ApiError(500, f"The request was cancelled: {event.reason}.", code="cancelled")


def server_stopping() -> ApiError:
    return ApiError(
        503,
        "This server stopped before the request finished; send it again.",
        code="server_stopping",
    )


def internal_error() -> ApiError:
    return ApiError(500, "The server had an error while processing your request.")
