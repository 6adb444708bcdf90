"""The adaptive policy's searches for a batch's best draft lengths (chains) and draft trees,
vectorised over requests, on the cost model's predicted step time."""

from __future__ import annotations

import numpy as np

from engine.spec.cost.model import CostModel
from engine.spec.policy.acceptance import AcceptanceEstimates


class BatchSearch:
    """Chain searches take `gains` [requests, K_max] (the chance a d-th draft is kept),
    contexts, the pass's other tokens and `catch_up` (per request, `CatchUp.tokens`)."""

    def __init__(
        self, cost: CostModel, estimates: AcceptanceEstimates, max_slowdown: float | None = None
    ) -> None:
        self.cost = cost
        self.estimates = estimates
        self.max_slowdown = max_slowdown

    def _fair(
        self, rows: int, rates: np.ndarray, seconds: np.ndarray, plain: float, least: np.ndarray
    ) -> np.ndarray:
        """`rates`, 0 where some request's rate would fall past `max_slowdown` (None: no cap):
        `least` (its 1 + kept drafts) in `seconds` against one token in `plain`'s."""
        if rows == 1 or self.max_slowdown is None:
            return rates
        return np.where(seconds * (1 - self.max_slowdown) <= least * plain, rates, 0.0)

    def _seconds(
        self,
        rows: int,
        base_tokens: float,
        drafts: np.ndarray,
        passes: np.ndarray,
        decode_pairs: float,
        draft_pairs: np.ndarray,
        branches: int = 1,
        fed: np.ndarray | float = 0.0,
        fed_pairs: np.ndarray | float = 0.0,
    ) -> np.ndarray:
        """Predicted step time of `rows` decoding requests: target pass (base_tokens plus the
        drafts), draft passes (with `fed` catch-up tokens) and the step's overhead."""
        return (
            self.cost.target_time(
                base_tokens + drafts, decode_pairs, decode_pairs + draft_pairs, branches
            )
            + self.cost.draft_time(passes, drafts, draft_pairs + fed_pairs, branches, fed)
            + self._overhead(rows, drafts)
        )

    def _overhead(self, rows: int, drafts: np.ndarray | float) -> np.ndarray:
        """The step's measured cost outside the passes: a drafting step's where `drafts` > 0."""
        return np.where(
            np.asarray(drafts) > 0,
            self.cost.step_overhead(rows, drafting=True),
            self.cost.step_overhead(rows, drafting=False),
        )

    def best_uniform(
        self, gains: np.ndarray, context: np.ndarray, num_other: int, catch_up: np.ndarray
    ) -> tuple[np.ndarray, float]:
        """The best single K for every request, and its expected tokens per second."""
        rows, k_max = gains.shape
        k = np.arange(0, k_max + 1)
        tokens = rows + np.concatenate([[0.0], np.cumsum(gains.sum(axis=0))])
        total_context = float(context.sum())
        drafting = k > 0
        seconds = self._seconds(
            rows,
            num_other + rows,
            rows * k,
            k,
            total_context,
            k * total_context,
            1,
            drafting * catch_up.sum(),
            drafting * float(catch_up @ context),
        )
        least = 1 + np.concatenate([[0.0], np.cumsum(gains, axis=1).min(axis=0)])
        rates = self._fair(rows, tokens / seconds, seconds, float(seconds[0]), least)
        best = int(np.argmax(rates))
        return np.full(rows, best, dtype=np.int64), float(rates[best])

    def best_prefix(
        self, gains: np.ndarray, context: np.ndarray, num_other: int, catch_up: np.ndarray
    ) -> tuple[np.ndarray, float]:
        """K per request from the best prefix of increments ranked by gain, and its expected
        tokens per second (the deepest draft sets the draft passes)."""
        rows, k_max = gains.shape
        order = np.argsort(-gains, axis=None, kind="stable")
        owner = order // k_max
        depth = order % k_max + 1
        m = np.arange(0, order.size + 1)  # prefix length = total draft tokens
        tokens = rows + np.concatenate([[0.0], np.cumsum(gains.reshape(-1)[order])])
        passes = np.concatenate([[0], np.maximum.accumulate(depth)])
        draft_pairs = np.concatenate([[0.0], np.cumsum(context[owner])])
        lag = np.where(depth == 1, catch_up[owner], 0.0)  # paid with a request's first draft
        fed = np.concatenate([[0.0], np.cumsum(lag)])
        fed_pairs = np.concatenate([[0.0], np.cumsum(lag * context[owner])])
        seconds = self._seconds(
            rows, num_other + rows, m, passes, float(context.sum()), draft_pairs, 1, fed, fed_pairs
        )
        rates = tokens / seconds
        if rows > 1 and self.max_slowdown is not None:  # each request's kept drafts by prefix
            kept = np.zeros((order.size + 1, rows))
            kept[np.arange(1, order.size + 1), owner] = gains.reshape(-1)[order]
            least = 1 + np.cumsum(kept, axis=0).min(axis=1)
            rates = self._fair(rows, rates, seconds, float(seconds[0]), least)
        best = int(np.argmax(rates))
        ks = np.zeros(rows, dtype=np.int64)
        np.add.at(ks, owner[:best], 1)
        return ks, float(rates[best])

    def best_alone(
        self, gains: np.ndarray, context: np.ndarray, catch_up: np.ndarray
    ) -> np.ndarray:
        """K per request if it were the only one decoding (vectorised over requests)."""
        rows, k_max = gains.shape
        drafts = np.arange(0, k_max + 1)[None, :]  # K = 0..k_max for each request
        tokens = 1 + np.concatenate([np.zeros((rows, 1)), np.cumsum(gains, 1)], axis=1)
        ctx = context[:, None]
        fed = (drafts > 0) * catch_up[:, None]
        seconds = (
            self.cost.target_time(1 + drafts, ctx, (1 + drafts) * ctx)
            + self.cost.draft_time(drafts, drafts, (drafts + fed) * ctx, 1, fed)
            + self._overhead(1, drafts)
        )
        return np.argmax(tokens / seconds, axis=1)

    def best_tree(
        self,
        a: np.ndarray,
        context: np.ndarray,
        num_other: int,
        catch_up: np.ndarray,
        max_branches: int,
    ) -> tuple[int, int, float]:
        """(N, K, expected tokens per second) of the best tree for every request: the root
        kept with `root_acceptance`, deeper positions with a each; N x K drafts, K passes."""
        rows, k_max = len(a), self.estimates.max_draft_tokens
        total_context = float(context.sum())
        plain = self._seconds(rows, num_other + rows, np.zeros(1), np.zeros(1), total_context, 0.0)
        best = (1, 0, 0.0)
        for n in range(2, max_branches + 1):
            first = self.estimates.root_acceptance(a, n)  # [rows]
            depth = np.arange(1, k_max + 1)
            gains = first[:, None] * a[:, None] ** (depth[None, :] - 1)  # [rows, k_max]
            k = np.arange(1, k_max + 1)
            tokens = rows + np.cumsum(gains.sum(axis=0))
            seconds = self._seconds(
                rows,
                num_other + rows,
                rows * k * n,
                k,
                total_context,
                k * n * total_context,
                n,
                catch_up.sum(),
                float(catch_up @ context),
            )
            least = 1 + np.cumsum(gains, axis=1).min(axis=0)
            rates = self._fair(rows, tokens / seconds, seconds, float(plain[0]), least)
            i = int(np.argmax(rates))
            if rates[i] > best[2]:
                best = (n, int(k[i]), float(rates[i]))
        return best
