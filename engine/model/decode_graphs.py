"""Small steps on fixed shapes: padded to a batch and query-length bucket and run from fixed
buffers, captured once per shape as a CUDA graph on CUDA, eager elsewhere. Padding requests
write into the runner's scratch block; only a graph-safe backend can run here."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.attention.paged import (
    AttentionBackend,
    AttentionMetadata,
    Tree,
    cache_slots,
    most_keys,
    tree_lists,
)

logger = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
QUERY_BUCKETS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 48, 64)
"""Query lengths a shape is padded to: exact where chains live (1 + K), coarser for trees."""


@dataclass
class StaticBatch:
    """The buffers of one (bucket, q, tree) shape; the metadata and graph point at them."""

    batch: int
    query_len: int
    # input_ids, positions, slot_mapping, logit rows (, tree bits): batch * q each
    packed64: torch.Tensor
    # context_lens [batch], query_start_loc [batch + 1] (, tree_base [batch])
    packed32: torch.Tensor
    input_ids: torch.Tensor  # [1, batch * q]
    positions: torch.Tensor  # [1, batch * q]
    rows: torch.Tensor  # [batch * q] the logit rows wanted, then zeros
    metadata: AttentionMetadata  # views of the buffers above, block_tables [batch, width]
    hidden: torch.Tensor | None = None  # [1, batch * q, hidden] what the body last wrote
    graph: torch.cuda.CUDAGraph | None = None


class DecodeGraphs:
    def __init__(
        self,
        body: Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor],
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        scratch_block: int,
        max_blocks_per_seq: int,
        max_query_len: int,
        max_batch: int,
        device: torch.device,
        backend: AttentionBackend,
    ) -> None:
        if not backend.graph_safe:
            raise ValueError(f"{type(backend).__name__} metadata cannot be captured in a graph")
        self.backend = backend
        self.body = body  # (input_ids [1, t], positions [1, t], metadata) -> [1, t, hidden]
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.width = max_blocks_per_seq
        self.max_query_len = max_query_len
        self.query_buckets = [b for b in QUERY_BUCKETS if b < max_query_len] + [max_query_len]
        top = next((b for b in BATCH_BUCKETS if b >= max_batch), BATCH_BUCKETS[-1])
        self.buckets = [b for b in BATCH_BUCKETS if b <= top]
        self.device = device
        self.capture = device.type == "cuda"
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.batches: dict[tuple[int, int, bool], StaticBatch] = {}
        self.steps = 0  # forwards that took this path
        self.captures = 0  # a step that captured a graph took far longer than a replay
        if self.capture:
            self._batch(1, 1, False)

    def fits(self, query_lens: list[int], context_lens: list[int]) -> bool:
        """Whether a batch can run here: few enough requests, none feeding more than
        max_query_len tokens (nor none), none longer than the block tables."""
        return (
            0 < len(query_lens) <= self.buckets[-1]
            and 0 < min(query_lens)
            and max(query_lens) <= self.max_query_len
            and max(context_lens) <= self.width * self.block_size
        )

    def run(
        self,
        token_ids: list[int],
        positions: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        logit_rows: list[int],
        query_lens: list[int],
        trees: list[Tree | None] | None = None,
    ) -> torch.Tensor:  # [len(logit_rows), hidden]
        """The body's output at logit_rows for a batch that `fits`; the LM head is the caller's."""
        n, longest = len(context_lens), max(query_lens)
        bucket = next(b for b in self.buckets if b >= n)
        q = next(b for b in self.query_buckets if b >= longest)
        has_tree = trees is not None and any(t is not None for t in trees)
        static = self._batch(bucket, q, has_tree)
        layout = (context_lens, block_tables, query_lens, trees if has_tree else None)
        self._fill(static, token_ids, positions, logit_rows, *layout)
        if static.graph is not None:
            static.graph.replay()
        else:
            static.hidden = self._body(static)
        self.steps += 1
        assert static.hidden is not None
        if len(logit_rows) == len(token_ids):  # every token's row, in order (as in the runner)
            return static.hidden[0, : len(token_ids)]
        return static.hidden[0, static.rows[: len(logit_rows)]]

    def _body(self, static: StaticBatch) -> torch.Tensor:
        return self.body(static.input_ids, static.positions, static.metadata)

    def _batch(self, bucket: int, q: int, tree: bool) -> StaticBatch:
        static = self.batches.get((bucket, q, tree))
        if static is None:
            static = self._new_batch(bucket, q, tree)
            self.batches[(bucket, q, tree)] = static
        return static

    def _new_batch(self, bucket: int, q: int, tree: bool) -> StaticBatch:
        tokens = bucket * q
        device = self.device
        packed64 = torch.zeros((5 if tree else 4) * tokens, dtype=torch.long, device=device)
        packed32 = torch.zeros((3 if tree else 2) * bucket + 1, dtype=torch.int32, device=device)
        ids, positions, slots, rows, *bits = packed64.split(tokens)
        slots.fill_(self.scratch_block * self.block_size)
        context_lens, starts, *bases = packed32.split([bucket, bucket + 1] + [bucket] * tree)
        metadata = AttentionMetadata(
            kv_caches=self.kv_caches,
            slot_mapping=slots,
            backend=self.backend,
            block_tables=torch.zeros(bucket, self.width, dtype=torch.int32, device=device),
            query_start_loc=starts,
            context_lens=context_lens,
            max_query_len=q,
        )
        if tree:  # all zeros: causal, which is what padding and chains get
            metadata.tree, metadata.tree_base = bits[0], bases[0]
        static = StaticBatch(
            batch=bucket,
            query_len=q,
            packed64=packed64,
            packed32=packed32,
            input_ids=ids.view(1, tokens),
            positions=positions.view(1, tokens),
            rows=rows,
            metadata=metadata,
        )
        if self.capture:
            try:
                self._capture(static)
            except RuntimeError as exc:
                raise RuntimeError(
                    f"capturing a CUDA graph ({bucket} requests x {q} tokens"
                    f"{', draft trees' if tree else ''}) failed: {exc}; "
                    "start with --cuda-graphs off to run every step eagerly"
                ) from exc
        return static

    def _capture(self, static: StaticBatch) -> None:
        # Warm up off the graph first (Triton compiles, cuBLAS picks algorithms: neither may
        # happen while capturing); the all-padding batch writes only the scratch block.
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            for _ in range(2):
                self._body(static)
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            static.hidden = self._body(static)
        static.graph = graph
        self.captures += 1
        logger.info(
            "captured a CUDA graph for %d requests x %d tokens%s",
            static.batch,
            static.query_len,
            ", draft trees" if static.metadata.tree is not None else "",
        )

    def _fill(
        self,
        static: StaticBatch,
        token_ids: list[int],
        positions: list[int],
        logit_rows: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        query_lens: list[int],
        trees: list[Tree | None] | None,
    ) -> None:
        """Copy the batch into the static buffers; padding stays padding."""
        n, bucket, tokens = len(context_lens), static.batch, static.batch * static.query_len
        real = len(token_ids)
        pad = tokens - real
        bs = self.block_size
        slots = cache_slots(query_lens, context_lens, block_tables, bs)
        starts = [0, *itertools.accumulate(query_lens)]
        scratch = self.scratch_block * bs
        used = max(-(-ctx // bs) for ctx in context_lens)
        tables = [(table[:used] + [0] * used)[:used] for table in block_tables]
        wide = [*token_ids, *[0] * pad, *positions, *[0] * pad, *slots, *[scratch] * pad]
        wide += [*logit_rows, *[0] * (tokens - len(logit_rows))]
        narrow = [*context_lens, *[0] * (bucket - n), *starts, *[real] * (bucket - n)]
        if trees is not None:
            bits, bases = tree_lists(query_lens, trees)
            wide += bits
            narrow += bases
        for packed, values in ((static.packed64, wide), (static.packed32, narrow)):
            packed[: len(values)].copy_(torch.tensor(values, dtype=packed.dtype), non_blocking=True)
        md = static.metadata
        md.max_keys = most_keys(query_lens, context_lens, trees)
        assert md.block_tables is not None
        # Rows past n and columns past `used` keep stale ids: no query reads them.
        md.block_tables[:n, :used].copy_(torch.tensor(tables, dtype=torch.int32), non_blocking=True)
