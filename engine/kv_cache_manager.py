"""Request -> block table. Ref counts stay inside; callers see block ids and integers.

Prefix caching: a full block of *verified* tokens is hashed by its content chain
(hash of the previous block's hash and this block's tokens) and registered in the pool. A new
request walks its prompt block by block and shares every block whose chain hash is cached.
Draft tokens are never hashed: only the first `num_cacheable` tokens a caller passes in are.
"""

from __future__ import annotations

import hashlib
from array import array

from engine.block_pool import BlockPool
from engine.request import Request


def _chain_hash(parent: bytes, tokens: list[int]) -> bytes:
    return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, block_size)
        self.enable_prefix_caching = enable_prefix_caching
        self.block_tables: dict[str, list[int]] = {}
        self._hashes: dict[str, list[bytes]] = {}
        """Chain hashes of each request's leading full verified blocks, in order."""

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_table(self, request_id: str) -> list[int]:
        return self.block_tables.get(request_id, [])

    def match_prefix(self, req: Request) -> int:
        """Share cached blocks of req's prompt; return the number of tokens they cover.

        At least one prompt token is always left to compute, so the step that admits the
        request produces logits for its next token.
        """
        if not self.enable_prefix_caching or req.params.prompt_logprobs is not None:
            return 0
        tokens = req.all_token_ids
        max_blocks = (len(tokens) - 1) // self.block_size
        hashes: list[bytes] = []
        blocks: list[int] = []
        parent = b""
        for i in range(max_blocks):
            parent = _chain_hash(parent, tokens[i * self.block_size : (i + 1) * self.block_size])
            block = self.pool.lookup(parent)
            if block is None:
                break
            hashes.append(parent)
            blocks.append(block)
        if not blocks:
            return 0
        self.pool.touch(blocks)
        self.block_tables[req.request_id] = blocks
        self._hashes[req.request_id] = hashes
        return len(blocks) * self.block_size

    def can_allocate(self, req: Request, num_tokens: int) -> bool:
        return self._missing_blocks(req, num_tokens) <= self.pool.num_free

    def allocate_slots(self, req: Request, num_new_tokens: int, num_lookahead: int = 0) -> bool:
        """Make room for num_new_tokens (+ num_lookahead draft tokens) after the computed ones.

        Returns False (and changes nothing) when the pool has too few free blocks.
        """
        total = req.num_computed_tokens + num_new_tokens + num_lookahead
        missing = self._missing_blocks(req, total)
        if missing > self.pool.num_free:
            return False
        if missing > 0:
            table = self.block_tables.setdefault(req.request_id, [])
            table.extend(self.pool.allocate(missing))
        return True

    def trim(self, req: Request, num_keep_tokens: int) -> int:
        """Release the blocks past the first num_keep_tokens tokens; return how many.

        After verification these blocks hold only rejected draft tokens.
        """
        table = self.block_tables.get(req.request_id)
        if not table:
            return 0
        keep = self.blocks_needed(num_keep_tokens)
        dropped = table[keep:]
        if dropped:
            del table[keep:]
            self.pool.release(reversed(dropped))
        return len(dropped)

    def cache_verified(self, req: Request, num_cacheable: int) -> None:
        """Hash the full blocks among the first num_cacheable (verified) tokens."""
        if not self.enable_prefix_caching or req.request_id not in self.block_tables:
            return
        table = self.block_tables[req.request_id]
        hashes = self._hashes.setdefault(req.request_id, [])
        num_full = min(num_cacheable // self.block_size, len(table))
        if len(hashes) >= num_full:
            return
        tokens = req.all_token_ids
        parent = hashes[-1] if hashes else b""
        for i in range(len(hashes), num_full):
            parent = _chain_hash(parent, tokens[i * self.block_size : (i + 1) * self.block_size])
            hashes.append(parent)
            self.pool.cache(table[i], parent)

    def free(self, req: Request) -> None:
        table = self.block_tables.pop(req.request_id, [])
        self._hashes.pop(req.request_id, None)
        # Tail blocks first: they are the least likely to be shared, so evict them first.
        self.pool.release(reversed(table))

    def slot(self, request_id: str, position: int) -> int:
        table = self.block_tables[request_id]
        return table[position // self.block_size] * self.block_size + position % self.block_size

    def check_invariants(self) -> None:
        self.pool.check_invariants(self.block_tables.values())
        for request_id, hashes in self._hashes.items():
            table = self.block_tables.get(request_id, [])
            assert len(hashes) <= len(table), f"{request_id}: more hashes than blocks"

    def _missing_blocks(self, req: Request, total_tokens: int) -> int:
        return self.blocks_needed(total_tokens) - len(self.block_tables.get(req.request_id, []))
