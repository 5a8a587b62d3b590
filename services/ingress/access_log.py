"""The access log: one info line per API request when it ends, in ``key=value`` form so that a
grep or a log pipeline picks fields out without a parser.

Completion requests and refused paths are logged; the successful ``/health``, ``/metrics`` and
``/v1/models`` answers are not, so that readiness polls and scrapes do not drown the requests.
"""

from __future__ import annotations

import logging

from starlette.types import Scope

from observability.log_text import escaped
from schemas.events import Usage

log = logging.getLogger(__name__)

_NONE = "-"


def log_request(
    scope: Scope,
    status: int,
    total_s: float | None = None,
    *,
    request_id: str | None = None,
    model: str | None = None,
    stream: bool | None = None,
    usage: Usage | None = None,
    ttft_s: float | None = None,
) -> None:
    """Fields a request never reached (no id before it was accepted, no tokens for a failure)
    are written as ``-``. The client's path and model are escaped (``observability.log_text``):
    neither may start another line or another field."""
    if not log.isEnabledFor(logging.INFO):
        return
    log.info(
        "%s %s status=%d id=%s model=%s stream=%s prompt_tokens=%s cached_tokens=%s "
        "completion_tokens=%s ttft_ms=%s total_ms=%s",
        scope["method"],
        escaped(scope["path"], field=True),
        status,
        request_id or _NONE,
        escaped(model, field=True) if model else _NONE,
        _NONE if stream is None else str(stream).lower(),
        _NONE if usage is None else usage.prompt_tokens,
        _NONE if usage is None else usage.cached_tokens,
        _NONE if usage is None else usage.completion_tokens,
        _ms(ttft_s),
        _ms(total_s),
    )


def _ms(seconds: float | None) -> str:
    return _NONE if seconds is None else f"{seconds * 1000:.1f}"
