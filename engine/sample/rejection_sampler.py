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
token ~ norm(max(0, w_tau p_tau - q_tau)), or the bonus ~ p_K when tau = K. A draft that token
verification would reject can still be kept when the drafts after it make up for it; the
emitted text is distributed exactly as the target's (docs/VERIFICATION.md has the argument,
tests/test_rejection_sampler.py checks it exactly on small vocabularies) and the expected
number of kept drafts is never lower than token verification's. Same target pass, same
draws; the extra work is one vocabulary-wide residual per draft.

Greedy rows arrive with p one-hot at the argmax: both rules then keep drafts while they equal
the argmax and emit the argmax, i.e. exactly the target's greedy output (so do seeded rows,
one-hot at their coupled sample: engine/sample/sampler.py). A model-free drafter has no q:
it is one-hot on the draft token, so acceptance is p(x) and the residual is p with x removed.
"""

from __future__ import annotations

import torch

from engine.sample.sampler import sample_from

PAD = -1


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
    device = target_probs.device
    batch = len(num_draft_tokens)
    k = torch.tensor(num_draft_tokens, device=device)
    max_k = max(num_draft_tokens, default=0)
    row_start = torch.cumsum(k + 1, 0) - (k + 1)  # [batch]
    draft_start = torch.cumsum(k, 0) - k  # [batch]

    # Draft j of request r (x_{j+1}) is checked against row row_start[r] + j.
    draft_req = torch.repeat_interleave(torch.arange(batch, device=device), k)
    draft_pos = torch.arange(draft_token_ids.numel(), device=device) - draft_start[draft_req]
    draft_rows = row_start[draft_req] + draft_pos
    p_x = target_probs[draft_rows, draft_token_ids]
    if draft_probs is None:
        q_x = torch.ones_like(p_x)
    else:
        q_x = draft_probs.gather(1, draft_token_ids[:, None])[:, 0]

    if method == "block":
        num_kept, weight = _block_lengths(
            target_probs,
            draft_probs,
            p_x,
            q_x,
            (k, draft_req, draft_pos, draft_rows),
            uniform,
        )
    else:
        accepted = (p_x > 0) & (q_x > 0) & (uniform[draft_rows] * q_x <= p_x)
        # Kept prefix length per request: the run of accepted drafts before the first reject.
        acc = torch.zeros(batch, max_k, dtype=torch.bool, device=device)
        acc[draft_req, draft_pos] = accepted
        num_kept = acc.to(torch.int64).cumprod(dim=1).sum(dim=1)  # [batch]
        weight = torch.ones(batch, dtype=target_probs.dtype, device=device)

    final_rows = row_start + num_kept
    p_final = target_probs[final_rows]  # [batch, vocab]
    rejected = num_kept < k
    if bool(rejected.any()):
        # The draft after the kept ones, whose q the residual removes (clamped for requests
        # that kept everything; those keep p_final).
        reject_idx = draft_start + torch.minimum(num_kept, (k - 1).clamp(min=0))
        reject_idx = reject_idx.clamp(max=max(draft_token_ids.numel() - 1, 0))
        if draft_probs is None:
            q_rej = torch.zeros_like(p_final)
            if draft_token_ids.numel():
                q_rej.scatter_(1, draft_token_ids[reject_idx][:, None], 1.0)
        else:
            q_rej = draft_probs[reject_idx]
        residual = (weight[:, None] * p_final - q_rej).clamp(min=0)
        # An empty residual has probability 0 in exact arithmetic; guard the division anyway.
        empty = residual.sum(dim=-1, keepdim=True) <= 0
        residual = torch.where(empty, p_final, residual)
        p_final = torch.where(rejected[:, None], residual, p_final)
    final_tokens = sample_from(p_final, uniform[row_start + k])  # recovered or bonus

    out = torch.full((batch, max_k + 1), PAD, dtype=torch.long, device=device)
    keep = torch.arange(max_k, device=device)[None, :] < num_kept[:, None]
    if max_k:
        padded = torch.full((batch, max_k), PAD, dtype=torch.long, device=device)
        padded[draft_req, draft_pos] = draft_token_ids
        out[:, :max_k] = torch.where(keep, padded, PAD)
    out.scatter_(1, num_kept[:, None], final_tokens[:, None])
    return out


def _block_lengths(
    target_probs: torch.Tensor,  # [num_rows, vocab]
    draft_probs: torch.Tensor | None,  # [num_draft, vocab] or None (one-hot)
    p_x: torch.Tensor,  # [num_draft] p_{j}(x_{j+1})
    q_x: torch.Tensor,  # [num_draft] q_{j}(x_{j+1})
    # k, draft_req, draft_pos, draft_rows as rejection_sample lays them out
    layout: tuple[torch.Tensor, ...],
    uniform: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:  # [batch] tau, [batch] w_tau
    k, draft_req, draft_pos, draft_rows = layout
    batch, max_k = k.numel(), int(k.max()) if k.numel() else 0
    dtype, device = target_probs.dtype, target_probs.device
    ratio = torch.zeros(batch, max_k, dtype=dtype, device=device)
    ratio[draft_req, draft_pos] = torch.where(q_x > 0, p_x / q_x.clamp(min=1e-30), 0.0)
    # w[:, i] = w_i; a running product clamped at 1 (K is small: a loop over it).
    w = torch.ones(batch, max_k + 1, dtype=dtype, device=device)
    for i in range(1, max_k + 1):
        w[:, i] = torch.clamp(w[:, i - 1] * ratio[:, i - 1], max=1.0)
    if max_k == 0:
        return torch.zeros(batch, dtype=torch.long, device=device), w[:, 0]

    # h_i for every draft that is not its request's last (i = its position + 1 < K): the
    # vocabulary-wide residual r_i needs row i of the target and q_i.
    w_i = w[draft_req, draft_pos + 1]
    inner = ((draft_pos + 1 < k[draft_req]) & (w_i > 0)).nonzero()[:, 0]
    h = torch.zeros_like(w_i)
    if inner.numel():
        wi = w_i[inner]
        nxt = inner + 1  # the next draft, x_{i+1}: its row is row i, its q is q_i
        if draft_probs is None:  # q_i one-hot at x_{i+1}: r_i = w_i (1 - p_i(x_{i+1}))
            r = wi * (1 - p_x[nxt])
        else:
            r = (wi[:, None] * target_probs[draft_rows[nxt]]).sub_(draft_probs[nxt])
            r = r.clamp_(min=0).sum(dim=-1)
        denom = r + 1 - wi
        h[inner] = torch.where(denom > 0, r / denom.clamp(min=1e-30), 0.0)
    is_last = draft_pos + 1 == k[draft_req]
    h = torch.where(is_last, w_i, h)  # h_K = w_K
    kept = uniform[draft_rows] < h
    # tau: the largest i whose test passed (0 if none).
    depth = torch.zeros(batch, max_k, dtype=torch.long, device=device)
    depth[draft_req, draft_pos] = torch.where(kept, draft_pos + 1, 0)
    tau = depth.max(dim=1).values
    return tau, w.gather(1, tau[:, None])[:, 0]


def greedy_verify(
    target_argmax: list[int],  # per verified row, request by request (k + 1 rows each)
    draft_token_ids: list[list[int]],  # per request, its drafts
) -> list[list[int]]:  # per request: accepted drafts, then the recovered or bonus token
    """`rejection_sample` for all-greedy rows without the vocabulary-wide tensors: with p
    one-hot at the argmax, keep drafts while they equal their row's argmax, then emit the
    argmax of the first row that did not match (or of the last row). Both verification
    methods reduce to this on one-hot rows."""
    emitted, row = [], 0
    for drafts in draft_token_ids:
        n = 0
        while n < len(drafts) and drafts[n] == target_argmax[row + n]:
            n += 1
        emitted.append(drafts[:n] + [target_argmax[row + n]])
        row += len(drafts) + 1
    return emitted
