"""Engine-wide statistics: plain numbers, exported by server/metrics.py."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field


@dataclass
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    num_blocks_total: int = 0
    num_blocks_free: int = 0
    # Monotonic counters.
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    preemptions: int = 0
    steps: int = 0
    spec_verify_passes: int = 0
    spec_drafted_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_blocks_released: int = 0
    spec_tree_steps: int = 0  # steps that drafted trees
    draft_seconds: float = 0.0  # wall time in the proposer
    target_seconds: float = 0.0  # wall time in target passes (forward + verification)
    forward_seconds: float = 0.0  # of target_seconds, the forward alone
    step_seconds: float = 0.0  # wall time of steps that ran a pass
    grammar_forced_drafted: int = 0  # drafts grammars forced (not the proposer's)
    grammar_forced_accepted: int = 0
    spec_lookup_drafted: int = 0  # prompt-lookup drafts, not in spec_drafted_tokens
    spec_lookup_accepted: int = 0
    grammar_seconds: float = 0.0  # of step_seconds, structured output's grammar work
    draft_passes: int = 0
    decode_request_steps: int = 0  # request-steps that verified a decode: mean K's denominator
    spec_drafted_by_position: list[int] = field(default_factory=list)
    spec_accepted_by_position: list[int] = field(default_factory=list)
    # Gauges about the latest step.
    mean_draft_length: float = 0.0
    draft_length_reasons: dict[str, int] = field(default_factory=dict)  # why K < K_max -> count
    speed_of_light: dict[str, float] = field(default_factory=dict)

    def snapshot(self) -> EngineStats:
        """A copy later steps do not change (each container copied; cheaper than deepcopy)."""
        out = copy.copy(self)
        out.spec_drafted_by_position = list(self.spec_drafted_by_position)
        out.spec_accepted_by_position = list(self.spec_accepted_by_position)
        out.draft_length_reasons = dict(self.draft_length_reasons)
        out.speed_of_light = dict(self.speed_of_light)
        return out

    @property
    def kv_usage(self) -> float:
        if self.num_blocks_total == 0:
            return 0.0
        return 1.0 - self.num_blocks_free / self.num_blocks_total

    @property
    def acceptance_rate(self) -> float:
        return self.spec_accepted_tokens / max(self.spec_drafted_tokens, 1)
