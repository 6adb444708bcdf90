"""How ModelRunner.forward runs a packed batch: routes tried in order, the first that takes
the batch runs it. Each returns the head's float32 logits [len(logit_index), head columns] and
leaves the body's output in `runner.last_hidden`: every fed token's row, or only the logit rows
where a decode graph ran (`hidden_rows` keeps graphs off when a proposer needs every row)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from engine.attention import paged as attention
from engine.model.native.lists import forward_lists, lists_take

if TYPE_CHECKING:
    from engine.model.inputs import SeqInput
    from engine.model.runner import ModelRunner


@dataclass(frozen=True)
class PackedBatch:
    """The requests of one pass, packed: tokens and positions back to back."""

    token_ids: list[int]
    positions: list[int]
    query_lens: list[int]
    context_lens: list[int]
    tables: list[list[int]]
    logit_index: list[int]
    """Rows of token_ids whose next-token logits are wanted, in order."""
    trees: list[attention.Tree | None] | None
    """Per request its attention tree (None: a chain); None when every request is a chain."""

    @classmethod
    def pack(cls, seqs: list[SeqInput]) -> PackedBatch:
        packer = Packer()
        for seq in seqs:
            packer.add(
                seq.token_ids, seq.start_pos, seq.block_table, seq.logit_offsets, seq.positions
            )
        trees = [s.attention_tree() for s in seqs] if any(s.tree for s in seqs) else None
        return packer.build(trees)

    @property
    def every_row(self) -> bool:
        """One logit row per fed token (a decode, a verification)."""
        return len(self.logit_index) == len(self.token_ids)


class Packer:
    """A PackedBatch built one sequence at a time, as `PackedBatch.pack` packs SeqInputs (a
    step's chains are added straight from its requests, no SeqInput each)."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.positions: list[int] = []
        self.query_lens: list[int] = []
        self.context_lens: list[int] = []
        self.tables: list[list[int]] = []
        self.logit_index: list[int] = []

    def add(
        self,
        token_ids: list[int],
        start: int,
        table: list[int],
        logit_offsets: Sequence[int],
        positions: list[int] | None = None,  # None: a chain from `start`
    ) -> None:
        n, q = len(self.token_ids), len(token_ids)
        self.logit_index += [n + off for off in logit_offsets]
        self.token_ids += token_ids
        self.positions += positions or range(start, start + q)
        self.query_lens.append(q)
        self.context_lens.append(start + q)
        self.tables.append(table)

    def build(self, trees: list[attention.Tree | None] | None = None) -> PackedBatch:
        return PackedBatch(
            self.token_ids,
            self.positions,
            self.query_lens,
            self.context_lens,
            self.tables,
            self.logit_index,
            trees,
        )


class Route(Protocol):
    name: str

    def takes(self, runner: ModelRunner, batch: PackedBatch) -> bool: ...

    def run(self, runner: ModelRunner, batch: PackedBatch) -> torch.Tensor: ...


class DecodeGraphRoute:
    """Small batches replayed on fixed shapes (engine/model/decode_graphs.py)."""

    name = "decode-graphs"

    def takes(self, runner: ModelRunner, batch: PackedBatch) -> bool:
        graphs = runner.decode_graphs
        all_rows = not runner.hidden_rows or batch.every_row
        return graphs is not None and all_rows and graphs.fits(batch.query_lens, batch.context_lens)

    def run(self, runner: ModelRunner, batch: PackedBatch) -> torch.Tensor:
        assert runner.decode_graphs is not None
        hidden = runner.last_hidden = runner.decode_graphs.run(
            batch.token_ids,
            batch.positions,
            batch.context_lens,
            batch.tables,
            batch.logit_index,
            batch.query_lens,
            batch.trees,
        )
        return runner.graph_head(hidden).float()


class LayerStackRoute:
    """The C layer stack in one call, from the lists (engine/model/native/lists.py)."""

    name = "layer-stack"

    def takes(self, runner: ModelRunner, batch: PackedBatch) -> bool:
        return lists_take(runner, batch.query_lens, batch.trees)

    def run(self, runner: ModelRunner, batch: PackedBatch) -> torch.Tensor:
        return forward_lists(
            runner,
            batch.token_ids,
            batch.positions,
            batch.query_lens,
            batch.context_lens,
            batch.tables,
            batch.logit_index,
        )


def _metadata(runner: ModelRunner, batch: PackedBatch) -> attention.AttentionMetadata:
    return attention.build_metadata(
        runner.kv_caches,
        runner.block_size,
        batch.query_lens,
        batch.context_lens,
        batch.tables,
        runner.device,
        runner.attention_backend,
        batch.trees,
    )


class NativeRoute:
    """engine/model/native/'s forward, eager, on the attention backend's metadata."""

    name = "native"

    def takes(self, runner: ModelRunner, batch: PackedBatch) -> bool:
        return runner.native is not None

    def run(self, runner: ModelRunner, batch: PackedBatch) -> torch.Tensor:
        native = runner.native
        assert native is not None
        input_ids = torch.tensor(batch.token_ids, device=runner.device)
        positions = torch.tensor(batch.positions, device=runner.device)
        hidden = runner.last_hidden = native(input_ids, positions, _metadata(runner, batch))
        if not batch.every_row:
            rows = torch.tensor(batch.logit_index, dtype=torch.long, device=runner.device)
            hidden = hidden.index_select(0, rows)
        return native.logits(hidden).float()


class TransformersRoute:
    """The Hugging Face model's own forward (the paged attention plugged into it)."""

    name = "transformers"

    def takes(self, runner: ModelRunner, batch: PackedBatch) -> bool:
        return True

    def run(self, runner: ModelRunner, batch: PackedBatch) -> torch.Tensor:
        input_ids = torch.tensor(batch.token_ids, device=runner.device)
        positions = torch.tensor(batch.positions, device=runner.device)
        rows = torch.tensor(batch.logit_index, dtype=torch.long, device=runner.device)
        runner.last_hidden = None
        return runner.hf_logits(input_ids, positions, _metadata(runner, batch), rows).float()


ROUTES: tuple[Route, ...] = (
    DecodeGraphRoute(),
    LayerStackRoute(),
    NativeRoute(),
    TransformersRoute(),
)
"""In order of preference; the last takes every batch."""
