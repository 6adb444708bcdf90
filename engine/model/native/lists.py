"""A CPU pass built straight from the runner's lists, for batches the C layer stack takes whole.

`ModelRunner.forward` normally turns a batch into an AttentionMetadata (a slot tensor, the
attention kernel's tables and lengths, each its own tensor) and runs the native forward's
embedding operator on an id tensor. When every request is one the C attention kernel takes
(at most `MAX_KERNEL_QUERY` tokens, no draft tree) and the native forward runs its layers in
one C call (`LlamaForward.run_stack`), none of that is needed: here the batch's integers
(positions, cache slots, query starts and lengths, context lengths, block tables) go into one
numpy array that the C batch points into, and a plain embedding's rows are copied by numpy
indexing (an input layer of another kind runs as a module). When every row is a logit row (a
decode, a verification), the final norm and the LM head run in the same C call. The kernels
and their inputs are the same, so the numbers are the same bits (tests/test_native_models.py
compares the paths).

Why: right after a pass has streamed the weights through the caches, the host code before the
next pass costs by the operations it runs, each one's code and data coming from memory again.
On the default pair at concurrency 1 (2-core AMD EPYC, 2026-11-28; passes over 150 cached
tokens, the two paths alternating pass by pass, 1,480 each, medians of two runs), a one-token
target pass took 7.29-7.43 ms against 7.58-7.91 on the metadata path, and a draft pass
0.73-0.78 ms against 0.87-0.92 (docs/BENCHMARKS.md, "A c=1 step's host code").
"""

from __future__ import annotations

from itertools import accumulate
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.attention.backends import BACKENDS
from engine.attention.cpu import MAX_KERNEL_QUERY, kernel_tables
from engine.attention.paged import cache_slots
from engine.cpu import kernels as cpu_kernels

if TYPE_CHECKING:
    from engine.model.runner import ModelRunner


def forward_lists(
    runner: ModelRunner,
    token_ids: list[int],
    positions: list[int],
    query_lens: list[int],
    context_lens: list[int],
    tables: list[list[int]],
    logit_index: list[int],
    trees: list | None,
) -> torch.Tensor | None:  # [len(logit_index), the head's columns] float32, or None
    """The logits `runner.forward` returns (before widening), where this path applies;
    None where the runner must build the metadata instead."""
    native = runner.native
    if not (
        runner.lists_path
        and getattr(native, "one_call", False)
        and runner.attention_backend is BACKENDS["cpu"]
        and trees is None
        and query_lens
        and max(query_lens) <= MAX_KERNEL_QUERY
    ):
        return None
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
        at, at + 8 * n, stack.cos, stack.sin, at + 8 * (2 * n + 3 * seqs), width,
        at + 8 * 2 * n, at + 8 * (2 * n + seqs), at + 8 * (2 * n + 2 * seqs),
        seqs, bs, None, None, stack.kv_type,
    )  # fmt: skip
    if stack.embed_rows is not None:  # a plain lookup: the rows, copied
        hidden = torch.from_numpy(stack.embed_rows[token_ids])
    else:  # an input layer of its own (a feature draft's: engine/spec/proposers/eagle.py)
        hidden = native.embed_tokens(torch.tensor(token_ids)).contiguous()
    runner.last_hidden = hidden
    if len(logit_index) == n:  # every row's logits: the final norm and the head in the call
        return native.run_stack(hidden, batch, stack, with_logits=True)
    native.run_stack(hidden, batch, stack)
    return native.logits(hidden[logit_index]).float()
