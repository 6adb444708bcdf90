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


REASON_UNSURE = "draft_unsure"
"""The draft_length_reductions label of chains cut by --draft-min-prob (one per chain cut)."""


@dataclass
class DraftBatch:
    token_ids: list[list[int]]
    """Per scheduled request (in SchedulerOutput order): at most its num_proposed_tokens drafts."""
    probs: torch.Tensor | None = None
    """[total drafts, vocab] q for each draft, request by request; None = model-free (one-hot)."""
    fed_tokens: int = 0
    """Tokens a draft model processed over all its passes this step: drafts, catch-up tokens
    and prefill chunks alike (what its measured time paid for)."""
    fed_pairs: int = 0
    """Sum over those tokens of the context each attended (query x key pairs)."""
    parents: list[list[int] | None] | None = None
    """Per scheduled request, None for a chain, or a draft tree: parents[j] is the parent of
    draft j (0 = the request's last token, the root; d + 1 = draft d), drafts listed after
    their parents (engine/sample/tree_verifier.py)."""
    passes: int = 0
    """Draft passes that picked drafts this step; 0 = as many as the longest chain returned."""
    cut: int = 0
    """Chains cut by --draft-min-prob: each picked one more draft than it returned (the first
    the draft was unsure of), which the passes above paid for."""


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
    return DraftBatch(
        token_ids, probs, drafts.fed_tokens, drafts.fed_pairs, parents, drafts.passes, drafts.cut
    )


class Proposer(Protocol):
    """Proposes draft tokens for a scheduled batch.

    Rules: `propose` returns at most `num_proposed_tokens` drafts for each scheduled request, and
    none for a request whose K is 0 (that request must cost the proposer no work). It may
    return fewer (a lookup that finds nothing). It must not change what the scheduler owns
    (num_computed_tokens, block tables); a proposer with a KV cache of its own uses the
    target's block ids and tracks its progress in `Request.num_draft_computed_tokens`.
    `observe` sees every verified step before the scheduler moves its requests on.
    """

    keeps_kv: bool
    """Whether it keeps a KV cache of its own in the target's blocks (a draft model): a block
    is then shareable through the prefix cache only once the draft's KV in it is valid too."""

    runner: ModelRunner | None
    """Its own model's runner (KV sizing, decode graphs, calibration), or None (model-free)."""

    def kv_bytes_per_block(self, block_size: int) -> int: ...

    def allocate_kv(self, num_blocks: int, block_size: int) -> None: ...

    def propose(self, sched: SchedulerOutput, block_tables: list[list[int]]) -> DraftBatch: ...

    def observe(self, step: StepResult) -> None: ...


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
