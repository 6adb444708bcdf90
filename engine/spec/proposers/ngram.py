"""Prompt lookup: propose what followed the latest earlier occurrence of the context's suffix."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.config import SpecConfig
from engine.spec.proposers.base import DraftBatch

if TYPE_CHECKING:
    from engine.core.scheduler import SchedulerOutput


def prompt_lookup(tokens: list[int], k: int, n_max: int, n_min: int) -> list[int]:
    """Up to k tokens that followed the latest earlier match of the longest suffix n-gram."""
    length = len(tokens)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        suffix = tokens[length - n :]
        # Latest start j < length - n whose n-gram equals the suffix (the suffix itself excluded).
        for j in range(length - n - 1, -1, -1):
            if tokens[j] == suffix[0] and tokens[j : j + n] == suffix:
                return tokens[j + n : j + n + k]
    return []


class NgramProposer:
    keeps_kv = False

    def __init__(self, n_max: int, n_min: int) -> None:
        self.n_max = n_max
        self.n_min = n_min

    @classmethod
    def from_config(
        cls,
        config: SpecConfig,
        device: torch.device,
        dtype: torch.dtype,
        target_vocab: int,
        attention_backend: str,
        model_impl: str,
        quantization: str,
    ) -> NgramProposer:
        return cls(config.ngram_max, config.ngram_min)

    def kv_bytes_per_block(self, block_size: int) -> int:
        return 0

    def allocate_kv(self, num_blocks: int, block_size: int) -> None:
        pass

    def propose(self, sched: SchedulerOutput, block_tables: list[list[int]]) -> DraftBatch:
        return DraftBatch(
            [
                prompt_lookup(item.request.all_token_ids, k, self.n_max, self.n_min)
                if (k := item.num_draft_tokens) > 0
                else []
                for item in sched.scheduled
            ]
        )
