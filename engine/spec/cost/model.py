"""What a step costs on this machine: a start-up fit (calibration.py) of the target pass,
`table(num_tokens) + kv_coef * kv_tokens + qk_coef * qk_pairs`, and the draft's (draft.py),
rescaled online per pass size and tree width (docs/ADAPTIVE_K.md, "The cost model")."""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

from engine.spec.cost.draft import DraftCost

CAPACITY_SLACK = 1.25
_EMA = 0.05
SMALL_PASS = 8
"""Target passes up to this many tokens learn a scale per token count, bigger per `size_bucket`."""
_SMALL_MIN_OBSERVED = 8
_BUCKETS = 40
_OVERHEAD_MIN_OBSERVED = 8


def size_bucket(num_tokens: int) -> int:
    """The size range of a pass of more than SMALL_PASS tokens: 2^(b-1) < num_tokens <= 2^b."""
    return min((int(num_tokens) - 1).bit_length(), _BUCKETS - 1)


def overhead_key(batch: int) -> int:
    """Step overheads are kept per batch up to SMALL_PASS, then per size range (few steps)."""
    return batch if batch <= SMALL_PASS else -size_bucket(batch)


@dataclass(frozen=True)
class PassShape:
    """What a forward pass holds, in the units the cost model charges for."""

    num_tokens: int
    kv_tokens: int = 0  # keys read: the sum of context lengths
    qk_pairs: int = 0  # scores computed: the sum of query x context

    @classmethod
    def of(cls, query_lens: list[int], context_lens: list[int]) -> PassShape:
        return cls(
            sum(query_lens),
            sum(context_lens),
            sum(q * c for q, c in zip(query_lens, context_lens, strict=True)),
        )


class _Scale:
    """Measured / predicted: a running mean at first (an unlucky calibration is replaced
    outright), then an EMA (drift is followed); one ratio is clipped to [0.5, 2] x the mean."""

    def __init__(self) -> None:
        self.value, self.count = 1.0, 0

    def observe(self, measured: float, calibrated: float) -> None:
        if calibrated <= 0:
            return
        self.count += 1
        rate = max(_EMA, 1.0 / self.count)
        ratio = min(max(measured / calibrated, 0.5 * self.value), 2.0 * self.value)
        self.value += rate * (ratio - self.value)


class _Seconds:
    """Seconds averaged as `_Scale` averages ratios, each clipped to twice the mean."""

    def __init__(self) -> None:
        self.value, self.count = 0.0, 0

    def observe(self, seconds: float) -> None:
        if self.count:
            seconds = min(seconds, 2.0 * self.value)
        self.count += 1
        self.value += max(_EMA, 1.0 / self.count) * (seconds - self.value)


