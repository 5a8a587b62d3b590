"""An in-memory Gateway that replays a script of events, recording what the API asked of it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from schemas.events import (
    FailureCode,
    FinishReason,
    RequestCancelled,
    RequestFailed,
    RequestFinished,
    RequestSpec,
    TokensGenerated,
    Usage,
)
from schemas.logprobs import TokenLogprob, TopLogprob
from services.ingress.gateway import CancelReason, GatewayEvent

SOURCE = "worker/fake"


@dataclass(frozen=True)
class Tokens:
    """A step's text, one token a byte; ``held``: those tokens, their text not yet out (part
    of a character, or of a possible stop string)."""

    text: str
    held: bool = False


@dataclass(frozen=True)
class Finish:
    reason: FinishReason = "stop"
    cached_tokens: int = 0


@dataclass(frozen=True)
class Fail:
    code: FailureCode
    message: str = "it broke"


@dataclass(frozen=True)
class Hang:
    """Wait until the request is cancelled, then end it as a worker would."""


@dataclass(frozen=True)
class Raise:
    error: Exception


@dataclass(frozen=True)
class Pause:
    """The worker takes this long before the next step."""

    seconds: float


Step = Tokens | Finish | Fail | Hang | Raise | Pause


@dataclass
class Submitted:
    request_id: str
    session_id: str | None
    spec: RequestSpec


@dataclass
class FakeGateway:
    script: Sequence[Step] = (Tokens("Hel"), Tokens("lo"), Finish())
    submitted: list[Submitted] = field(default_factory=list)
    cancelled: list[tuple[str, CancelReason]] = field(default_factory=list)
    closed: list[str] = field(default_factory=list)
    _cancel_events: dict[str, asyncio.Event] = field(default_factory=dict)

    async def submit(
        self, request_id: str, session_id: str | None, spec: RequestSpec
    ) -> AsyncIterator[GatewayEvent]:
        self.submitted.append(Submitted(request_id, session_id, spec))
        cancelled = self._cancel_events[request_id] = asyncio.Event()
        generated = 0
        try:
            for step in self.script:
                match step:
                    case Tokens(text, held):
                        ids = tuple(text.encode())
                        yield TokensGenerated(
                            source=SOURCE,
                            request_id=request_id,
                            worker_id="w0",
                            index=generated,
                            token_ids=ids,
                            text="" if held else text,
                            logprobs=_logprobs(ids, generated, spec.sampling.logprobs),
                        )
                        generated += len(ids)
                    case Finish(reason, cached_tokens):
                        usage = Usage(
                            prompt_tokens=len(spec.prompt_token_ids),
                            completion_tokens=generated,
                            cached_tokens=cached_tokens,
                        )
                        yield RequestFinished(
                            source=SOURCE,
                            request_id=request_id,
                            worker_id="w0",
                            finish_reason=reason,
                            usage=usage,
                            ttft_ms=1.0,
                            e2e_ms=2.0,
                        )
                        return
                    case Fail(code, message):
                        yield RequestFailed(
                            source=SOURCE,
                            request_id=request_id,
                            code=code,
                            message=message,
                        )
                        return
                    case Hang():
                        await cancelled.wait()
                        yield RequestCancelled(
                            source=SOURCE, request_id=request_id, reason="cancelled"
                        )
                        return
                    case Raise(error):
                        raise error
                    case Pause(seconds):
                        await asyncio.sleep(seconds)
        finally:
            self.closed.append(request_id)

    async def cancel(self, request_id: str, reason: CancelReason) -> None:
        self.cancelled.append((request_id, reason))
        self._cancel_events[request_id].set()


def _logprobs(ids: tuple[int, ...], position: int, top: int | None) -> tuple[TokenLogprob, ...]:
    """Made-up log probabilities where the request asks: the answer's i-th token's is -i/10,
    and its alternatives are the next bytes, each a tenth less likely."""
    if top is None:
        return ()
    return tuple(
        TokenLogprob(
            token=chr(t),
            logprob=-(position + i) / 10,
            top=tuple(
                TopLogprob(token_id=t + k, token=chr(t + k), logprob=-(position + i + k) / 10)
                for k in range(top)
            ),
        )
        for i, t in enumerate(ids)
    )
