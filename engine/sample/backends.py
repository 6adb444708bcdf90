"""Where sampling and verification draws run: a table of backends, as for attention. `torch`
is the reference on any device; `cpu` (engine/cpu/csrc/sample.c, float32 rows in the CPU's
memory) draws what it draws, up to a float64 rounding at a CDF boundary (tests compare them)."""

from __future__ import annotations

from typing import Protocol

import torch

from engine.cpu import kernels as cpu_kernels
from engine.cpu import sampling as cpu_sampling


class SamplingBackend(Protocol):
    name: str

    def takes(self, *rows: torch.Tensor | None) -> bool:
        """Whether this backend runs on these tensors as they are (device, dtype, layout)."""
        ...

    def sample(self, probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
        """As `engine.sample.sampler.sample_from` draws."""
        ...

    def sample_logits(
        self, logits: torch.Tensor, temperatures: list[float], uniform: torch.Tensor
    ) -> torch.Tensor:
        """`sample` of softmax(logits / T), per row."""
        ...

    def draft_scalars(
        self,
        target_probs: torch.Tensor,  # [num_rows, vocab]
        draft_token_ids: torch.Tensor,  # [num_draft]
        draft_probs: torch.Tensor | None,  # [num_draft, vocab], None: one-hot
        draft_rows: list[int],  # per draft: the row that checks it
        uniform: torch.Tensor,  # [num_rows]
    ) -> tuple[list[float], list[int], list[float], list[float]]:
        """(u per row, draft ids, p(x) and q(x) per draft) as floats of the float32 values."""
        ...

    def final_tokens(
        self,
        target_probs: torch.Tensor,  # [num_rows, vocab]
        draft_token_ids: list[int],
        draft_probs: torch.Tensor | None,  # [num_draft, vocab], None: one-hot
        final_rows: list[int],  # per request: its row after the kept drafts
        rejected: list[int],  # per request: the index of its rejected draft, or -1
        weights: list[float],  # per request: the residual's weight w (1: token verification)
        uniform: list[float],  # per request: the final draw
    ) -> list[int]:
        """The recovered token from max(0, w p - q) of the rejected draft (p where that has no
        mass), or the bonus from p, per request."""
        ...

    def verify_logits(
        self,
        logits: torch.Tensor,  # [num_rows, vocab]: request i's num_drafts[i] + 1 rows, in order
        temperatures: list[float],  # per request (> 0): every row is softmax(logits / T)
        draft_token_ids: list[int],
        draft_probs: torch.Tensor | None,  # [num_draft, vocab], None: one-hot
        num_drafts: list[int],
        uniform: torch.Tensor,  # [num_rows]
        method: str,
    ) -> list[list[int]] | None:
        """The whole verification of plain softmax rows in one call (per request: kept drafts,
        then the final token), or None where the backend has no such call."""
        ...


class TorchSampling:
    """The reference: tensor operations on any device."""

    name = "torch"

    def takes(self, *rows: torch.Tensor | None) -> bool:
        return True

    def sample(self, probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
        cdf = probs.cumsum(dim=-1, dtype=torch.float64)
        total = cdf[:, -1:]
        point = uniform.to(torch.float64)[:, None] * total
        # Strictly below the total, so a token with mass follows (u * total may round up to it).
        point = torch.minimum(point, total.nextafter(torch.zeros_like(total)))
        return torch.searchsorted(cdf, point, right=True)[:, 0]

    def sample_logits(
        self, logits: torch.Tensor, temperatures: list[float], uniform: torch.Tensor
    ) -> torch.Tensor:
        scale = torch.tensor(temperatures, dtype=logits.dtype, device=logits.device)[:, None]
        return self.sample(torch.softmax(logits / scale, dim=-1), uniform)

    def draft_scalars(self, target_probs, draft_token_ids, draft_probs, draft_rows, uniform):
        n, device = len(draft_rows), target_probs.device
        scalars = [uniform.to(torch.float64)]  # float64 holds every float32 and token id
        if n:
            p_x = target_probs[torch.tensor(draft_rows, device=device), draft_token_ids]
            scalars += [draft_token_ids.to(torch.float64), p_x.to(torch.float64)]
            if draft_probs is not None:
                q_x = draft_probs.gather(1, draft_token_ids[:, None])[:, 0]
                scalars.append(q_x.to(torch.float64))
        host = torch.cat(scalars).tolist()
        u, rest = host[: len(uniform)], host[len(uniform) :]
        ids = [int(t) for t in rest[:n]]
        p = rest[n : 2 * n]
        q = rest[2 * n :] if draft_probs is not None else [1.0] * n
        return u, ids, p, q

    def final_tokens(
        self, target_probs, draft_token_ids, draft_probs, final_rows, rejected, weights, uniform
    ):
        device = target_probs.device
        p_final = target_probs[final_rows]  # [batch, vocab]
        which = [r for r, j in enumerate(rejected) if j >= 0]
        if which:
            kept_rows = p_final[which]
            if draft_probs is None:
                q_rej = torch.zeros_like(kept_rows)
                tokens = torch.tensor([draft_token_ids[rejected[r]] for r in which], device=device)
                q_rej[torch.arange(len(which), device=device), tokens] = 1.0
            else:
                q_rej = draft_probs[[rejected[r] for r in which]]
            w = torch.tensor([weights[r] for r in which], dtype=target_probs.dtype, device=device)
            residual = (w[:, None] * kept_rows - q_rej).clamp(min=0)
            # An empty residual has probability 0 in exact arithmetic; guard the division.
            empty = residual.sum(dim=-1, keepdim=True) <= 0
            p_final[which] = torch.where(empty, kept_rows, residual)
        u = torch.tensor(uniform, dtype=torch.float64, device=device)
        return self.sample(p_final, u).tolist()

    def verify_logits(self, *args, **kwargs) -> None:
        return None  # the rule takes the softmax rows


class CpuSampling:
    """engine/cpu/csrc/sample.c: float32 rows in the CPU's memory, one call per draw."""

    name = "cpu"

    def takes(self, *rows: torch.Tensor | None) -> bool:
        return all(
            t.device.type == "cpu"
            and t.dtype == torch.float32
            and t.is_contiguous()
            and cpu_kernels.available()
            for t in rows
            if t is not None
        )

    def sample(self, probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
        return cpu_sampling.sample_rows(probs, uniform)

    def sample_logits(
        self, logits: torch.Tensor, temperatures: list[float], uniform: torch.Tensor
    ) -> torch.Tensor:
        return cpu_sampling.sample_logits(logits, [1.0 / t for t in temperatures], uniform)

    def draft_scalars(self, target_probs, draft_token_ids, draft_probs, draft_rows, uniform):
        n = len(draft_rows)  # numpy views of the rows: no tensor operations
        u, ids = uniform.tolist(), draft_token_ids.tolist()
        p = target_probs.numpy()[draft_rows, ids].tolist()
        q = draft_probs.numpy()[range(n), ids].tolist() if draft_probs is not None else [1.0] * n
        return u, ids, p, q

    def final_tokens(
        self, target_probs, draft_token_ids, draft_probs, final_rows, rejected, weights, uniform
    ):
        tokens = [draft_token_ids[j] if j >= 0 else 0 for j in rejected]
        floats = [float(w) for w in weights]
        return cpu_sampling.sample_final(
            target_probs, final_rows, draft_probs, rejected, tokens, floats, uniform
        )

    def verify_logits(
        self, logits, temperatures, draft_token_ids, draft_probs, num_drafts, uniform, method
    ):
        kept, final = cpu_sampling.verify_sampled(
            logits,
            [1.0 / t for t in temperatures],
            draft_probs,
            draft_token_ids,
            num_drafts,
            uniform,
            block=method == "block",
        )
        out, at = [], 0
        for k, n, token in zip(num_drafts, kept, final, strict=True):
            out.append(draft_token_ids[at : at + n] + [token])
            at += k
        return out


TORCH = TorchSampling()
CPU = CpuSampling()
BACKENDS: dict[str, SamplingBackend] = {b.name: b for b in (CPU, TORCH)}
"""In order of preference: the first that takes a call's tensors runs it."""


def backend_for(*rows: torch.Tensor | None) -> SamplingBackend:
    return next(b for b in BACKENDS.values() if b.takes(*rows))
