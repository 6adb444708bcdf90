"""A fixed set of KV blocks with reference counts, a free queue and a prefix-hash map. The free
queue hands out unhashed blocks first, so rejected-draft churn never evicts a cached prefix."""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block (got {num_blocks})")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[bytes, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take n free blocks (ref_cnt 1), evicting their cached hashes."""
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} blocks, {len(self._free)} free")
        blocks = []
        for _ in range(n):
            block, _ = self._free.popitem(last=False)
            self._evict(block)
            self.ref_cnt[block] = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: Iterable[int]) -> None:
        """Add a reference to blocks found in the prefix cache (possibly free ones)."""
        for block in blocks:
            if self.ref_cnt[block] == 0:
                del self._free[block]
            self.ref_cnt[block] += 1

    def release(self, blocks: Iterable[int]) -> None:
        """Drop one reference from each block; unreferenced blocks return to the free queue."""
        for block in blocks:
            if self.ref_cnt[block] <= 0:
                raise RuntimeError(f"block {block} released more often than referenced")
            self.ref_cnt[block] -= 1
            if self.ref_cnt[block] == 0:
                self._free[block] = None
                if self.block_hash[block] is None:  # nothing to keep: reuse it first
                    self._free.move_to_end(block, last=False)

    def cache(self, block: int, block_hash: bytes) -> None:
        """Register a full block of verified tokens under its content-chain hash."""
        if self.block_hash[block] is not None:
            return
        if block_hash in self._cached:
            return  # an identical block is already cached; keep that one findable
        self.block_hash[block] = block_hash
        self._cached[block_hash] = block

    def lookup(self, block_hash: bytes) -> int | None:
        return self._cached.get(block_hash)

    def _evict(self, block: int) -> None:
        block_hash = self.block_hash[block]
        if block_hash is not None:
            del self._cached[block_hash]
            self.block_hash[block] = None

    def check_invariants(self, block_tables: Iterable[list[int]]) -> None:
        """Raise AssertionError unless every block is free xor referenced, ref_cnt equals the
        number of tables holding it, and the hash map agrees with the per-block hashes."""
        held = Counter(block for table in block_tables for block in table)
        for block in range(self.num_blocks):
            refs = self.ref_cnt[block]
            assert refs == held.get(block, 0), (
                f"block {block}: ref_cnt {refs} but held by {held.get(block, 0)} tables"
            )
            assert (refs == 0) == (block in self._free), (
                f"block {block}: ref_cnt {refs} but free={block in self._free}"
            )
        assert len(self._free) == sum(1 for r in self.ref_cnt if r == 0)
        for block_hash, block in self._cached.items():
            assert self.block_hash[block] == block_hash, f"block {block}: hash map out of sync"
        assert sum(h is not None for h in self.block_hash) == len(self._cached)
