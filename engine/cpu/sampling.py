"""The sampling kernels of engine/cpu/csrc/sample.c, wrapped (the library is the one
engine/cpu/kernels.py loads). Each draws tokens by inverse CDF with float64 block sums; how
that relates to torch's path is in engine/sample/sampler.py `sample_from`."""

from __future__ import annotations

import ctypes

import torch

from engine.cpu import kernels as cpu_kernels


def sample_rows(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """probs [rows, vocab] float32 (non-negative mass), uniform [rows] float64 in [0, 1) ->
    [rows] int64: per row, the first token whose cumulative mass exceeds u times the row's
    total."""
    return _sample("tandem_sample_rows", probs, uniform)


def sample_logits(
    logits: torch.Tensor, inv_temperature: list[float], uniform: torch.Tensor
) -> torch.Tensor:
    """logits [rows, vocab] float32, inv_temperature per row (> 0), uniform [rows] in [0, 1) ->
    [rows] int64: a token per row drawn from softmax(logits * inv_t) as `sample_rows` draws,
    the softmax not written out; vocab for a row without finite mass."""
    inverse = (ctypes.c_float * len(inv_temperature))(*inv_temperature)  # no tensor: cheaper
    return _sample("tandem_sample_logits", logits, uniform, ctypes.addressof(inverse))


def _sample(name: str, rows_in: torch.Tensor, uniform: torch.Tensor, *per_row: int) -> torch.Tensor:
    rows_in, uniform = rows_in.contiguous(), uniform.to(torch.float64).contiguous()
    rows, vocab = rows_in.shape
    out = torch.empty(rows, dtype=torch.int64)
    if rows:
        getattr(cpu_kernels.require(), name)(
            rows_in.data_ptr(), *per_row, uniform.data_ptr(), rows, vocab, out.data_ptr(),
            torch.get_num_threads(),
        )  # fmt: skip
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
    """The token ending each request's verified drafts, in one call: drawn from its row p
    (the bonus, rejected -1), or from the residual max(0, w p - q) of its rejected draft, or
    from p where that residual has no mass, with the values torch's formulas give them; vocab
    for a row without mass. As `sample_rows` draws (csrc/sample.c)."""
    n, vocab = len(rows), probs.shape[1]
    arrays = [(ctypes.c_int64 * n)(*v) for v in (rows, rejected, tokens)]
    w, u = (ctypes.c_float * n)(*weights), (ctypes.c_double * n)(*uniform)
    out = (ctypes.c_int64 * n)()
    q = draft_probs.data_ptr() if draft_probs is not None else None
    cpu_kernels.require().tandem_sample_final(
        probs.data_ptr(), arrays[0], q, arrays[1], arrays[2], w, u, n, vocab, out,
        torch.get_num_threads(),
    )  # fmt: skip
    return list(out)
