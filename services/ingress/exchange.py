"""One request's conversation with the gateway, written to the client as it goes: its deadline,
the client leaving, cancelling what the cluster no longer needs to finish, and the metrics."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from starlette.types import Message, Receive, Send

from schemas.events import RequestFinished, RequestSpec, TokensGenerated, Usage, new_id
from schemas.logprobs import TokenLogprob
from services.ingress.errors import (
    ApiError,
    from_terminal,
    internal_error,
    request_timeout,
    server_stopping,
)
from services.ingress.gateway import CancelReason, Gateway, GatewayEvent
from services.ingress.metrics import CLIENT_CLOSED_STATUS, IngressMetrics
from services.ingress.openai_models import Params
from services.ingress.responses import (
    JSON_HEADERS,
    SSE_HEADERS,
    Format,
    Headers,
    send_json,
    sse_error,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Endpoint:
    """The completion endpoint that took a request, as its exchange needs it."""

    name: str
    """The endpoint's label in the metrics."""
    gateway: Gateway
    metrics: IngressMetrics
    response_format: type[Format]
    timeout_s: float
    """Seconds from receipt until the request is cancelled and answered with 504."""


class _ClientGone(Exception):
    pass


# How long a request runs before its client is watched for leaving: most answers are done
# sooner, and then no watcher is started at all (a task each, a twentieth of the ingress's CPU a
# request at 32 streams). A client that left meanwhile is seen as soon as the watcher starts.
WATCH_AFTER_S = 0.05


class _DisconnectWatch:
    """Cancels the request's task when the client goes away, so that a request waiting on the
    cluster (where no ``send`` would fail) notices within ``WATCH_AFTER_S``. ``stop`` must run,
    synchronously, before the task leaves the code that is prepared for that cancellation.

    The watcher is not cancelled when stopped: the server answers its pending ``receive`` with
    a disconnect once the response is complete or the connection gone (uvicorn and the ASGI
    spec), and it then ends by itself. A cancelled watcher left a reference cycle per request
    (its CancelledError's traceback holds the frames that hold the task), about 27 objects that
    only the garbage collector frees: at 900 requests a second, a 28 ms young collection every
    2.5 s in the ingress."""

    __slots__ = ("_receive", "_stopped", "_task", "_timer", "_watcher", "fired")

    def __init__(self, receive: Receive) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._task = task
        self._receive = receive
        self._stopped = False
        self.fired = False
        self._watcher: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = asyncio.get_running_loop().call_later(
            WATCH_AFTER_S, self._start
        )

    def _start(self) -> None:
        self._timer = None
        # Referenced here: the loop holds its tasks only weakly.
        self._watcher = asyncio.create_task(self._watch())

    async def _watch(self) -> None:
        # The body has been read, so the next message can only be the disconnect.
        while (await self._receive())["type"] != "http.disconnect":
            pass
        if not self._stopped:
            self.fired = True
            self._task.cancel()

    def stop(self) -> None:
        self._stopped = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def forgive(self) -> None:
        """Undo our own cancellation once it has been handled."""
        self._task.uncancel()


