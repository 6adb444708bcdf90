"""The sampling kernels of engine/cpu/csrc/sample.c, wrapped: each draws by inverse CDF with
float64 block sums (engine/sample/sampler.py `sample_from` compares it with torch's path)."""

from __future__ import annotations

import ctypes

import torch

from engine.cpu import kernels as cpu_kernels


def sample_rows(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """probs [rows, vocab], uniform [rows] -> [rows] int64, as `sampler.sample_from` draws."""
    return _sample("tandem_sample_rows", probs, uniform)


def sample_logits(
    logits: torch.Tensor, inv_temperature: list[float], uniform: torch.Tensor
) -> torch.Tensor:
    """`sample_rows` of softmax(logits * inv_t); vocab for a row without finite mass."""
    inverse = (ctypes.c_float * len(inv_temperature))(*inv_temperature)  # no tensor: cheaper
    return _sample("tandem_sample_logits", logits, uniform, ctypes.addressof(inverse))


def sample_head(
    logits: torch.Tensor,  # [rows, n] float32: the draft's logits for the head's n tokens
    inv_temperature: list[float],  # per row (> 0)
    head: torch.Tensor,  # [n] int64, increasing token ids
    uniform: torch.Tensor,  # [rows] U[0, 1)
    vocab: int,
) -> tuple[list[int], torch.Tensor]:  # per row its token; q [rows, vocab]
    """Draft tokens drawn from softmax(logits * inv_t) over a restricted head, and q, that
    distribution on the whole vocabulary (0 off the head); vocab for a row without mass."""
    logits, uniform = logits.contiguous(), uniform.to(torch.float64).contiguous()
    rows, n = logits.shape
    q = torch.empty(rows, vocab, dtype=torch.float32)
    scratch = torch.empty(rows, n, dtype=torch.float32)
    out = (ctypes.c_int64 * rows)()
    inverse = (ctypes.c_float * rows)(*inv_temperature)
    cpu_kernels.require().tandem_sample_head(
        logits.data_ptr(),
        inverse,
        head.data_ptr(),
        uniform.data_ptr(),
        rows,
        n,
        vocab,
        q.data_ptr(),
        scratch.data_ptr(),
        out,
        torch.get_num_threads(),
    )
    return list(out), q


def race_rows(logits: torch.Tensor, temperatures: list[float], keys: list[int]) -> list[int]:
    """Each row's coupled race token of logits [rows, vocab] / its temperature under its key
    (`sampler.coupled_winner`); -1 for a row with a NaN or no finite weight."""
    logits = logits.contiguous()
    rows, vocab = logits.shape
    out = (ctypes.c_int64 * rows)()
    cpu_kernels.require().tandem_race_rows(
        logits.data_ptr(),
        (ctypes.c_float * rows)(*temperatures),
        (ctypes.c_uint64 * rows)(*keys),
        rows,
        vocab,
        out,
        torch.get_num_threads(),
    )
    return list(out)


def _sample(name: str, rows_in: torch.Tensor, uniform: torch.Tensor, *per_row: int) -> torch.Tensor:
    rows_in, uniform = rows_in.contiguous(), uniform.to(torch.float64).contiguous()
    rows, vocab = rows_in.shape
    out = torch.empty(rows, dtype=torch.int64)
    if rows:
        getattr(cpu_kernels.require(), name)(
            rows_in.data_ptr(),
            *per_row,
            uniform.data_ptr(),
            rows,
            vocab,
            out.data_ptr(),
            torch.get_num_threads(),
        )
    return out


def sample_final(
    probs: torch.Tensor,  # [num_rows, vocab] float32, contiguous: the target's p per row
    rows: list[int],  # per request: its row of probs (after its kept drafts)
    draft_probs: torch.Tensor | None,  # [num_draft, vocab] float32, contiguous; None: one-hot
    rejected: list[int],  # per request: the rejected draft's index (into draft_probs), or -1
    tokens: list[int],  # per request: the rejected draft token (one-hot q), or anything
    weights: list[float],  # per request: the residual's weight w (1 for token verification)
    uniform: list[float],  # per request: its draw in [0, 1)
) -> list[int]:
    """`SamplingBackend.final_tokens` (engine/sample/backends.py); vocab for a row without mass."""
    n, vocab = len(rows), probs.shape[1]
    arrays = [(ctypes.c_int64 * n)(*v) for v in (rows, rejected, tokens)]
    w, u = (ctypes.c_float * n)(*weights), (ctypes.c_double * n)(*uniform)
    out = (ctypes.c_int64 * n)()
    q = draft_probs.data_ptr() if draft_probs is not None else None
    cpu_kernels.require().tandem_sample_final(
        probs.data_ptr(),
        arrays[0],
        q,
        arrays[1],
        arrays[2],
        w,
        u,
        n,
        vocab,
        out,
        torch.get_num_threads(),
    )
    return list(out)


def verify_sampled(
    logits: torch.Tensor,  # [rows, vocab] float32: request i's num_drafts[i] + 1 rows, in order
    inv_temperature: list[float],  # per request
    draft_probs: torch.Tensor | None,  # [num_draft, vocab] float32, contiguous; None: one-hot
    draft_ids: list[int],  # the drafts, request by request
    num_drafts: list[int],  # per request
    uniform: torch.Tensor,  # [rows] float64: one draw per row
    block: bool,  # block verification (else token by token)
) -> tuple[list[int], list[int]]:  # per request: drafts kept, the final token
    """`rejection_sampler.emitted_tokens` of the softmax rows, in one kernel call."""
    logits, uniform = logits.contiguous(), uniform.to(torch.float64).contiguous()
    batch, vocab = len(num_drafts), logits.shape[1]
    probs = torch.empty_like(logits)
    ids = (ctypes.c_int64 * max(len(draft_ids), 1))(*draft_ids)
    counts = (ctypes.c_int64 * batch)(*num_drafts)
    inverse = (ctypes.c_float * batch)(*inv_temperature)
    kept, out = (ctypes.c_int64 * batch)(), (ctypes.c_int64 * batch)()
    q = draft_probs.data_ptr() if draft_probs is not None else None
    cpu_kernels.require().tandem_verify_sampled(
        logits.data_ptr(),
        inverse,
        probs.data_ptr(),
        q,
        ids,
        counts,
        uniform.data_ptr(),
        int(block),
        batch,
        vocab,
        kept,
        out,
        torch.get_num_threads(),
    )
    return list(kept), list(out)
