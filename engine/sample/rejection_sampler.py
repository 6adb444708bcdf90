"""Lossless verification of draft tokens.

Target distribution p, draft distribution q, drafts x_1..x_K of one request:
  accept x_i while u_i * q(x_i) <= p(x_i)   (probability min(1, p/q); q(x) = 0 or p(x) = 0 rejects)
  at the first rejection emit a *recovered* token ~ norm(max(0, p - q)) and stop;
  if all K are accepted emit a *bonus* token ~ p_{K+1}.
The emitted sequence is distributed exactly as sampling from the target alone. Greedy rows
arrive with p one-hot at the argmax: acceptance then means "draft == argmax" and both the
recovered and the bonus token are the argmax, i.e. exactly the target's greedy output.
A model-free drafter has no q: it is one-hot on the draft token, so acceptance is p(x) and
the residual is p with x removed.
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
    # [num_rows] u ~ U[0, 1) per row: row j < k of a request tests its draft j, its last row
    # samples the recovered or bonus token (one draw each, independent)
    uniform: torch.Tensor,
) -> torch.Tensor:  # [batch, max_k + 1]: accepted drafts, then recovered or bonus, PAD after
    device = target_probs.device
    batch = len(num_draft_tokens)
    k = torch.tensor(num_draft_tokens, device=device)
    max_k = max(num_draft_tokens, default=0)
    row_start = torch.cumsum(k + 1, 0) - (k + 1)  # [batch]
    draft_start = torch.cumsum(k, 0) - k  # [batch]

    # Draft j of request r is checked against row row_start[r] + j.
    draft_req = torch.repeat_interleave(torch.arange(batch, device=device), k)
    draft_pos = torch.arange(draft_token_ids.numel(), device=device) - draft_start[draft_req]
    draft_rows = row_start[draft_req] + draft_pos
    p_x = target_probs[draft_rows].gather(1, draft_token_ids[:, None])[:, 0]
    if draft_probs is None:
        q_x = torch.ones_like(p_x)
    else:
        q_x = draft_probs.gather(1, draft_token_ids[:, None])[:, 0]
    accepted = (p_x > 0) & (q_x > 0) & (uniform[draft_rows] * q_x <= p_x)

    # Accepted prefix length per request: the run of accepted drafts before the first reject.
    acc = torch.zeros(batch, max_k, dtype=torch.bool, device=device)
    acc[draft_req, draft_pos] = accepted
    num_accepted = acc.to(torch.int64).cumprod(dim=1).sum(dim=1)  # [batch]

    final_rows = row_start + num_accepted
    p_final = target_probs[final_rows]  # [batch, vocab]
    rejected = num_accepted < k
    if bool(rejected.any()):
        # Index of the rejected draft (clamped for requests that accepted everything).
        reject_idx = draft_start + torch.minimum(num_accepted, (k - 1).clamp(min=0))
        reject_idx = reject_idx.clamp(max=max(draft_token_ids.numel() - 1, 0))
        if draft_probs is None:
            q_rej = torch.zeros_like(p_final)
            if draft_token_ids.numel():
                q_rej.scatter_(1, draft_token_ids[reject_idx][:, None], 1.0)
        else:
            q_rej = draft_probs[reject_idx]
        residual = (p_final - q_rej).clamp(min=0)
        # p == q everywhere would have accepted; guard the division anyway.
        empty = residual.sum(dim=-1, keepdim=True) <= 0
        residual = torch.where(empty, p_final, residual)
        p_final = torch.where(rejected[:, None], residual, p_final)
    final_tokens = sample_from(p_final, uniform[row_start + k])  # recovered or bonus

    out = torch.full((batch, max_k + 1), PAD, dtype=torch.long, device=device)
    keep = torch.arange(max_k, device=device)[None, :] < num_accepted[:, None]
    if max_k:
        padded = torch.full((batch, max_k), PAD, dtype=torch.long, device=device)
        padded[draft_req, draft_pos] = draft_token_ids
        out[:, :max_k] = torch.where(keep, padded, PAD)
    out.scatter_(1, num_accepted[:, None], final_tokens[:, None])
    return out


def greedy_verify(
    target_argmax: list[int],  # per verified row, request by request (k + 1 rows each)
    draft_token_ids: list[list[int]],  # per request, its drafts
) -> list[list[int]]:  # per request: accepted drafts, then the recovered or bonus token
    """`rejection_sample` for all-greedy rows without the vocabulary-wide tensors: with p
    one-hot at the argmax, keep drafts while they equal their row's argmax, then emit the
    argmax of the first row that did not match (or of the last row)."""
    emitted, row = [], 0
    for drafts in draft_token_ids:
        n = 0
        while n < len(drafts) and drafts[n] == target_argmax[row + n]:
            n += 1
        emitted.append(drafts[:n] + [target_argmax[row + n]])
        row += len(drafts) + 1
    return emitted
