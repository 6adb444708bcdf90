"""Draft proposers, chosen by name from a registry (see base.py for the protocol)."""

from __future__ import annotations

from engine.spec.proposers.base import PROPOSERS, DraftBatch, Proposer, build_proposer
from engine.spec.proposers.draft_model import DraftModelProposer
from engine.spec.proposers.ngram import NgramProposer

PROPOSERS["draft"] = DraftModelProposer.from_config
PROPOSERS["ngram"] = NgramProposer.from_config

__all__ = ["PROPOSERS", "DraftBatch", "Proposer", "build_proposer"]
