"""What a step costs on this machine, measured rather than assumed.

- target pass: seconds as a function of the number of tokens in the pass, a table over
  log-spaced sizes measured at start-up and refined online from real steps (EMA per point);
- draft pass: seconds = fixed + per_request * batch, fitted at start-up, then scaled online by
  the ratio of measured to predicted proposer time.

The verifier capacity P is the number of tokens a target pass takes for about the cost of a
single-token pass (within `CAPACITY_SLACK`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np
import torch

from engine.model_runner import ModelRunner, SeqInput

logger = logging.getLogger(__name__)

CAPACITY_SLACK = 1.25
_EMA = 0.1


class CostModel:
    def __init__(
        self,
        sizes: list[int],
        target_seconds: list[float],
        draft_fixed: float,
        draft_per_request: float,
    ) -> None:
        self.sizes = np.asarray(sizes, dtype=np.float64)
        self.target_seconds = np.asarray(target_seconds, dtype=np.float64)
        self.draft_fixed = draft_fixed
        self.draft_per_request = draft_per_request
        self.draft_scale = 1.0
        self._draft_observations = 0

    @classmethod
    def calibrate(
        cls,
        run_target: Callable[[int], None],
        run_draft: Callable[[int], None] | None,
        max_tokens: int,
        max_batch: int,
        repeats: int = 5,
    ) -> CostModel:
        """Time `run_target(n)` for log-spaced n up to max_tokens, and `run_draft(b)`."""
        sizes = _log_sizes(max_tokens)
        target = [_min_time(lambda n=n: run_target(n), repeats) for n in sizes]
        fixed, per_request = 0.0, 0.0
        if run_draft is not None:
            batches = _log_sizes(max_batch)
            times = [_min_time(lambda b=b: run_draft(b), repeats) for b in batches]
            per_request, fixed = (
                np.polyfit(batches, times, 1)
                if len(batches) > 1
                else (
                    0.0,
                    times[0],
                )
            )
            fixed, per_request = max(float(fixed), 0.0), max(float(per_request), 0.0)
        return cls(sizes, target, fixed, per_request)

    def target_time(self, num_tokens: np.ndarray | float) -> np.ndarray:
        # Linear inside the table, linear extrapolation past its end (compute-bound regime).
        # Predictions use a monotone envelope so a bigger pass never looks cheaper; the stored
        # table is left alone so one slow outlier cannot raise every larger size for good.
        table = np.maximum.accumulate(self.target_seconds)
        n = np.asarray(num_tokens, dtype=np.float64)
        inside = np.interp(n, self.sizes, table)
        if len(self.sizes) >= 2:
            slope = (table[-1] - table[-2]) / (self.sizes[-1] - self.sizes[-2])
            inside = np.where(n > self.sizes[-1], table[-1] + slope * (n - self.sizes[-1]), inside)
        return inside

    def draft_time(self, num_passes: np.ndarray, num_drafts: np.ndarray) -> np.ndarray:
        """Seconds for `num_passes` draft passes proposing `num_drafts` tokens in total."""
        return self.draft_scale * (
            self.draft_fixed * np.asarray(num_passes) + self.draft_per_request * num_drafts
        )

    def capacity(self) -> int:
        """Verifier capacity P: most tokens a pass holds within CAPACITY_SLACK x one token."""
        limit = CAPACITY_SLACK * self.target_seconds[0]
        ok = self.sizes[self.target_seconds <= limit]
        return int(ok.max()) if ok.size else 1

    def observe_target(self, num_tokens: int, seconds: float) -> None:
        """Correct the two table points that interpolate num_tokens, each by its weight.

        The correction is multiplicative and clipped to [0.5x, 2x] per observation, so a
        pause on a shared machine moves the model a little, not a lot.
        """
        n = float(min(max(num_tokens, self.sizes[0]), self.sizes[-1]))
        hi = int(np.searchsorted(self.sizes, n))
        lo = max(hi - 1, 0)
        span = self.sizes[hi] - self.sizes[lo]
        w_hi = 1.0 if span == 0 else (n - self.sizes[lo]) / span
        ratio = float(np.clip(seconds / float(self.target_time(n)), 0.5, 2.0))
        for i, w in ((lo, 1.0 - w_hi), (hi, w_hi)):
            if w > 0:
                self.target_seconds[i] *= 1.0 + _EMA * w * (ratio - 1.0)

    def observe_draft(self, num_passes: int, num_drafts: int, seconds: float) -> None:
        predicted = self.draft_fixed * num_passes + self.draft_per_request * num_drafts
        if predicted > 0:
            # The first observations replace a possibly unlucky calibration outright (a running
            # mean); after that an EMA follows drift.
            self._draft_observations += 1
            rate = max(_EMA, 1.0 / self._draft_observations)
            self.draft_scale += rate * (seconds / predicted - self.draft_scale)


def calibrate_runners(
    target: ModelRunner,
    draft: ModelRunner | None,
    block_size: int,
    max_tokens: int,
    max_batch: int,
) -> CostModel:
    """Time target passes by size and draft passes by batch, before any request runs.

    The KV written here is garbage in blocks nobody holds yet; real requests overwrite it.
    """
    table = list(range(-(-max_tokens // block_size)))
    device = target.device

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def run_target(n: int) -> None:
        target.forward([SeqInput([0] * n, 0, table, [n - 1])])
        sync()

    def run_draft(b: int) -> None:
        assert draft is not None
        ctx = min(32, max_tokens - 1)
        draft.forward([SeqInput([0], ctx, table, [0]) for _ in range(b)])
        sync()

    started = time.perf_counter()
    cost = CostModel.calibrate(
        run_target, run_draft if draft is not None else None, max_tokens, max_batch
    )
    logger.info(
        "cost model calibrated in %.1fs: target pass %.2f ms (1 token) .. %.2f ms (%d), "
        "draft pass %.2f ms + %.3f ms/request, verifier capacity P=%d",
        time.perf_counter() - started, cost.target_seconds[0] * 1e3,
        cost.target_seconds[-1] * 1e3, int(cost.sizes[-1]), cost.draft_fixed * 1e3,
        cost.draft_per_request * 1e3, cost.capacity(),
    )  # fmt: skip
    return cost


def _log_sizes(limit: int) -> list[int]:
    sizes, n = [], 1
    while n < limit:
        sizes.append(n)
        n *= 2
    sizes.append(max(limit, 1))
    return sorted(set(sizes))


def _min_time(fn: Callable[[], None], repeats: int) -> float:
    """Best of `repeats`: interference on a shared machine only ever adds time."""
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)
