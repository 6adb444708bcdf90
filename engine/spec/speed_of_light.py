"""A live "speed of light" for speculation (docs/ARCHITECTURE.md, "Speculation in brief").

Over a sliding window it tracks the mean entropy mu of the target's verified distributions,
their second log-moment mu2 = E[(log p)^2], and the tokens each verification pass produced.
With the verifier capacity P from the cost model, no deterministic drafter can average more
than about (mu + mu2) ln(P) / mu^2 + O(1) accepted tokens per pass; the measured figure sits
beside that bound.
"""

from __future__ import annotations

import math
from collections import deque

import torch


class SpeedOfLight:
    def __init__(self, window: int = 512, every: int = 32) -> None:
        self.every = every
        """Distributions are read on one verification pass in `every`: the entropy of a
        full-vocabulary softmax costs a few percent of a small model's step, and a sample of
        passes estimates the window's means as well. (One in 8 cost the default model's c=1
        greedy steps 0.07 ms each on average, 0.7% of a step, on the 2-core AMD EPYC: its
        nine small tensor operations run on caches a forward has just emptied.)"""
        self._passes = 0
        self._entropy: deque[float] = deque(maxlen=window)
        self._log_moment: deque[float] = deque(maxlen=window)
        self._tokens_per_pass: deque[int] = deque(maxlen=window)

    def due(self) -> bool:
        """Whether this verification pass should report its distributions."""
        self._passes += 1
        return self._passes % self.every == 1 or self.every == 1

    def observe_distributions(self, logits: torch.Tensor) -> None:
        """[rows, vocab] target logits of verified positions (one row per request is plenty)."""
        logp = torch.log_softmax(logits.float(), dim=-1)
        p = logp.exp()
        plogp = torch.where(p > 0, p * logp, torch.zeros_like(p))
        entropy = -plogp.sum(-1)
        log_moment = torch.where(p > 0, p * logp * logp, torch.zeros_like(p)).sum(-1)
        self._entropy.extend(entropy.tolist())
        self._log_moment.extend(log_moment.tolist())

    def observe_pass(self, num_tokens: int) -> None:
        """Tokens one verification pass with drafts produced (accepted + recovered/bonus)."""
        self._tokens_per_pass.append(num_tokens)

    def snapshot(self, capacity: int) -> dict[str, float]:
        if not self._entropy:
            return {}
        mu = sum(self._entropy) / len(self._entropy)
        mu2 = sum(self._log_moment) / len(self._log_moment)
        bound = (mu + mu2) * math.log(capacity) / mu**2 if mu > 1e-6 else math.inf
        measured = (
            sum(self._tokens_per_pass) / len(self._tokens_per_pass)
            if self._tokens_per_pass
            else 0.0
        )
        return {
            "entropy_mean": mu,
            "log_moment2_mean": mu2,
            "verifier_capacity": float(capacity),
            "bound_tokens_per_pass": bound,
            "measured_tokens_per_pass": measured,
            # The bound counts accepted drafts (plus an O(1) term it leaves out); the bonus or
            # recovered token each pass also emits is not part of it.
            "measured_accepted_per_pass": max(measured - 1.0, 0.0),
        }
