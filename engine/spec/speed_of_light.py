"""A live "speed of light" for speculation: the bound (mu + mu2) ln(P) / mu^2 on accepted
tokens per pass over a window (docs/ADAPTIVE_K.md, "Speed of light")."""

from __future__ import annotations

import math
from collections import deque

import torch


class SpeedOfLight:
    def __init__(self, window: int = 512, every: int = 32) -> None:
        # One pass in `every` is read: a full-vocabulary entropy is dear, a sample estimates
        # the window's means as well.
        self.every = every
        self._passes = 0
        self._entropy: deque[float] = deque(maxlen=window)
        self._log_moment: deque[float] = deque(maxlen=window)
        self._tokens_per_pass: deque[int] = deque(maxlen=window)

    def due(self) -> bool:
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
            # The bound counts accepted drafts, not the bonus token each pass emits.
            "measured_accepted_per_pass": max(measured - 1.0, 0.0),
        }
