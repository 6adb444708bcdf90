"""With `TANDEM_COST_TRACE=FILE`, one JSON line per observation the cost model learns from
(kind target, draft or step; seconds) beside its prediction; `t` is `time.perf_counter()`."""

from __future__ import annotations

import json
import logging
import os
import time
from typing import TextIO

from engine.spec.cost.model import CostModel, PassShape

logger = logging.getLogger(__name__)
ENV = "TANDEM_COST_TRACE"


class TracedCostModel(CostModel):
    """A CostModel that writes each observation and its prediction to `trace`."""

    trace: TextIO

    @classmethod
    def wrapping(cls, cost: CostModel, trace: TextIO) -> TracedCostModel:
        traced = cls.__new__(cls)
        traced.__dict__.update(cost.__dict__)
        traced.trace = trace
        return traced

    def _write(self, record: dict) -> None:
        record["t"] = time.perf_counter()
        self.trace.write(json.dumps(record) + "\n")

    def observe_target(self, shape: PassShape, seconds: float, branches: int = 1) -> None:
        n, kv, qk = shape.num_tokens, shape.kv_tokens, shape.qk_pairs
        # target_time's formula on scalars (numpy would inflate the step time traced).
        scale = self.target_scale_at(n) * self._tree_scale(branches, 0)
        predicted = scale * self._target_at(n, kv, qk)
        self._write(
            {
                "kind": "target",
                "tokens": n,
                "kv": kv,
                "qk": qk,
                "branches": branches,
                "measured": seconds,
                "predicted": predicted,
            }
        )
        super().observe_target(shape, seconds, branches)

    def observe_draft(
        self,
        num_passes: int,
        num_drafts: int,
        qk_pairs: int,
        seconds: float,
        branches: int = 1,
        fed: int = 0,
    ) -> None:
        scale = self._tree_scale(branches, 1)  # draft_time's formula
        predicted = scale * self.draft.at(num_passes, num_drafts, qk_pairs, fed)
        self._write(
            {
                "kind": "draft",
                "passes": num_passes,
                "drafts": num_drafts,
                "fed": fed,
                "qk": qk_pairs,
                "branches": branches,
                "measured": seconds,
                "predicted": predicted,
            }
        )
        super().observe_draft(num_passes, num_drafts, qk_pairs, seconds, branches, fed)

    def observe_step(
        self, batch: int, interval: float, passes: float, drafting: bool = False
    ) -> None:
        self._write(
            {
                "kind": "step",
                "batch": batch,
                "drafting": drafting,
                "measured": max(interval - passes, 0.0),
                "predicted": self.step_overhead(batch, drafting),
            }
        )
        super().observe_step(batch, interval, passes, drafting)


def traced_if_asked(cost: CostModel) -> CostModel:
    """`cost`, traced to the file named by $TANDEM_COST_TRACE when it is set."""
    path = os.environ.get(ENV)
    if not path:
        return cost
    try:
        trace = open(path, "a", buffering=1)  # noqa: SIM115 - lives as long as the engine
    except OSError as exc:
        logger.warning("%s=%s cannot be opened (%s): not tracing the cost model", ENV, path, exc)
        return cost
    logger.info("tracing the cost model's predictions and measurements to %s", path)
    return TracedCostModel.wrapping(cost, trace)
