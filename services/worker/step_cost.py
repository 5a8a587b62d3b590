"""What an engine's steps cost on this worker's hardware, fitted to the steps it has run.

The planner predicts a request's first token from step times. Its perf model is a preset for
hardware it has not seen (an H100 running a mid-size model, by default); an engine on real
hardware reports its own instead, fitted here: a step's time is a fixed part if it prefills,
plus a part per prompt token it computes, plus a fixed part if it decodes, plus a part per
sequence it gives a token. The fit weighs recent steps most (a load's mix changes what the
hardware does: caches warm up, batches grow), and no part is negative.
"""

from __future__ import annotations

import numpy as np

from schemas.worker_events import StepCost

# A step's weight halves after this many later steps.
HALF_LIFE_STEPS = 1000
# Steps of each kind seen before the fit is reported: until then the planner's perf model.
MIN_STEPS = 8
# Tikhonov term, relative to each part's scale: steps that all prefill the same number of tokens
# cannot tell the fixed part from the per-token one, and the fit must still be solvable.
RIDGE = 1e-6


class StepCostFit:
    def __init__(self, half_life_steps: int = HALF_LIFE_STEPS, min_steps: int = MIN_STEPS) -> None:
        self._decay = 0.5 ** (1.0 / half_life_steps)
        self._min = min_steps
        self._xx = np.zeros((4, 4))
        self._xy = np.zeros(4)
        self.prefill_steps = 0
        self.decode_steps = 0

    def observe(self, prefill_tokens: int, decode_seqs: int, ms: float) -> None:
        """One step that computed ``prefill_tokens`` prompt tokens and gave ``decode_seqs``
        sequences a token (0 and 0: an empty step, which says nothing), in ``ms``."""
        if prefill_tokens <= 0 and decode_seqs <= 0:
            return
        x = np.array(
            [prefill_tokens > 0, prefill_tokens, decode_seqs > 0, decode_seqs], dtype=np.float64
        )
        self._xx = self._decay * self._xx + np.outer(x, x)
        self._xy = self._decay * self._xy + x * ms
        if prefill_tokens > 0:
            self.prefill_steps += 1
        else:
            self.decode_steps += 1

    def estimate(self) -> StepCost | None:
        """The fit, once enough steps of both kinds were seen; every part at least 0."""
        if self.prefill_steps < self._min or self.decode_steps < self._min:
            return None
        # Each part's own scale (tokens run to thousands, the indicators to 1).
        ridge = RIDGE * np.diag(np.maximum(np.diag(self._xx), 1e-9))
        active = [0, 1, 2, 3]
        coef = np.zeros(4)
        # An active set: a part the fit makes negative is set to 0 and the others fitted again.
        while active:
            xx = (self._xx + ridge)[np.ix_(active, active)]
            solved = np.linalg.solve(xx, self._xy[active])
            if (solved >= 0).all():
                coef[active] = solved
                break
            del active[int(np.argmin(solved))]
        return StepCost(
            prefill_step_ms=round(float(coef[0]), 4),
            prefill_ms_per_token=round(float(coef[1]), 6),
            decode_step_ms=round(float(coef[2]), 4),
            decode_ms_per_seq=round(float(coef[3]), 4),
        )
