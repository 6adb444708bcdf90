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
    spec_tree_steps: int = 0
    """Steps that drafted trees (more than one candidate for a request's next token)."""
    draft_seconds: float = 0.0
    """Wall time spent in the proposer (all draft passes)."""
    target_seconds: float = 0.0
    """Wall time spent in target passes (forward + verification)."""
    forward_seconds: float = 0.0
    """Of `target_seconds`, the target model's forward alone (logits out)."""
    step_seconds: float = 0.0
    """Wall time of engine steps that ran a pass: scheduling, draft, target, bookkeeping."""
    grammar_forced_drafted: int = 0
    """Drafts structured output's grammars forced (not the proposer's), and those kept."""
    grammar_forced_accepted: int = 0
    spec_lookup_drafted: int = 0
    """Drafts a prompt lookup gave in place of the draft model's (`speculative.ngram_assist`), and
    those kept; not in spec_drafted_tokens / spec_accepted_tokens, which are the proposer's."""
    spec_lookup_accepted: int = 0
    grammar_seconds: float = 0.0
    """Of `step_seconds`, structured output's grammar work: masks, matcher moves, draft checks."""
    draft_passes: int = 0
    decode_request_steps: int = 0
    """Request-steps that verified a decode (with or without drafts): the denominator of mean K."""
    spec_drafted_by_position: list[int] = field(default_factory=list)
    spec_accepted_by_position: list[int] = field(default_factory=list)
    # Gauges about the latest step.
    mean_draft_length: float = 0.0
    draft_length_reasons: dict[str, int] = field(default_factory=dict)
    """Counter: why K was cut below K_max (reason -> request-steps)."""
    speed_of_light: dict[str, float] = field(default_factory=dict)

    def snapshot(self) -> EngineStats:
        """A copy later steps do not change: the numbers and each container copied (a tenth
        of what `copy.deepcopy` costs, paid once a step)."""
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
