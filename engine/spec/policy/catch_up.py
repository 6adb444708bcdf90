"""What a lagging draft costs the step that drafts it again (engine/spec/policy/).

A request given K = 0 costs the draft model nothing that step, so its draft falls behind; when
it drafts again, the draft is first fed every token it skipped. One speculative step alone
rarely repays that catch-up, so the policy spreads it over the drafting steps expected to
follow: the mean length of the runs of consecutive drafting steps it chose for a request,
measured here, `CATCH_UP_STEPS` as the prior.
"""

from __future__ import annotations

from engine.types.request import Request

CATCH_UP_STEPS = 32
"""The prior of the drafting run's length, counting as its first measurement."""


class CatchUp:
    """The measured mean drafting run (`run_steps`), and per request the catch-up a drafting
    step is charged (`tokens`)."""

    def __init__(self) -> None:
        self.run_steps = float(CATCH_UP_STEPS)
        """Mean length of a run of consecutive drafting steps: a running mean over the runs
        seen (the prior counting as the first) up to 20, an EMA after that."""
        self._runs = 1
        self._open: dict[str, int] = {}
        """Per request in a run of drafting steps the policy chose: its steps so far."""

    def tokens(self, req: Request) -> float:
        """Draft tokens a step of `req` is charged for the draft's lag: the lag spread over
        the `run_steps` drafting steps expected to follow (or the steps left, if fewer)."""
        behind = req.num_tokens - req.num_draft_computed_tokens - 1  # its last token is fed anyway
        if behind <= 0:
            return 0.0
        left = max(req.params.max_tokens - req.num_output_tokens, 1)
        return behind / min(left, max(self.run_steps, 1.0))

    def count(self, requests: list[Request], ks: list[int], probe: bool) -> None:
        """A step's K per request: extend the runs of the requests that draft; a run that stops
        (K = 0) is counted into `run_steps`. Probes' forced steps are no run of the policy's
        choosing: they start none, and a run a request is in when a probe begins is dropped
        (as is one whose request finished mid-run: its length was cut short)."""
        if probe:
            self._open.clear()
            return
        still: dict[str, int] = {}
        for req, k in zip(requests, ks, strict=True):
            run = self._open.get(req.request_id, 0)
            if k:
                still[req.request_id] = run + 1
            elif run:
                self._runs += 1
                self.run_steps += max(1.0 / self._runs, 0.05) * (run - self.run_steps)
        self._open = still
