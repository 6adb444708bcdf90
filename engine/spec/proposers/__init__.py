"""Draft proposers, chosen by name from a registry (see base.py for the protocol)."""

from __future__ import annotations

from engine.spec.proposers.base import PROPOSERS, DraftBatch, Proposer, build_proposer
from engine.spec.proposers.draft_model import DraftModelProposer
from engine.spec.proposers.eagle import EagleProposer, is_feature_draft
from engine.spec.proposers.ngram import NgramProposer
from engine.spec.proposers.suffix import SuffixProposer


def _draft_model(config, *args) -> Proposer:
    """--speculative-method draft: a small model of its own, or a feature draft (EAGLE) when
    the directory holds one."""
    if config.draft_model and is_feature_draft(config.draft_model):
        return EagleProposer.from_config(config, *args)
    return DraftModelProposer.from_config(config, *args)


PROPOSERS["draft"] = _draft_model
PROPOSERS["ngram"] = lambda config, *_: NgramProposer(config.ngram_max, config.ngram_min)
PROPOSERS["suffix"] = lambda config, *_: SuffixProposer(
    config.suffix_max_depth, config.max_draft_tokens, config.suffix_cache_tokens
)

__all__ = ["PROPOSERS", "DraftBatch", "Proposer", "build_proposer"]
