"""The Proposer protocol and its registry."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from engine.config import SpecConfig

if TYPE_CHECKING:
    from engine.model.runner import ModelRunner
    from engine.spec.step import StepResult
    from engine.types.batch import SchedulerOutput
    from engine.types.request import Request


@dataclass
class DraftBatch:
    token_ids: list[list[int]]
    """Per scheduled request (in SchedulerOutput order): at most its num_proposed_tokens drafts."""
    probs: torch.Tensor | None = None
    """[total drafts, vocab] q for each draft, request by request; None = model-free (one-hot)."""
    fed_tokens: int = 0  # every token the draft's passes processed (drafts, catch-ups, chunks)
    fed_pairs: int = 0  # their query x key pairs
    parents: list[list[int] | None] | None = None
    """Per scheduled request, None for a chain, or a tree: parents[j] of draft j (0 = the root,
    d + 1 = draft d), parents first (engine/sample/tree_verifier.py)."""
    passes: int = 0  # draft passes that picked drafts; 0 = the longest chain's length


def with_forced_drafts(sched: SchedulerOutput, drafts: DraftBatch | None) -> DraftBatch | None:
    """The step's drafts with each grammar-forced request's forced tokens in place (the
    proposer skipped those requests). Proposed as certainties: q one-hot on each."""
    if not any(item.forced for item in sched.scheduled):
        return drafts
    token_ids = [list(d) for d in drafts.token_ids] if drafts else [[] for _ in sched.scheduled]
    rows: list[torch.Tensor] = []
    cursor = 0
    for i, item in enumerate(sched.scheduled):
        if item.forced:
            token_ids[i] = list(item.forced)
        if drafts is None or drafts.probs is None:
            continue
        if item.forced:
            one_hot = drafts.probs.new_zeros(len(item.forced), drafts.probs.shape[1])
            one_hot[range(len(item.forced)), item.forced] = 1.0
            rows.append(one_hot)
        else:
            n = len(token_ids[i])
            rows.append(drafts.probs[cursor : cursor + n])
            cursor += n
    probs = torch.cat(rows) if rows else None
    if drafts is None:
        return DraftBatch(token_ids)
    parents = drafts.parents
    if parents is not None:
        parents = [
            None if item.forced else p for item, p in zip(sched.scheduled, parents, strict=True)
        ]
    return DraftBatch(token_ids, probs, drafts.fed_tokens, drafts.fed_pairs, parents, drafts.passes)


class Proposer(Protocol):
    """Proposes draft tokens: `propose` returns at most `num_proposed_tokens` per scheduled
    request (none, at no cost, where K is 0), leaving the scheduler's state alone (own KV: in the
    target's block ids). `observe` sees every verified step before the scheduler moves on, and
    `release` every request the scheduler lets go."""

    keeps_kv: bool  # a KV cache of its own in the target's blocks (a draft model)
    runner: ModelRunner | None  # its own model's runner, or None (model-free)
    observes: bool  # whether `observe` does anything (else the planner skips the call)

    def kv_bytes_per_block(self, block_size: int) -> int: ...

    def allocate_kv(self, num_blocks: int, block_size: int) -> None: ...

    def propose(self, sched: SchedulerOutput, block_tables: list[list[int]]) -> DraftBatch: ...

    def observe(self, step: StepResult) -> None: ...

    def release(self, req: Request) -> None: ...


class ModelFreeProposer:
    """The members of `Proposer` a proposer without a model of its own has (prompt lookup,
    suffix decoding): no KV, no runner; `observe` and `release` learn nothing by default."""

    keeps_kv = False
    runner = None
    observes = False

    def kv_bytes_per_block(self, block_size: int) -> int:
        return 0

    def allocate_kv(self, num_blocks: int, block_size: int) -> None:
        pass

    def observe(self, step: StepResult) -> None:
        pass

    def release(self, req: Request) -> None:
        pass


# (config, device, dtype, the target's runner, attention backend name, model impl,
# weight quantization) -> proposer
ProposerFactory = Callable[
    [SpecConfig, torch.device, torch.dtype, "ModelRunner", str, str, str], Proposer
]
PROPOSERS: dict[str, ProposerFactory] = {}


def build_proposer(
    config: SpecConfig,
    device: torch.device,
    dtype: torch.dtype,
    target: ModelRunner,
    attention_backend: str = "reference",
    model_impl: str = "auto",
    quantization: str = "none",
) -> Proposer | None:
    if not config.enabled:
        return None
    return PROPOSERS[config.method](
        config, device, dtype, target, attention_backend, model_impl, quantization
    )
