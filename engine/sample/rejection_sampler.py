"""Lossless verification of draft chains, token by token or the block jointly (Sun et al.);
rules and notation (p_i, q_i, w_i, r_i, h_i) in docs/VERIFICATION.md. Greedy, seeded and
model-free rows arrive one-hot, so one rule serves every request."""

from __future__ import annotations

import numpy as np
import torch

from engine.sample.backends import backend_for
from engine.sample.sampler import sample_from, sample_logits

PAD = -1

_F32 = np.float32
_TINY = _F32(1e-30)  # as torch's clamp(min=1e-30) rounds it in float32


def rejection_sample(
    target_probs: torch.Tensor,  # [num_rows, vocab]: request r owns num_draft_tokens[r] + 1
    draft_token_ids: torch.Tensor,  # [num_draft], request by request
    draft_probs: torch.Tensor | None,  # [num_draft, vocab]; None: a model-free drafter
    num_draft_tokens: list[int],
    uniform: torch.Tensor,  # [num_rows]: row j < k decides draft j + 1, the last draws the end
    method: str = "token",
) -> torch.Tensor:  # [batch, max_k + 1]: kept drafts, then recovered or bonus, PAD after
    out = emitted_tokens(
        target_probs, draft_token_ids, draft_probs, num_draft_tokens, uniform, method
    )
    max_k = max(num_draft_tokens, default=0)
    padded = [tokens + [PAD] * (max_k + 1 - len(tokens)) for tokens in out]
    return torch.tensor(padded, dtype=torch.long, device=target_probs.device).view(
        len(out), max_k + 1
    )


def emitted_tokens(
    target_probs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    num_draft_tokens: list[int],
    uniform: torch.Tensor,
    method: str = "token",
) -> list[list[int]]:  # per request: its kept drafts, then the recovered or bonus token
    """`rejection_sample` as lists. Per-request decisions run on float32 numpy scalars, so they
    match the tensor formulas; vocabulary-wide work goes through the sampling backend."""
    if not any(num_draft_tokens):  # nothing to verify: each request's bonus from its row
        return [[t] for t in sample_from(target_probs, uniform).tolist()]
    backend = backend_for(target_probs, draft_probs)
    batch = len(num_draft_tokens)
    row_start, draft_start, row, drafted = [], [], 0, 0
    for k in num_draft_tokens:
        row_start.append(row)
        draft_start.append(drafted)
        row, drafted = row + k + 1, drafted + k
    draft_rows = [row_start[r] + j for r, k in enumerate(num_draft_tokens) for j in range(k)]
    u, ids, p_x, q_x = backend.draft_scalars(
        target_probs, draft_token_ids, draft_probs, draft_rows, uniform
    )

    if method == "block":
        layout = (num_draft_tokens, row_start, draft_start)
        num_kept, weight = _block_lengths(target_probs, draft_probs, p_x, q_x, layout, u)
    else:
        num_kept, weight = [], [_F32(1.0)] * batch
        for r, k in enumerate(num_draft_tokens):
            kept = 0
            while kept < k:
                j = draft_start[r] + kept
                if not (p_x[j] > 0 and q_x[j] > 0 and u[row_start[r] + kept] * q_x[j] <= p_x[j]):
                    break
                kept += 1
            num_kept.append(kept)

    # The draft after the kept ones, if rejected: the residual removes its q.
    rejected = [
        draft_start[r] + num_kept[r] if num_kept[r] < k else -1
        for r, k in enumerate(num_draft_tokens)
    ]
    final_tokens = backend.final_tokens(
        target_probs,
        ids,
        draft_probs,
        final_rows=[row_start[r] + num_kept[r] for r in range(batch)],
        rejected=rejected,
        weights=weight,
        uniform=[u[row_start[r] + k] for r, k in enumerate(num_draft_tokens)],
    )
    return [
        ids[draft_start[r] : draft_start[r] + kept] + [token]
        for r, (kept, token) in enumerate(zip(num_kept, final_tokens, strict=True))
    ]


