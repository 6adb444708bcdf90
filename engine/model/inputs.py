"""What one request feeds a forward pass (engine/model/runner.py ModelRunner.forward)."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.attention.paged import Tree


@dataclass
class SeqInput:
    token_ids: list[int]
    start_pos: int
    """Cache slot (and, in a chain, position) of token_ids[0]; earlier keys are cached."""
    block_table: list[int]
    logit_offsets: list[int] = field(default_factory=list)
    """Indices into token_ids whose next-token logits are wanted."""
    tree: list[int] | None = None
    """Per token, the bitmask of slots from `tree_base` it sees (paged.py `Tree`); None: a chain."""
    tree_base: int | None = None
    """The slot of bit 0 of `tree` (None = start_pos); every node sees earlier slots."""
    positions: list[int] | None = None
    """Each token's position; None = start_pos + index (a chain)."""

    @property
    def context_len(self) -> int:
        return self.start_pos + len(self.token_ids)

    def attention_tree(self) -> Tree | None:
        if self.tree is None:
            return None
        return Tree(self.start_pos if self.tree_base is None else self.tree_base, self.tree)