class CostModel:
    def __init__(
        self,
        sizes: list[int],
        target_seconds: list[float],
        draft_fixed: float,
        draft_per_token: float,
        *,
        kv_coef: float = 0.0,
        qk_coef: float = 0.0,
        draft_per_pair: float = 0.0,
        draft_per_fed: float | None = None,
    ) -> None:
        self.sizes = np.asarray(sizes, dtype=np.float64)
        # A bigger pass never costs less: timing noise must not make it look that way.
        self.target_seconds = np.maximum.accumulate(np.asarray(target_seconds, dtype=np.float64))
        self._sizes_list = self.sizes.tolist()
        self._table_list = self.target_seconds.tolist()
        limit = CAPACITY_SLACK * self._table_list[0]
        fits = [n for n, t in zip(self._sizes_list, self._table_list, strict=True) if t <= limit]
        self._capacity = int(max(fits, default=1))
        self.kv_coef = kv_coef
        self.qk_coef = qk_coef
        self.draft = DraftCost(draft_fixed, draft_per_token, draft_per_pair, draft_per_fed)
        self.target_scale = _Scale()
        # Per token count, then per size_bucket; used once seen _SMALL_MIN_OBSERVED times.
        self.small_scales = [_Scale() for _ in range(SMALL_PASS + 1)]
        self.size_scales = [_Scale() for _ in range(_BUCKETS)]
        # Per tree width N > 1: (target, draft) cost beyond the scales above.
        self.tree_scales: dict[int, tuple[_Scale, _Scale]] = {}
        # Per (overhead_key(batch), drafted): a decode step's time outside both passes.
        self.overheads: dict[tuple[int, bool], _Seconds] = {}

    def target_time(
        self,
        num_tokens: np.ndarray | float,
        kv_tokens: np.ndarray | float = 0.0,
        qk_pairs: np.ndarray | float = 0.0,
        branches: int = 1,
    ) -> np.ndarray:
        scale = self._target_scales(num_tokens) * self._tree_scale(branches, 0)
        return scale * self._target_calibrated(num_tokens, kv_tokens, qk_pairs)

    def _target_scales(self, num_tokens: np.ndarray | float) -> np.ndarray:
        n = np.asarray(num_tokens)
        by_count = np.array([self._scale_value(s) for s in self.small_scales])
        small = by_count[np.minimum(np.maximum(n, 0), SMALL_PASS).astype(np.int64)]
        buckets = np.minimum(np.frexp(np.maximum(n, SMALL_PASS + 1) - 1)[1], _BUCKETS - 1)
        sizes = self.size_scales[: int(buckets.max()) + 1]
        by_size = np.array([self._scale_value(s) for s in sizes])
        return np.where(n <= SMALL_PASS, small, by_size[buckets])  # frexp: size_bucket

    def target_scale_at(self, num_tokens: int) -> float:
        """The online scale of target passes of `num_tokens` tokens."""
        if num_tokens <= SMALL_PASS:
            scale = self.small_scales[max(int(num_tokens), 0)]
        else:
            scale = self.size_scales[size_bucket(num_tokens)]
        return self._scale_value(scale)

    def _scale_value(self, scale: _Scale) -> float:
        """A size's own scale once seen _SMALL_MIN_OBSERVED times, else the shared one."""
        return scale.value if scale.count >= _SMALL_MIN_OBSERVED else self.target_scale.value

    def draft_time(
        self,
        num_passes: np.ndarray | float,
        num_drafts: np.ndarray | float,
        qk_pairs: np.ndarray | float = 0.0,
        branches: int = 1,
        fed: np.ndarray | float = 0.0,
    ) -> np.ndarray:
        """Seconds for `num_passes` draft passes proposing `num_drafts` tokens and fed `fed`
        more (catch-ups, prompt chunks), `qk_pairs` in all."""
        return self._tree_scale(branches, 1) * self.draft.time(
            num_passes, num_drafts, qk_pairs, fed
        )

    def step_overhead(self, batch: int, drafting: bool = False) -> float:
        """Seconds a decode step of `batch` requests costs outside both passes; the other
        kind's (drafting or not) until `_OVERHEAD_MIN_OBSERVED` steps were seen, else 0."""
        for kind in (drafting, not drafting):
            seen = self.overheads.get((overhead_key(batch), kind))
            if seen is not None and seen.count >= _OVERHEAD_MIN_OBSERVED:
                return seen.value
        return 0.0

    def _tree_scale(self, branches: int, which: int) -> float:
        scales = self.tree_scales.get(branches)
        return scales[which].value if scales is not None else 1.0

    def _target_calibrated(
        self,
        num_tokens: np.ndarray | float,
        kv_tokens: np.ndarray | float,
        qk_pairs: np.ndarray | float,
    ) -> np.ndarray:
        return (
            self.table_seconds(num_tokens)
            + self.kv_coef * np.asarray(kv_tokens, dtype=np.float64)
            + self.qk_coef * np.asarray(qk_pairs, dtype=np.float64)
        )

    def table_seconds(self, num_tokens: np.ndarray | float) -> np.ndarray:
        """A pass's time by its tokens alone, from the table: linear inside it and past its
        end (compute-bound)."""
        n = np.asarray(num_tokens, dtype=np.float64)
        table = self.target_seconds
        inside = np.interp(n, self.sizes, table)
        if len(self.sizes) >= 2:
            slope = (table[-1] - table[-2]) / (self.sizes[-1] - self.sizes[-2])
            inside = np.where(n > self.sizes[-1], table[-1] + slope * (n - self.sizes[-1]), inside)
        return inside

    def capacity(self) -> int:
        """Verifier capacity P: most tokens a pass holds within CAPACITY_SLACK x one token."""
        return self._capacity

    def chain_rates(
        self,
        gains: list[float],
        context: float,
        base_tokens: int,
        max_drafts: int,
        catch_up: float = 0.0,
        overhead: tuple[float, float] = (0.0, 0.0),
        free_drafts: bool = False,
    ) -> list[float]:
        """Per K in 0..max_drafts, the expected tokens per second of one chain (`gains[d - 1]`:
        its d-th draft kept) among `base_tokens` others; K > 0 feeds `catch_up` tokens unless
        `free_drafts`; `overhead`: (plain, drafting) step time."""
        tokens, rates = 1.0, []
        for k in range(max_drafts + 1):
            tokens += gains[k - 1] if k else 0.0
            target = self._target_at(base_tokens + k, context, context * (1 + k))
            fed = catch_up if k else 0.0
            draft = 0.0 if free_drafts else self.draft.at(k, k, (k + fed) * context, fed)
            target_scale = self.target_scale_at(base_tokens + k)
            seconds = target_scale * target + draft + overhead[k > 0]
            rates.append(tokens / seconds)
        return rates

    # Scalar twins of the numpy formulas: numpy's per-call cost dominates on scalars.
    def _target_at(self, num_tokens: float, kv_tokens: float, qk_pairs: float) -> float:
        return self._table_at(num_tokens) + self.kv_coef * kv_tokens + self.qk_coef * qk_pairs

    def observe_target(self, shape: PassShape, seconds: float, branches: int = 1) -> None:
        calibrated = self._target_at(shape.num_tokens, shape.kv_tokens, shape.qk_pairs)
        if branches > 1:  # a tree's cost beyond what a chain's pass of as many tokens costs
            tree = self.tree_scales.setdefault(branches, (_Scale(), _Scale()))
            tree[0].observe(seconds, self.target_scale_at(shape.num_tokens) * calibrated)
            return
        self.target_scale.observe(seconds, calibrated)
        if shape.num_tokens <= SMALL_PASS:
            self.small_scales[shape.num_tokens].observe(seconds, calibrated)
        else:
            self.size_scales[size_bucket(shape.num_tokens)].observe(seconds, calibrated)

    def observe_step(
        self, batch: int, interval: float, passes: float, drafting: bool = False
    ) -> None:
        """`interval`: from a decode step's start to the next's; `passes`: of it in passes."""
        key = (overhead_key(batch), drafting)
        seen = self.overheads.get(key) or self.overheads.setdefault(key, _Seconds())
        seen.observe(max(interval - passes, 0.0))

    def observe_draft(
        self,
        num_passes: int,
        num_drafts: int,
        qk_pairs: int,
        seconds: float,
        branches: int = 1,
        fed: int = 0,
    ) -> None:
        if branches > 1:  # a tree's cost beyond what chains of as many drafts cost
            tree = self.tree_scales.setdefault(branches, (_Scale(), _Scale()))
            tree[1].observe(seconds, self.draft.at(num_passes, num_drafts, qk_pairs, fed))
            return
        self.draft.observe(num_passes, num_drafts, qk_pairs, fed, seconds)

    def _table_at(self, num_tokens: int) -> float:
        sizes, table = self._sizes_list, self._table_list
        i = bisect.bisect_right(sizes, num_tokens) - 1
        if i < 0:
            return table[0]
        if i >= len(sizes) - 1:  # at or past the end: the last segment's slope goes on
            if len(sizes) < 2:
                return table[-1]
            slope = (table[-1] - table[-2]) / (sizes[-1] - sizes[-2])
            return table[-1] + slope * (num_tokens - sizes[-1])
        slope = (table[i + 1] - table[i]) / (sizes[i + 1] - sizes[i])
        return table[i] + slope * (num_tokens - sizes[i])

    def to_dict(self) -> dict:
        """The start-up fit (not the online scale), as JSON-able numbers."""
        return {
            "sizes": [int(s) for s in self.sizes],
            "target_seconds": [float(t) for t in self.target_seconds],
            "kv_coef": self.kv_coef,
            "qk_coef": self.qk_coef,
            "draft_fixed": self.draft.fixed,
            "draft_per_token": self.draft.per_token,
            "draft_per_pair": self.draft.per_pair,
            "draft_per_fed": self.draft.per_fed,
        }

    @classmethod
    def from_dict(cls, data: dict) -> CostModel:
        return cls(
            data["sizes"],
            data["target_seconds"],
            data["draft_fixed"],
            data["draft_per_token"],
            kv_coef=data["kv_coef"],
            qk_coef=data["qk_coef"],
            draft_per_pair=data["draft_per_pair"],
            draft_per_fed=data.get("draft_per_fed"),
        )
