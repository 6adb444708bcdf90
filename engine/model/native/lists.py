"""A CPU pass built straight from the runner's lists for batches the C layer stack takes whole
(no tree, at most `STACK_MAX_QUERY` tokens a request): the metadata path's bits, less work."""

from __future__ import annotations

from itertools import accumulate
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.attention.backends import BACKENDS
from engine.attention.cpu import STACK_MAX_QUERY, kernel_tables
from engine.attention.paged import cache_slots
from engine.cpu import kernels as cpu_kernels

if TYPE_CHECKING:
    from engine.model.runner import ModelRunner


def lists_take(runner: ModelRunner, query_lens: list[int], trees: list | None) -> bool:
    """Whether the C stack takes this batch whole from the lists (`runner.lists_path` off:
    never, to compare)."""
    return bool(
        runner.lists_path
        and getattr(runner.native, "one_call", False)
        and runner.attention_backend is BACKENDS["cpu"]
        and trees is None
        and query_lens
        and max(query_lens) <= STACK_MAX_QUERY
    )


def forward_lists(
    runner: ModelRunner,
    token_ids: list[int],
    positions: list[int],
    query_lens: list[int],
    context_lens: list[int],
    tables: list[list[int]],
    logit_index: list[int],
) -> torch.Tensor:  # [len(logit_index), the head's columns] float32
    """The logits `runner.forward` returns (before widening), for a batch `lists_take`s."""
    native = runner.native
    assert native is not None
    stack = native.layer_stack(runner.kv_caches)  # the pass's constants, kept
    bs = stack.block_size
    slots = cache_slots(query_lens, context_lens, tables, bs)
    rows = kernel_tables(tables, context_lens, bs)
    width, n, seqs = len(rows[0]), len(token_ids), len(query_lens)
    starts = list(accumulate(query_lens[:-1], initial=0))
    padded = [block for row in rows for block in row]
    # positions [n], slots [n], per request its start, length and context, then the tables
    ints = np.array(positions + slots + starts + query_lens + context_lens + padded, np.int64)
    at = ints.ctypes.data
    batch = cpu_kernels.Batch(
        positions=at,
        slots=at + 8 * n,
        cos=stack.cos,
        sin=stack.sin,
        tables=at + 8 * (2 * n + 3 * seqs),
        width=width,
        q_starts=at + 8 * 2 * n,
        q_lens=at + 8 * (2 * n + seqs),
        ctx_lens=at + 8 * (2 * n + 2 * seqs),
        num_seqs=seqs,
        block_size=bs,
        tree=None,
        tree_base=None,
        kv_type=stack.kv_type,
    )
    if stack.embed_rows is not None:  # a plain lookup: the rows, copied
        hidden = torch.from_numpy(stack.embed_rows[token_ids])
    else:  # an input layer of its own (a feature draft's: engine/spec/proposers/eagle.py)
        hidden = native.embed_tokens(torch.tensor(token_ids)).contiguous()
    runner.last_hidden = hidden
    if len(logit_index) == n:  # every row's logits: the final norm and the head in the call
        return native.run_stack(hidden, batch, stack, with_logits=True)
    native.run_stack(hidden, batch, stack)
    return native.logits(hidden[logit_index]).float()
