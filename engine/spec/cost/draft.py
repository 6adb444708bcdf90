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
        self._scales = [1.0] * 4  # per part: measured / calibrated
        self._coefs = list(self.calibrated)  # calibrated x scales: what predictions use
        self._solved = True  # False: observed since the last fit (made when next needed)
        self.count = 0
        self._gram = [[0.0] * 4 for _ in range(4)]
        self._moment = [0.0] * 4

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

    @property
    def scales(self) -> list[float]:
        self._fit()
        return self._scales

    @property
    def coefs(self) -> list[float]:
        self._fit()
        return self._coefs

    @coefs.setter
    def coefs(self, coefs: list[float]) -> None:
        self._fit()
        self._coefs = list(coefs)

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
        """A step's time into a ridge fit's moments, solved when next read (plain Python here)."""
        cal = self.calibrated
        parts = [cal[0] * passes, cal[1] * drafts, cal[2] * pairs, cal[3] * fed]
        calibrated = sum(parts)
        if calibrated <= 0:  # a model-free drafter: nothing to learn
            return
        shares = [x / calibrated for x in parts]
        raw = seconds / calibrated
        predicted = sum(x * f for x, f in zip(shares, self._scales, strict=True))
        if not self._solved and not 0.5 * predicted <= raw <= 2.0 * predicted:
            self._fit()  # a ratio is clipped to the fit so far: make it current first
            predicted = sum(x * f for x, f in zip(shares, self._scales, strict=True))
        ratio = min(max(raw, 0.5 * predicted), 2.0 * predicted)
        self.count += 1
        rate = max(_EMA, 1.0 / self.count)
        for row, x in zip(self._gram, shares, strict=True):
            for j, y in enumerate(shares):
                row[j] += rate * (x * y - row[j])
        moment = self._moment
        for i, x in enumerate(shares):
            moment[i] += rate * (x * ratio - moment[i])
        self._solved = False

    def _fit(self) -> None:
        if self._solved:
            return
        self._solved = True
        solved = np.linalg.solve(
            np.array(self._gram) + _RIDGE_MATRIX, np.array(self._moment) + _RIDGE
        )
        self._scales = np.clip(solved, *_LIMITS).tolist()
        self._coefs = [c * s for c, s in zip(self.calibrated, self._scales, strict=True)]