def verify_sampled(
    logits: torch.Tensor,  # [num_rows, vocab] after penalties and masks; rows as target_probs
    temperatures: list[float],  # per request (> 0): every row is plain softmax(logits / T)
    draft_token_ids: list[int],
    draft_probs: torch.Tensor | None,
    num_draft_tokens: list[int],
    uniform: torch.Tensor,
    method: str = "token",
) -> list[list[int]]:  # as emitted_tokens
    """`emitted_tokens` of softmax(logits / T) rows, in one backend call where it has one."""
    if not any(num_draft_tokens):
        return [[t] for t in sample_logits(logits, temperatures, uniform).tolist()]
    backend = backend_for(logits, draft_probs)
    out = backend.verify_logits(
        logits, temperatures, draft_token_ids, draft_probs, num_draft_tokens, uniform, method
    )
    if out is not None:
        return out
    per_row = [t for t, k in zip(temperatures, num_draft_tokens, strict=True) for _ in range(k + 1)]
    scale = torch.tensor(per_row, dtype=logits.dtype, device=logits.device)[:, None]
    ids = torch.tensor(draft_token_ids, dtype=torch.long, device=logits.device)
    probs = torch.softmax(logits / scale, dim=-1)
    return emitted_tokens(probs, ids, draft_probs, num_draft_tokens, uniform, method)


def _block_lengths(
    target_probs: torch.Tensor,  # [num_rows, vocab]
    draft_probs: torch.Tensor | None,  # [num_draft, vocab] or None (one-hot)
    p_x: list[float],  # per draft: p_j(x_{j+1}), float32 values
    q_x: list[float],  # per draft: q_j(x_{j+1}) (1 for a model-free drafter)
    layout: tuple[list[int], list[int], list[int]],  # num_draft_tokens, row_start, draft_start
    u: list[float],  # per row
) -> tuple[list[int], list[np.float32]]:  # per request: tau, w_tau
    num_draft_tokens, row_start, draft_start = layout
    # w_i per request: a running product of p/q clamped at 1, in float32.
    weights: list[list[np.float32]] = []
    for r, k in enumerate(num_draft_tokens):
        w = [_F32(1.0)]
        for j in range(draft_start[r], draft_start[r] + k):
            ratio = _F32(p_x[j]) / max(_F32(q_x[j]), _TINY) if q_x[j] > 0 else _F32(0.0)
            w.append(min(w[-1] * ratio, _F32(1.0)))
        weights.append(w)
    # h_i for i < K with w_i > 0 needs the vocabulary-wide r_i = sum_x max(0, w_i p_i - q_i).
    inner = [
        (r, i) for r, k in enumerate(num_draft_tokens) for i in range(1, k) if weights[r][i] > 0
    ]
    residual_mass: dict[tuple[int, int], np.float32] = {}
    if inner:
        w_in = [weights[r][i] for r, i in inner]
        if draft_probs is None:  # q_i one-hot at x_{i+1}: r_i = w_i (1 - p_i(x_{i+1}))
            mass = [
                w * (_F32(1.0) - _F32(p_x[draft_start[r] + i]))
                for w, (r, i) in zip(w_in, inner, strict=True)
            ]
        else:
            dtype, device = target_probs.dtype, target_probs.device
            wt = torch.tensor(w_in, dtype=dtype, device=device)
            p_rows = target_probs[[row_start[r] + i for r, i in inner]]
            q_rows = draft_probs[[draft_start[r] + i for r, i in inner]]
            mass = [
                _F32(m)
                for m in (wt[:, None] * p_rows).sub_(q_rows).clamp_(min=0).sum(dim=-1).tolist()
            ]
        residual_mass = dict(zip(inner, mass, strict=True))
    taus, kept_weights = [], []
    for r, k in enumerate(num_draft_tokens):
        tau = 0
        for i in range(1, k + 1):
            w_i = weights[r][i]
            if i == k:
                h = w_i
            elif (r, i) in residual_mass:
                m = residual_mass[(r, i)]
                denom = m + _F32(1.0) - w_i
                h = m / max(denom, _TINY) if denom > 0 else _F32(0.0)
            else:
                h = _F32(0.0)
            if u[row_start[r] + i - 1] < h:  # tau: the largest i whose test passed
                tau = i
        taus.append(tau)
        kept_weights.append(weights[r][tau])
    return taus, kept_weights


def greedy_verify(
    target_argmax: list[int],  # per verified row, request by request (k + 1 rows each)
    draft_token_ids: list[list[int]],  # per request, its drafts
) -> list[list[int]]:  # per request: accepted drafts, then the recovered or bonus token
    """`rejection_sample` of all-greedy rows: drafts while they equal the argmax, then it."""
    emitted, row = [], 0
    for drafts in draft_token_ids:
        n = 0
        while n < len(drafts) and drafts[n] == target_argmax[row + n]:
            n += 1
        emitted.append(drafts[:n] + [target_argmax[row + n]])
        row += len(drafts) + 1
    return emitted
