"""What an engine's steps cost on this worker's hardware, fitted to the steps it has run.

The planner predicts a request's first token from step times. Its perf model is a preset for
hardware it has not seen (an H100 running a mid-size model, by default); an engine on real
hardware reports its own instead, fitted here: a step's time is a fixed part if it prefills,
plus a part per prompt token it computes, plus a fixed part if it decodes, plus a part per
sequence it gives a token. The fit weighs recent steps most (a load's mix changes what the
hardware does: caches warm up, batches grow), and no part is negative.
"""

from __future__ import annotations

from schemas.worker_events import StepCost

# A step's weight halves after this many later steps.
HALF_LIFE_STEPS = 1000
# Steps of each kind seen before the fit is reported: until then the planner's perf model.
MIN_STEPS = 8
# Tikhonov term, relative to each part's scale: steps that all prefill the same number of tokens
# cannot tell the fixed part from the per-token one, and the fit must still be solvable.
RIDGE = 1e-6
PARTS = 4


class StepCostFit:
    def __init__(self, half_life_steps: int = HALF_LIFE_STEPS, min_steps: int = MIN_STEPS) -> None:
        self._decay = 0.5 ** (1.0 / half_life_steps)
        self._min = min_steps
        # The weighted normal equations' sums: X'X and X'y over the steps seen.
        self._xx = [[0.0] * PARTS for _ in range(PARTS)]
        self._xy = [0.0] * PARTS
        self.prefill_steps = 0
        self.decode_steps = 0

    def observe(self, prefill_tokens: int, decode_seqs: int, ms: float) -> None:
        """One step that computed ``prefill_tokens`` prompt tokens and gave ``decode_seqs``
        sequences a token (0 and 0: an empty step, which says nothing), in ``ms``."""
        if prefill_tokens <= 0 and decode_seqs <= 0:
            return
        x = (float(prefill_tokens > 0), float(prefill_tokens), float(decode_seqs > 0), decode_seqs)
        decay = self._decay
        for i in range(PARTS):
            row = self._xx[i]
            for j in range(PARTS):
                row[j] = decay * row[j] + x[i] * x[j]
            self._xy[i] = decay * self._xy[i] + x[i] * ms
        if prefill_tokens > 0:
            self.prefill_steps += 1
        else:
            self.decode_steps += 1

    def estimate(self) -> StepCost | None:
        """The fit, once enough steps of both kinds were seen; every part at least 0."""
        if self.prefill_steps < self._min or self.decode_steps < self._min:
            return None
        # Each part's own scale (tokens run to thousands, the indicators to 1).
        ridge = [RIDGE * max(self._xx[i][i], 1e-9) for i in range(PARTS)]
        active = list(range(PARTS))
        coef = [0.0] * PARTS
        # An active set: a part the fit makes negative is set to 0 and the others fitted again.
        while active:
            xx = [[self._xx[i][j] + (ridge[i] if i == j else 0.0) for j in active] for i in active]
            solved = _solve(xx, [self._xy[i] for i in active])
            if min(solved) >= 0:
                for i, value in zip(active, solved, strict=True):
                    coef[i] = value
                break
            del active[solved.index(min(solved))]
        return StepCost(
            prefill_step_ms=round(coef[0], 4),
            prefill_ms_per_token=round(coef[1], 6),
            decode_step_ms=round(coef[2], 4),
            decode_ms_per_seq=round(coef[3], 4),
        )


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
