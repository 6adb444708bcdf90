"""The draft-tree half of the adaptive draft-length policy (engine/spec/draft_length.py):
how likely N root candidates are to hold the target's token, and the best tree for a batch.
"""

from __future__ import annotations

import numpy as np


class TreeChoice:
    """Mixed into AdaptiveDraftLength, whose attributes it reads: `prior_weight`,
    `global_acceptance`, `max_branches`, `max_draft_tokens`, `_seconds`, and the decayed
    counts `_root_hits` / `_root_trials` (per tree width: steps where some root candidate
    was kept, and steps)."""

    _root_hits: dict[int, float]
    _root_trials: dict[int, float]
    prior_weight: float
    max_branches: int
    max_draft_tokens: int

    def _observe_root(self, branches: int, hit: bool, decay: float) -> bool:
        """Count a tree step's root; returns whether a candidate was kept."""
        self._root_hits[branches] = decay * self._root_hits.get(branches, 0.0) + hit
        self._root_trials[branches] = decay * self._root_trials.get(branches, 0.0) + 1
        return hit

    def root_acceptance(self, a: np.ndarray, n: int) -> np.ndarray:
        """The chance that one of n root candidates is kept, per request of acceptance a:
        1 - (1 - a)^n as if the candidates were independent draws, scaled by how the tree
        steps of n branches measured so far compare with that (candidates of one draft are
        not independent: they tend to miss together), the formula weighing as a prior."""
        return np.clip((1 - (1 - a) ** n) * self._root_factor(n), 0.0, 0.99)

    def _root_factor(self, n: int) -> float:
        """Measured root acceptance of n-branch trees over the independence formula's, the
        formula weighing as a prior (`root_acceptance`)."""
        independent = 1 - (1 - self.global_acceptance) ** n
        w = self.prior_weight
        measured = (self._root_hits.get(n, 0.0) + w * independent) / (
            self._root_trials.get(n, 0.0) + w
        )
        return measured / max(independent, 1e-9)

    def _best_tree(
        self, a: np.ndarray, context: np.ndarray, num_other: int, catch_up: np.ndarray
    ) -> tuple[int, int, float]:
        """The best draft tree for every request (N candidates for the next token, each
        continued to depth K), and its expected tokens per second. N candidates find the
        target's token with `root_acceptance` (1 - (1 - a)^N as if independent, corrected by
        the tree steps measured), the positions after it with a each; the pass pays N x K
        draft tokens and K draft passes of N rows."""
        rows, k_max = len(a), self.max_draft_tokens
        total_context = float(context.sum())
        best = (1, 0, 0.0)
        for n in range(2, self.max_branches + 1):
            first = self.root_acceptance(a, n)  # [rows]
            depth = np.arange(1, k_max + 1)
            gains = first[:, None] * a[:, None] ** (depth[None, :] - 1)  # [rows, k_max]
            k = np.arange(1, k_max + 1)
            tokens = rows + np.cumsum(gains.sum(axis=0))
            seconds = self._seconds(
                rows, num_other + rows, rows * k * n, k, total_context, k * n * total_context, n,
                catch_up.sum(), float(catch_up @ context),
            )  # fmt: skip
            rates = tokens / seconds
            i = int(np.argmax(rates))
            if rates[i] > best[2]:
                best = (n, int(k[i]), float(rates[i]))
        return best
