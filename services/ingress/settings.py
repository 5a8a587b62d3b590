"""What the HTTP API is told about the model it serves and the requests it takes."""

from __future__ import annotations

from dataclasses import dataclass

from schemas.messages import DEFAULT_MODEL


@dataclass(frozen=True, slots=True, kw_only=True)
class IngressApiSettings:
    instance_id: str
    """Ingress instance that the cluster streams answers to (``RequestSpec.reply_to``)."""
    served_model_names: tuple[str, ...] = (DEFAULT_MODEL,)
    block_size: int = 16
    """Tokens per block of the prompt's chained block hashes."""
    max_model_len: int | None = None
    """Limit on prompt tokens + max_tokens, besides the workers' (the smallest a registered worker
    holds); None: only theirs."""
    default_max_tokens: int = 256
    """max_tokens when the client gives none (less if the context has less room)."""
    request_timeout_s: float = 300.0
    """Seconds from receipt until the request is cancelled and answered with 504."""
    max_body_bytes: int = 16 * 1024 * 1024
    """Largest request body taken; a larger one is answered with 413 as soon as it is known."""
    metrics_auth: bool = False
    """Where the API takes keys: ``/metrics`` on the API port takes one with the metrics scope
    too (off: it is open, as ``/health`` always is)."""

    def __post_init__(self) -> None:
        if not self.served_model_names:
            raise ValueError("served_model_names must not be empty")
        if min(self.block_size, self.max_model_len or 1, self.default_max_tokens) < 1:
            raise ValueError("block_size, max_model_len and default_max_tokens must be positive")
        if self.max_body_bytes < 1:
            raise ValueError("max_body_bytes must be positive")
        if self.request_timeout_s <= 0:
            raise ValueError("request_timeout_s must be positive")
