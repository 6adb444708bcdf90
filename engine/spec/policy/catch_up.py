"""What a lagging draft costs the step that drafts it again: the skipped tokens it is fed,
spread over the mean measured run of consecutive drafting steps (one step rarely repays it)."""

from __future__ import annotations

from engine.types.request import Request

CATCH_UP_STEPS = 32  # the prior run length, counted as the first measurement


class CatchUp:
    def __init__(self) -> None:
        self.run_steps = float(CATCH_UP_STEPS)  # a running mean up to 20 runs, then an EMA
        self._runs = 1
        self.open_runs: dict[str, int] = {}  # per request in a drafting run: its steps so far

    def tokens(self, req: Request) -> float:
        """Draft tokens a step of `req` is charged: its lag over `run_steps` (or steps left)."""
        behind = req.num_tokens - req.num_draft_computed_tokens - 1  # its last token is fed anyway
        if behind <= 0:
            return 0.0
        left = max(req.params.max_tokens - req.num_output_tokens, 1)
        return behind / min(left, max(self.run_steps, 1.0))

    def count(self, requests: list[Request], ks: list[int], probe: bool) -> None:
        """A step's K per request: a run ends at K = 0 and counts into `run_steps`; a probe
        drops the open runs (not the policy's choice), as does a request finishing mid-run."""
        if probe:
            self.open_runs.clear()
            return
        still: dict[str, int] = {}
        for req, k in zip(requests, ks, strict=True):
            run = self.open_runs.get(req.request_id, 0)
            if k:
                still[req.request_id] = run + 1
            elif run:
                self._runs += 1
                self.run_steps += max(1.0 / self._runs, 0.05) * (run - self.run_steps)
        self.open_runs = still
