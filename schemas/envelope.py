"""What every event shares: the envelope, its frozen base model and the common field types."""

from __future__ import annotations

import os
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from annotated_types import MaxLen
from pydantic import BaseModel, ConfigDict, Field

TokenIds = tuple[int, ...]
BlockHashes = tuple[Annotated[int, Field(ge=0, lt=1 << 64)], ...]
Role = Literal["prefill", "decode", "both"]
FinishReason = Literal["stop", "length"]
# Where a worker caches KV blocks: GPU memory, or host memory that a hit loads back over PCIe.
KvTier = Literal["gpu", "host"]


def attempt_field() -> Any:
    return Field(
        default=0, ge=0, description="the request's attempt (`RequestSpec.attempt`) this is of"
    )


# A terminal event's tenant and model: whom its tokens are charged to, and for what (`laneway
# usage`); None in an event from before they were carried.
def tenant_field() -> Any:
    return Field(default=None, max_length=64, description="the request's tenant (None: no keys)")


def model_field() -> Any:
    return Field(default=None, max_length=256, description="the model that served it")


def new_id() -> str:
    """A 32-hex-digit identifier, safe to use as a NATS subject token."""
    # Every event takes one: 128 random bits as uuid4's 122, a quarter of its cost.
    return os.urandom(16).hex()


def utc_now() -> datetime:
    return datetime.now(UTC)


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class TraceContext(Frozen):
    """W3C trace context of the span that caused this event."""

    # The W3C form (a later version may add fields): what is carried on unparsed, as it came,
    # where no span is recorded (observability.carried) is well-formed at least.
    traceparent: str = Field(
        pattern=r"^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}(-[0-9a-zA-Z._-]*)?$",
        max_length=256,
        description="W3C `traceparent` header value",
    )
    tracestate: Annotated[str, MaxLen(512)] | None = Field(
        default=None, description="W3C `tracestate` header value"
    )


class Envelope(Frozen):
    """Fields every event carries. Subclasses fix ``type`` and add their payload."""

    event_id: str = Field(default_factory=new_id, description="unique id, used for de-duplication")
    schema_version: int = Field(default=1, description="version of this event type's payload")
    occurred_at: datetime = Field(default_factory=utc_now, description="UTC time of the fact")
    source: str = Field(description="emitting service and instance, `service/instance`")
    request_id: str | None = Field(default=None, description="request this event concerns")
    session_id: str | None = Field(default=None, description="conversation the request belongs to")
    trace: TraceContext | None = Field(default=None, description="trace context of the cause")
