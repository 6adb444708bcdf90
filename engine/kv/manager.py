"""Request -> block table (callers see block ids, not ref counts). Full blocks of verified tokens
are shared by chain hash (previous block's hash + its tokens); drafts are never hashed."""

from __future__ import annotations

import hashlib
from array import array

from engine.kv.block_pool import BlockPool
from engine.types.request import Request


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

    def find_cached_prefix(self, req: Request) -> list[int]:
        """Cached blocks holding a prefix of req's tokens (no side effects); at least one token
        is left to compute, so admission's step produces the next token's logits."""
        if not self.enable_prefix_caching or req.params.prompt_logprobs is not None:
            return []
        tokens = req.all_token_ids
        blocks: list[int] = []
        parent = b""
        for i in range((len(tokens) - 1) // self.block_size):
            parent = _chain_hash(parent, tokens[i * self.block_size : (i + 1) * self.block_size])
            block = self.pool.lookup(parent)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def allocate_slots(
        self,
        req: Request,
        num_new_tokens: int,
        num_lookahead: int = 0,
        cached_blocks: list[int] | None = None,
    ) -> bool:
        """Make room for num_new_tokens + num_lookahead drafts after the computed tokens (and
        cached_blocks from find_cached_prefix); all or nothing: False changes nothing."""
        cached = cached_blocks or []
        table = self.block_tables.get(req.request_id, [])
        total = (
            req.num_computed_tokens + len(cached) * self.block_size + num_new_tokens + num_lookahead
        )
        missing = self.blocks_needed(total) - len(table) - len(cached)
        # A cached block nobody holds sits in the free queue: sharing it uses up a free block.
        revived = sum(1 for b in cached if self.pool.ref_cnt[b] == 0)
        if max(missing, 0) + revived > self.pool.num_free:
            return False
        table = self.block_tables.setdefault(req.request_id, [])
        if cached:
            self.pool.touch(cached)
            table.extend(cached)
            parent = b""
            hashes = self._hashes.setdefault(req.request_id, [])
            for block in cached:
                parent = self.pool.block_hash[block]
                hashes.append(parent)
        if missing > 0:
            table.extend(self.pool.allocate(missing))
        return True

    def trim(self, req: Request, num_keep_tokens: int) -> int:
        """Release the blocks past the first num_keep_tokens tokens (rejected drafts); how many."""
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
        parent, size = hashes[-1] if hashes else b"", self.block_size
        for i in range(len(hashes), num_full):
            parent = _chain_hash(parent, req.token_ids(i * size, (i + 1) * size))
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
