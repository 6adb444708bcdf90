"""What the draft model's part of a step costs: fixed * passes + per_token * drafts + per_pair *
pairs + per_fed * fed (tokens fed without logits), each part with its own online factor
(docs/ADAPTIVE_K.md, "The cost model")."""

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
        # Seconds per pass, per draft, per query x key pair, per fed token.
        self.calibrated = [fixed, per_token, per_pair, per_token if per_fed is None else per_fed]
        self.scales = np.ones(4)  # per part: measured / calibrated
        self.coefs = list(self.calibrated)  # calibrated x scales: what predictions use
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
        """Seconds predicted for one step (plain Python: cheaper than numpy on scalars)."""
        c = self.coefs
        return c[0] * passes + c[1] * drafts + c[2] * pairs + c[3] * fed

    def time(
        self,
        passes: np.ndarray | float,
        drafts: np.ndarray | float,
        pairs: np.ndarray | float,
        fed: np.ndarray | float = 0.0,
    ) -> np.ndarray:
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
        cal = self.calibrated
        parts = np.array([cal[0] * passes, cal[1] * drafts, cal[2] * pairs, cal[3] * fed])
        calibrated = float(parts.sum())
        if calibrated <= 0:  # a model-free drafter: nothing to learn
            return
        shares = parts / calibrated
        predicted = float(shares @ self.scales)
        ratio = min(max(seconds / calibrated, 0.5 * predicted), 2.0 * predicted)
        self.count += 1
        rate = max(_EMA, 1.0 / self.count)
        self._gram += rate * (np.outer(shares, shares) - self._gram)
        self._moment += rate * (shares * ratio - self._moment)
        solved = np.linalg.solve(self._gram + _RIDGE_MATRIX, self._moment + _RIDGE)
        self.scales = np.clip(solved, *_LIMITS)
        self.coefs = [c * s for c, s in zip(cal, self.scales.tolist(), strict=True)]
