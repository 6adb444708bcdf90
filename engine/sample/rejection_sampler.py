"""Lossless verification of draft tokens: token by token, or the block jointly.

Target distribution p, draft distribution q, drafts x_1..x_K of one request; p_i is the
target's distribution after i drafts (row i), q_i the one x_{i+1} was drawn from.

Token verification (Leviathan et al.; Chen et al.):
  accept x_i while u_i * q(x_i) <= p(x_i)   (probability min(1, p/q); q(x) = 0 or p(x) = 0 rejects)
  at the first rejection emit a *recovered* token ~ norm(max(0, p - q)) and stop;
  if all K are accepted emit a *bonus* token ~ p_K.

Block verification (Sun et al., ICLR 2025) decides the block jointly. With weights
  w_0 = 1,  w_i = min(1, w_{i-1} * p_{i-1}(x_i) / q_{i-1}(x_i)),
  r_i = sum_x max(0, w_i p_i(x) - q_i(x))   (the mass the target still owes after x_1..x_i),
  h_i = r_i / (r_i + 1 - w_i) for i < K,  h_K = w_K,
it keeps x_1..x_tau for the largest tau with u_tau < h_tau (tau = 0 if none), then emits a
token ~ norm(max(0, w_tau p_tau - q_tau)), or the bonus ~ p_K when tau = K. The output is
distributed exactly as the target's (docs/VERIFICATION.md) and keeps at least as many drafts
as token verification, for one vocabulary-wide residual per draft.

Greedy (and seeded) rows arrive one-hot, so both rules reproduce the target's own output. A
model-free drafter's q is one-hot on the draft token.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.cpu import sampling as cpu_sampling
from engine.sample.sampler import kernel_rows, sample_from

PAD = -1

_F32 = np.float32
_TINY = _F32(1e-30)  # as torch's clamp(min=1e-30) rounds it in float32


def rejection_sample(
    # [num_rows, vocab] p per verified position; request r owns num_draft_tokens[r] + 1 rows
    target_probs: torch.Tensor,
    # [num_draft] flat draft tokens, request by request
    draft_token_ids: torch.Tensor,
    # [num_draft, vocab] q for each draft token, or None for a model-free drafter
    draft_probs: torch.Tensor | None,
    num_draft_tokens: list[int],
    # [num_rows] u ~ U[0, 1) per row: row j < k of a request decides on its draft j + 1, its
    # last row samples the recovered or bonus token (one draw each, independent)
    uniform: torch.Tensor,
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
    """`rejection_sample` as lists (what the verifier reads). The per-request decisions run on
    the tensors' own values as Python scalars, in float32 (numpy), so they match the tensor
    formulas, and only vocabulary-wide work runs on tensors: a few requests a step would pay
    for a vectorised layout's many small operations. On the CPU the final tokens come from one
    kernel call that draws what the tensor path would."""
    device = target_probs.device
    batch = len(num_draft_tokens)
    row_start, draft_start, row, drafted = [], [], 0, 0
    for k in num_draft_tokens:
        row_start.append(row)
        draft_start.append(drafted)
        row, drafted = row + k + 1, drafted + k
    # Draft j of request r (x_{j+1}) is checked against row row_start[r] + j.
    draft_rows = [row_start[r] + j for r, k in enumerate(num_draft_tokens) for j in range(k)]
    n = len(draft_rows)
    kernel = _kernel_takes(target_probs, draft_probs)
    if kernel:  # the scalars through numpy views of the rows: no tensor operations
        u, ids = uniform.tolist(), draft_token_ids.tolist()
        p_x = target_probs.numpy()[draft_rows, ids].tolist()
        q_x = draft_probs.numpy()[range(n), ids].tolist() if draft_probs is not None else [1.0] * n
    else:
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
        p_x, q_x = rest[n : 2 * n], rest[2 * n :] if draft_probs is not None else [1.0] * n

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

    final_rows = [row_start[r] + num_kept[r] for r in range(batch)]
    rejected = [r for r in range(batch) if num_kept[r] < num_draft_tokens[r]]
    # The draft after the kept ones: the residual removes its q.
    reject_idx = [draft_start[r] + num_kept[r] for r in rejected]
    last_rows = [row_start[r] + k for r, k in enumerate(num_draft_tokens)]
    if kernel:  # the recovered or bonus tokens in one call
        which = [-1] * batch
        for r, j in zip(rejected, reject_idx, strict=True):
            which[r] = j
        final_tokens = cpu_sampling.sample_final(
            target_probs,
            final_rows,
            draft_probs,
            which,
            tokens=[ids[j] if j >= 0 else 0 for j in which],
            weights=[float(w) for w in weight],
            uniform=[u[i] for i in last_rows],
        )
    else:
        final_tokens = _final_tokens(
            target_probs,
            draft_token_ids,
            draft_probs,
            final_rows,
            rejected,
            reject_idx,
            weights=[weight[r] for r in rejected],
            uniform=uniform[last_rows],
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
) -> list[list[int]] | None:  # as emitted_tokens; None where the CPU kernel does not apply
    """`emitted_tokens` of softmax(logits / T) rows in one CPU kernel call, with this module's
    arithmetic: one call instead of a dozen operations on caches a forward just emptied."""
    if not _kernel_takes(logits, draft_probs):
        return None
    kept, final = cpu_sampling.verify_sampled(
        logits,
        [1.0 / t for t in temperatures],
        draft_probs,
        draft_token_ids,
        num_draft_tokens,
        uniform,
        block=method == "block",
    )
    out, at = [], 0
    for k, n, token in zip(num_draft_tokens, kept, final, strict=True):
        out.append(draft_token_ids[at : at + n] + [token])
        at += k
    return out


def _kernel_takes(target_probs: torch.Tensor, draft_probs: torch.Tensor | None) -> bool:
    """Whether engine/cpu/csrc/sample.c draws the final tokens (float32 rows in memory)."""
    rows = [t for t in (target_probs, draft_probs) if t is not None]
    return all(kernel_rows(t) and t.is_contiguous() for t in rows)


def _final_tokens(
    target_probs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    final_rows: list[int],  # per request: its row after the kept drafts
    rejected: list[int],  # the requests whose next draft was rejected
    reject_idx: list[int],  # their rejected drafts' indices
    weights: list[np.float32],  # their residuals' weights
    uniform: torch.Tensor,  # per request: the final draw
) -> list[int]:
    """The recovered or bonus token per request, on tensors (any device)."""
    p_final = target_probs[final_rows]  # [batch, vocab]
    if rejected:
        kept_rows = p_final[rejected]
        device = target_probs.device
        if draft_probs is None:
            q_rej = torch.zeros_like(kept_rows)
            q_rej[torch.arange(len(rejected), device=device), draft_token_ids[reject_idx]] = 1.0
        else:
            q_rej = draft_probs[reject_idx]
        w = torch.tensor(weights, dtype=target_probs.dtype, device=device)
        residual = (w[:, None] * kept_rows - q_rej).clamp(min=0)
        # An empty residual has probability 0 in exact arithmetic; guard the division anyway.
        empty = residual.sum(dim=-1, keepdim=True) <= 0
        p_final[rejected] = torch.where(empty, kept_rows, residual)
    return sample_from(p_final, uniform).tolist()


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
                h = w_i  # h_K = w_K
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
    """`rejection_sample` for all-greedy rows (both methods reduce to it): keep drafts while
    they equal their row's argmax, then emit the argmax of the first row that did not match."""
    emitted, row = [], 0
    for drafts in draft_token_ids:
        n = 0
        while n < len(drafts) and drafts[n] == target_argmax[row + n]:
            n += 1
        emitted.append(drafts[:n] + [target_argmax[row + n]])
        row += len(drafts) + 1
    return emitted
