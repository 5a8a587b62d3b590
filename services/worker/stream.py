"""One request's output stream, pure: the engine's outputs for it go in, the token chunks to
publish and the request's latency record come out. No clock and no I/O: the caller says when each
output arrived, so the live worker (monotonic seconds) and a replay (its simulated clock) run it
alike."""

from __future__ import annotations

from typing import NamedTuple

from schemas.events import FinishReason, RequestFinished, RequestSpec, TraceContext, Usage
from schemas.latency import LatencyHistogram
from schemas.logprobs import TokenLogprob, TopLogprob
from services.common.token_times import TokenTimes, gaps_ms
from services.common.tokenizer import IncrementalDetokenizer, Tokenizer
from services.engine.protocol import Logprobs, RequestOutput


class Chunk(NamedTuple):
    """Tokens that go out together; ``position``: the answer position of the first."""

    position: int
    token_ids: tuple[int, ...]
    text: str
    # Where the request asked for them: one for each token.
    logprobs: tuple[TokenLogprob, ...] = ()


def request_detokenizer(tokenizer: Tokenizer, spec: RequestSpec) -> IncrementalDetokenizer:
    """The detokenizer of ``spec``'s answer. A continued one (a migrated request) has taken the
    tokens already delivered first, so the text it gives is where the first worker's left off:
    a character split across the move, or a stop string that spans it, come out as they would
    have there."""
    detokenizer = IncrementalDetokenizer(tokenizer, spec.sampling.stop)
    offset = spec.sampling.offset
    if offset:
        detokenizer.push(spec.prompt_token_ids[len(spec.prompt_token_ids) - offset :])
    return detokenizer


class RequestStream:
    """``received``: when the request arrived (same clock as every ``now``). Without a
    ``detokenizer`` chunks carry no text and no stop string can end the answer. ``offset``:
    answer tokens another worker already generated (a migrated request): the first chunk's
    position, and counted in the usage."""

    def __init__(
        self,
        prompt_tokens: int,
        received: float,
        detokenizer: IncrementalDetokenizer | None = None,
        offset: int = 0,
    ) -> None:
        self.prompt_tokens = prompt_tokens
        self.received = received
        self._detok = detokenizer
        self.token_gaps = LatencyHistogram()
        self.times = TokenTimes(sink=self.token_gaps.add)
        self.finished_at: float | None = None
        self.finish_reason: FinishReason | None = None
        self.cached_tokens = 0
        # Tokens published so far.
        self.emitted = offset
        # Gaps whose step also computed prompt tokens (another request's prefill, mostly).
        self.stalled_gaps = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def stopped(self) -> bool:
        """A stop string ended the answer, possibly before the engine did."""
        return self._detok is not None and self._detok.stopped

    def push(
        self,
        output: RequestOutput,
        now: float,
        stalled: bool = False,
        times: tuple[float, ...] = (),
    ) -> Chunk | None:
        """Take one step's output (``stalled``: that step also computed prompt tokens); the
        chunk to publish now, if any. ``times``: when each of the output's tokens came, where it
        holds several steps' (a decode run, which never computes prompt tokens): each closes a
        gap of its own, as it would have stepped one by one."""
        ids = output.new_token_ids
        clock = self.times
        if clock.first_s is None:
            clock.came(now)
            # The engine counts the cached prefix of the prompt it ran, which for a continued
            # request (a migration) ends with the answer tokens already delivered; the client's
            # usage counts its own prompt, the first ``prompt_tokens`` of it (one migrated
            # request told 144 cached of 98). A prefix cache holds a prefix, so that part of it
            # is the client's prompt, up to its length.
            self.cached_tokens = min(output.cached_tokens or 0, self.prompt_tokens)
        elif ids:
            if times:
                clock.came_in_steps(times[0], gaps_ms(times), times[-1])
            else:
                clock.came(now)
            self.stalled_gaps += stalled * (len(times) or 1)
        detok = self._detok
        stopped = False
        text = ""
        if detok is not None:
            text = detok.push(ids)
            stopped = detok.stopped
            if output.finished and not stopped:
                text += detok.flush()
        finished = output.finished or stopped
        # Every step's tokens go out at once: the worker batches a step's tokens of all its
        # requests into one message per ingress, so holding them back would save no message.
        chunk = None
        if ids or text:
            logprobs: tuple[TokenLogprob, ...] = ()
            if output.logprobs and detok is not None:
                logprobs = tuple(
                    _named(detok, token_id, entry)
                    for token_id, entry in zip(ids, output.logprobs, strict=True)
                )
            chunk = Chunk(self.emitted, ids, text, logprobs)
            self.emitted += len(ids)
        if finished:
            self.finished_at = now
            self.finish_reason = "stop" if stopped else (output.finish_reason or "length")
        return chunk

    def finished_event(
        self,
        source: str,
        request_id: str,
        session_id: str | None,
        trace: TraceContext | None,
        worker_id: str,
        prefill_worker_id: str | None = None,
        attempt: int = 0,
        charged: tuple[str | None, str | None] = (None, None),
    ) -> RequestFinished:
        """The terminal event of a finished stream; ``charged``: its tenant and model."""
        assert self.finish_reason is not None and self.finished_at is not None
        end = self.finished_at
        return RequestFinished(
            source=source,
            request_id=request_id,
            session_id=session_id,
            trace=trace,
            worker_id=worker_id,
            finish_reason=self.finish_reason,
            usage=Usage(
                prompt_tokens=self.prompt_tokens,
                completion_tokens=self.emitted,
                cached_tokens=self.cached_tokens,
            ),
            ttft_ms=((self.times.first_s or end) - self.received) * 1000,
            e2e_ms=(end - self.received) * 1000,
            token_gaps=self.token_gaps,
            stalled_gaps=self.stalled_gaps,
            prefill_worker_id=prefill_worker_id,
            attempt=attempt,
            tenant=charged[0],
            model=charged[1],
        )


def _named(detok: IncrementalDetokenizer, token_id: int, entry: Logprobs) -> TokenLogprob:
    """An engine's log probabilities with each token's text, as the client reads them."""
    top = tuple(
        TopLogprob(token_id=t, token=detok.token_text(t), logprob=lp) for t, lp in entry.top
    )
    return TokenLogprob(token=detok.token_text(token_id), logprob=entry.logprob, top=top)
