"""Expected output length, learned online from finished requests.

A router never knows how long an answer will be; the cost model needs a number anyway (the KV a
request will hold, the decode load it adds). This learns one from what finished: a session's own
answers first (a conversation's turns resemble each other), else the answers to prompts of a
similar length (buckets of doubling length), else all answers, else a prior. Each estimate is a
moving average, and the client's ``max_tokens`` caps it: the true length is never an input.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(slots=True)
class _Mean:
    """A mean of the first ``window`` samples, then an exponential moving average over about
    that many: recent answers count most, once there are enough of them."""

    value: float = 0.0
    count: int = 0

    def add(self, x: float, window: int) -> None:
        self.count += 1
        self.value += (x - self.value) / min(self.count, window)


class OutputLengthPredictor:
    def __init__(self, prior: int = 256, window: int = 64, max_sessions: int = 100_000) -> None:
        self._prior = prior
        self._window = window
        # Sessions come from clients: bounded, the least recently seen forgotten first.
        self._max_sessions = max_sessions
        self._sessions: OrderedDict[str, _Mean] = OrderedDict()
        self._buckets: dict[int, _Mean] = {}
        self._all = _Mean()

    def predict(self, session_id: str | None, prompt_tokens: int, max_tokens: int) -> int:
        """Expected output tokens, at least 1 and at most ``max_tokens`` (0: no cap)."""
        session = self._sessions.get(session_id) if session_id is not None else None
        bucket = self._buckets.get(_bucket(prompt_tokens))
        for estimate in (session, bucket, self._all):
            if estimate is not None and estimate.count:
                value = round(estimate.value)
                break
        else:
            value = self._prior
        value = max(1, value)
        return min(value, max_tokens) if max_tokens > 0 else value

    def observe(self, session_id: str | None, prompt_tokens: int, output_tokens: int) -> None:
        """A request finished after generating ``output_tokens``."""
        if output_tokens <= 0:
            return
        if session_id is not None:
            sessions = self._sessions
            mean = sessions.pop(session_id, None) or _Mean()
            sessions[session_id] = mean
            if len(sessions) > self._max_sessions:
                sessions.popitem(last=False)
            mean.add(output_tokens, self._window)
        self._buckets.setdefault(_bucket(prompt_tokens), _Mean()).add(output_tokens, self._window)
        self._all.add(output_tokens, self._window)


def _bucket(prompt_tokens: int) -> int:
    """Prompts of 1, 2-3, 4-7, … tokens share a bucket."""
    return max(1, prompt_tokens).bit_length()