class Exchange:
    """One request, from its submission to the gateway to the end of its answer.

    Streaming responses are committed (status 200) only at the first event, so that a request
    that fails before producing anything still gets a proper HTTP error status. A failure after
    that is sent as a final ``data: {"error": {...}}`` event and the stream is closed *without*
    ``data: [DONE]``: a client that only watches for [DONE] then sees a broken stream rather than
    a successful, truncated answer.
    """

    def __init__(
        self,
        endpoint: Endpoint,
        params: Params,
        spec: RequestSpec,
        session_id: str | None,
        received: float,
    ) -> None:
        self._endpoint = endpoint
        self._gateway = endpoint.gateway
        self._metrics = endpoint.metrics
        self._params = params
        self._spec = spec
        self._session_id = session_id
        self._received = received
        self.request_id = new_id()
        self._format = endpoint.response_format(self.request_id, params.model, params.include_usage)
        self._started = False
        self.ttft_s: float | None = None
        """Seconds from receipt to the first generated token, once it came."""
        self.usage: Usage | None = None
        """The finished request's token counts."""
        self._generated = 0  # tokens delivered so far (a stream cut before its end)
        self._ended = False  # the gateway delivered the terminal event

    async def run(self, receive: Receive, send: Send) -> int:
        """Serve the request; returns the status for the metrics (499: client went away)."""

        async def send_to_client(message: Message) -> None:
            try:
                await send(message)
            except OSError as error:
                # Servers that implement ASGI 2.4 raise OSError when writing to a gone client.
                raise _ClientGone from error

        watch = _DisconnectWatch(receive)
        events = self._gateway.submit(self.request_id, self._session_id, self._spec)
        self._metrics.in_flight.inc()
        deadline_scope = asyncio.timeout(self._endpoint.timeout_s)
        try:
            try:
                async with deadline_scope:
                    return await self._relay(events, send_to_client)
            finally:
                watch.stop()
        except TimeoutError:
            if not deadline_scope.expired():
                return await self._crash(send)
            await self._cancel("timeout")
            return await self._fail(send, request_timeout())
        except asyncio.CancelledError:
            if not watch.fired:
                # Cancelled from outside: the server stopped before the request finished (its
                # grace for requests in flight ran out). The worker stops generating, and the
                # client is told so, a stream with an error event, not a cut.
                task = asyncio.current_task()
                if task is None or task.uncancel():  # cancelled twice: leaving at once
                    raise
                await self._cancel("client_disconnected")
                return await self._fail(send, server_stopping())
            watch.forgive()
            await self._cancel("client_disconnected")
            return CLIENT_CLOSED_STATUS
        except _ClientGone:
            await self._cancel("client_disconnected")
            return CLIENT_CLOSED_STATUS
        except Exception:
            return await self._crash(send)
        finally:
            self._metrics.in_flight.dec()
            aclose = getattr(events, "aclose", None)
            if aclose is not None:
                await aclose()

    async def _relay(self, events: AsyncIterator[GatewayEvent], send: Send) -> int:
        stream = self._params.stream
        texts: list[str] = []
        # Log probabilities not yet sent (a token whose text is held back, part of a character
        # or of a possible stop string, goes out with the text that follows); None: not asked.
        logprobs: list[TokenLogprob] | None = None if self._params.logprobs is None else []
        async for event in events:
            if isinstance(event, TokensGenerated):
                self._generated += len(event.token_ids)
                if self.ttft_s is None:
                    self.ttft_s = self._elapsed()
                    self._metrics.first_token(self._endpoint.name, self._params.model, self.ttft_s)
                if logprobs is not None:
                    logprobs.extend(event.logprobs)
                if not event.text:
                    continue
                if not stream:
                    texts.append(event.text)
                elif logprobs is None:
                    await self._stream(send, self._format.delta(event.text), more=True)
                else:
                    body = self._format.delta_logprobs(event.text, logprobs)
                    logprobs = []
                    await self._stream(send, body, more=True)
                continue
            self._ended = True
            if not isinstance(event, RequestFinished):
                return await self._fail(send, from_terminal(event))
            if stream:
                body = self._format.closing(event)
                if logprobs:
                    body = self._format.delta_logprobs("", logprobs) + body
                await self._stream(send, body, more=False)
            else:
                body = self._format.full("".join(texts), event, logprobs)
                await send_json(send, 200, body, self._headers(JSON_HEADERS))
            usage = self.usage = event.usage
            self._metrics.completed(
                self._endpoint.name,
                self._params.model,
                self._elapsed(),
                self.ttft_s,
                usage.prompt_tokens,
                usage.cached_tokens,
                usage.completion_tokens,
                self._spec.tenant,
            )
            return 200
        raise RuntimeError("the gateway's events ended without a terminal event")

    def used_tokens(self) -> int:
        """Prompt and completion tokens to charge the tenant: the finished request's usage, or
        for one cut or failed after its first token, its prompt and the tokens it got; nothing
        for one that never produced a token (as `laneway usage` counts them)."""
        if self.usage is not None:
            return self.usage.prompt_tokens + self.usage.completion_tokens
        if self._generated == 0:
            return 0
        return self._spec.prompt_length + self._generated

    async def _stream(self, send: Send, body: bytes, *, more: bool) -> None:
        """Write stream events, committing to a 200 stream first if this is its first write (the
        opening events go out with this body: one write fewer per request)."""
        if not self._started:
            self._started = True
            headers = self._headers(SSE_HEADERS)
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            body = self._format.opening() + body
        await send({"type": "http.response.body", "body": body, "more_body": more})

    def _elapsed(self) -> float:
        return time.perf_counter() - self._received

    def _headers(self, base: Headers) -> Headers:
        return [*base, (b"x-request-id", self.request_id.encode())]

    async def _fail(self, send: Send, error: ApiError) -> int:
        try:
            if self._started:
                await self._stream(send, sse_error(error), more=False)
            else:
                await send_json(send, error.status, error.body(), self._headers(JSON_HEADERS))
        except (OSError, _ClientGone):
            return CLIENT_CLOSED_STATUS
        return error.status

    async def _crash(self, send: Send) -> int:
        """Answer an unexpected exception (being handled) with a 500."""
        log.exception("request %s failed", self.request_id)
        # Nobody will read the answer; don't leave a worker generating it.
        await self._cancel("client_disconnected")
        return await self._fail(send, internal_error())

    async def _cancel(self, reason: CancelReason) -> None:
        if self._ended:
            return
        try:
            await self._gateway.cancel(self.request_id, reason)
        except Exception:
            # The request still ends at its deadline; the client must get its answer regardless.
            log.warning("cancelling request %s failed", self.request_id, exc_info=True)
