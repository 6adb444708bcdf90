"""What the draft model's part of a step costs (engine/spec/cost/model.py holds the rest).

    seconds = fixed * passes + per_token * drafts + per_pair * pairs + per_fed * fed

`drafts` are the tokens the draft proposes: each is a row its passes feed and a row of
logits it samples from. `fed` are the tokens it is fed beyond those, without logits: a
lagging request's catch-up (engine/spec/policy/catch_up.py) and new requests' prompt chunks. A
catch-up token costs less than a draft (no head, and it rides in a long pass): a third to a
quarter of one on the toy pair. A policy that priced catch-ups as drafts found resuming
drafting dearer than it was (the toy pair at concurrency 16 over HTTP on a 2-core AMD EPYC,
2026-11-29: two-pass draft steps came in at 0.32 of their prediction feeding 65-128 tokens,
at 1.2-2.1 feeding up to 16; docs/ADAPTIVE_K.md).

The four coefficients are fitted at start-up (engine/spec/cost/calibration.py); each step then
corrects them by its measured time. One shared measured/predicted factor cannot correct a
fit whose parts are off by different factors, so each part gets its own (`scales`): a least
squares fit of the steps' measured/predicted ratios to the parts' shares of the prediction,
weighted as `_Scale` averages (a running mean over the first observations, an EMA after
that), with a ridge that holds the factors the steps do not tell apart at 1 (while every
step drafts K = 2 and feeds nothing else, the fixed and per-draft parts move together).
"""

from __future__ import annotations

import numpy as np

_EMA = 0.05
_RIDGE = 0.002
"""The prior's weight (factors of 1) against the observations' (a total weight of 1)."""
_RIDGE_MATRIX = _RIDGE * np.eye(4)
_LIMITS = (0.1, 10.0)
"""What a part's factor may become: a misfit, not a different machine."""


class DraftCost:
    def __init__(
        self, fixed: float, per_token: float, per_pair: float = 0.0, per_fed: float | None = None
    ) -> None:
        self.calibrated = [fixed, per_token, per_pair, per_token if per_fed is None else per_fed]
        """The start-up fit: seconds per pass, per draft, per query x key pair, per fed token."""
        self.scales = np.ones(4)
        """Per part: measured / calibrated, as the steps observed so far say."""
        self.coefs = list(self.calibrated)
        """The calibrated coefficients times their scales: what predictions use."""
        self.count = 0
        self._gram = np.zeros((4, 4))
        self._moment = np.zeros(4)

    @property
    def fixed(self) -> float:
        return self.calibrated[0]

    @property
    def per_token(self) -> float:
        return self.calibrated[1]

    @property
    def per_pair(self) -> float:
        return self.calibrated[2]

    @property
    def per_fed(self) -> float:
        return self.calibrated[3]

    def at(self, passes: float, drafts: float, pairs: float, fed: float = 0.0) -> float:
        """Seconds predicted for one step (plain Python: steps at concurrency 1 ask often)."""
        c = self.coefs
        return c[0] * passes + c[1] * drafts + c[2] * pairs + c[3] * fed

    def time(
        self,
        passes: np.ndarray | float,
        drafts: np.ndarray | float,
        pairs: np.ndarray | float,
        fed: np.ndarray | float = 0.0,
    ) -> np.ndarray:
        """`at`, elementwise."""
        c = self.coefs
        f64 = np.float64
        return (
            c[0] * np.asarray(passes, dtype=f64)
            + c[1] * np.asarray(drafts, dtype=f64)
            + c[2] * np.asarray(pairs, dtype=f64)
            + c[3] * np.asarray(fed, dtype=f64)
        )

    def observe(
        self, passes: float, drafts: float, pairs: float, fed: float, seconds: float
    ) -> None:
        """A step's draft part took `seconds`: refit the parts' factors."""
        cal = self.calibrated
        parts = np.array([cal[0] * passes, cal[1] * drafts, cal[2] * pairs, cal[3] * fed])
        calibrated = float(parts.sum())
        if calibrated <= 0:  # a model-free drafter: nothing to learn
            return
        shares = parts / calibrated
        # One step moves the fit a little, not a lot: a pause on a shared machine.
        predicted = float(shares @ self.scales)
        ratio = min(max(seconds / calibrated, 0.5 * predicted), 2.0 * predicted)
        self.count += 1
        rate = max(_EMA, 1.0 / self.count)
        self._gram += rate * (np.outer(shares, shares) - self._gram)
        self._moment += rate * (shares * ratio - self._moment)
        solved = np.linalg.solve(self._gram + _RIDGE_MATRIX, self._moment + _RIDGE)
        self.scales = np.clip(solved, *_LIMITS)
        self.coefs = [c * s for c, s in zip(cal, self.scales.tolist(), strict=True)]
