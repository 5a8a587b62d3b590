"""What an engine's steps cost on this worker's hardware, fitted to the steps it has run.

The planner predicts a request's first token from step times. Its perf model is a preset for
hardware it has not seen (an H100 running a mid-size model, by default); an engine on real
hardware reports its own instead, fitted here: a step's time is a fixed part if it prefills,
plus a part per prompt token it computes, plus a fixed part if it decodes, plus a part per
sequence it gives a token. The fit takes the worker's recent steps (a load's mix changes what
the hardware does), is not dragged by a few far off it (an engine's first steps warm it up and
take seconds; a step can wait on a busy CPU), and makes no part negative.
"""

from __future__ import annotations

from collections import deque

from schemas.control_events import StepCost

# The steps fitted: the latest this many.
WINDOW_STEPS = 256
# Steps of each kind in the window before the fit is reported: until then the perf model.
MIN_STEPS = 8
# The fit weighs each step by how far off the last fit it was (least absolute deviations, by
# reweighting): this many rounds, and no step weighs more than one this close (ms).
ROUNDS = 8
CLOSE_MS = 0.5
# The fit is made again after this many new steps (a load report asks far more often).
REFIT_STEPS = 64
# Tikhonov term, relative to each part's scale: steps that all prefill the same number of tokens
# cannot tell the fixed part from the per-token one, and the fit must still be solvable.
RIDGE = 1e-6
PARTS = 4

_Step = tuple[tuple[float, float, float, float], float]


class StepCostFit:
    def __init__(self, window_steps: int = WINDOW_STEPS, min_steps: int = MIN_STEPS) -> None:
        self._steps: deque[_Step] = deque(maxlen=window_steps)
        self._min = min_steps
        self._fitted: StepCost | None = None
        self._new = 0

    def observe(self, prefill_tokens: int, decode_seqs: int, ms: float) -> None:
        """One step that computed ``prefill_tokens`` prompt tokens and gave ``decode_seqs``
        sequences a token (0 and 0: an empty step, which says nothing), in ``ms``."""
        if prefill_tokens <= 0 and decode_seqs <= 0:
            return
        x = (float(prefill_tokens > 0), float(prefill_tokens), float(decode_seqs > 0), decode_seqs)
        self._steps.append((x, ms))
        self._new += 1

    def estimate(self) -> StepCost | None:
        """The fit, once the window holds enough steps of both kinds; every part at least 0."""
        if self._fitted is None or self._new >= REFIT_STEPS:
            self._fitted = self._fit()
            if self._fitted is not None:
                self._new = 0
        return self._fitted

    def _fit(self) -> StepCost | None:
        steps = list(self._steps)
        prefills = sum(1 for x, _ in steps if x[0])
        if prefills < self._min or len(steps) - prefills < self._min:
            return None
        # Least absolute deviations: a step seconds off (a warm-up) moves the fit no more than
        # one a millisecond off would, where squares would let it drag every part.
        weights = [1.0] * len(steps)
        for _ in range(ROUNDS):
            coef = _fit(steps, weights)
            weights = [1.0 / max(CLOSE_MS, abs(ms - _predict(coef, x))) for x, ms in steps]
        return StepCost(
            prefill_step_ms=round(coef[0], 4),
            prefill_ms_per_token=round(coef[1], 6),
            decode_step_ms=round(coef[2], 4),
            decode_ms_per_seq=round(coef[3], 4),
        )


def _predict(coef: list[float], x: tuple[float, ...]) -> float:
    return sum(c * v for c, v in zip(coef, x, strict=True))


def _fit(steps: list[_Step], weights: list[float]) -> list[float]:
    """Weighted least squares over ``steps`` with no part negative (an active set: a part the
    fit makes negative is set to 0 and the others fitted again)."""
    xx = [[0.0] * PARTS for _ in range(PARTS)]
    xy = [0.0] * PARTS
    for (x, ms), w in zip(steps, weights, strict=True):
        for i in range(PARTS):
            row = xx[i]
            wx = w * x[i]
            for j in range(PARTS):
                row[j] += wx * x[j]
            xy[i] += wx * ms
    # Each part's own scale (tokens run to thousands, the indicators to 1).
    ridge = [RIDGE * max(xx[i][i], 1e-9) for i in range(PARTS)]
    active = list(range(PARTS))
    coef = [0.0] * PARTS
    while active:
        a = [[xx[i][j] + (ridge[i] if i == j else 0.0) for j in active] for i in active]
        solved = _solve(a, [xy[i] for i in active])
        if min(solved) >= 0:
            for i, value in zip(active, solved, strict=True):
                coef[i] = value
            break
        del active[solved.index(min(solved))]
    return coef


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """``a x = b`` for a small symmetric positive definite ``a`` (Gaussian elimination with
    partial pivoting; the ridge keeps it regular)."""
    n = len(b)
    m = [[*row, rhs] for row, rhs in zip(a, b, strict=True)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= f * m[col][c]
    x = [0.0] * n
    for r in reversed(range(n)):
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x
