"""The cost-model trace: each observation beside the prediction made just before it."""

from __future__ import annotations

import io
import json

import pytest

from engine.config import SpecConfig
from engine.spec.cost.model import CostModel, PassShape
from engine.spec.cost.trace import ENV, TracedCostModel
from tests.engine_utils import drain, greedy, make_engine, random_prompts


def _model() -> CostModel:
    return CostModel([1, 2, 4, 8], [2e-3, 2.2e-3, 2.6e-3, 4e-3], 1e-3, 2e-4, kv_coef=1e-6)


def test_a_traced_model_records_what_it_predicted_and_learns_as_the_plain_one():
    plain, buffer = _model(), io.StringIO()
    traced = TracedCostModel.wrapping(_model(), buffer)
    shape = PassShape.of([3], [100])
    steps = [(shape, 5e-3), (shape, 4e-3), (PassShape.of([1], [50]), 1e-3)]
    expected = []
    for s, seconds in steps:
        expected.append(float(plain.target_time(s.num_tokens, s.kv_tokens, s.qk_pairs)))
        plain.observe_target(s, seconds)
        traced.observe_target(s, seconds)
    expected_draft = float(plain.draft_time(2, 5, 400))
    plain.observe_draft(2, 5, 400, 3e-3)
    traced.observe_draft(2, 5, 400, 3e-3)
    for _ in range(9):  # past the count at which a batch size's overhead is used
        plain.observe_step(1, 7e-3, 6e-3, drafting=True)
        traced.observe_step(1, 7e-3, 6e-3, drafting=True)
    records = [json.loads(line) for line in buffer.getvalue().splitlines()]
    assert [r["kind"] for r in records] == ["target"] * 3 + ["draft"] + ["step"] * 9
    assert [r["predicted"] for r in records[:3]] == pytest.approx(expected, rel=1e-12)
    assert records[0]["measured"] == 5e-3 and records[0]["tokens"] == 3
    assert records[3]["predicted"] == pytest.approx(expected_draft, rel=1e-12)
    assert records[3]["passes"] == 2
    assert records[4]["predicted"] == 0.0  # no overhead known before it was observed
    assert abs(records[-1]["predicted"] - 1e-3) < 1e-12
    assert abs(records[-1]["measured"] - 1e-3) < 1e-12
    # Tracing changes nothing the policy reads.
    assert traced.target_scale.value == plain.target_scale.value
    assert traced.draft.coefs == plain.draft.coefs
    assert traced.step_overhead(1, True) == plain.step_overhead(1, True)


def test_an_engine_traces_its_cost_model_when_the_environment_asks(
    tiny_dirs, tmp_path, monkeypatch
):
    spec = SpecConfig(
        method="draft",
        draft_model=str(tiny_dirs["llama_draft"]),
        max_draft_tokens=3,
        draft_length="adaptive",
    )
    prompts = random_prompts([5, 9, 12], vocab=300, seed=3)

    def run():
        engine = make_engine(tiny_dirs["llama"], spec=spec)
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, greedy(16))
        return drain(engine), engine

    untraced, engine = run()
    assert not isinstance(engine.cost_model, TracedCostModel)
    trace = tmp_path / "trace.jsonl"
    monkeypatch.setenv(ENV, str(trace))
    traced, engine = run()
    assert isinstance(engine.cost_model, TracedCostModel)
    assert traced == untraced
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    assert {"target", "step"} <= {r["kind"] for r in records}
    assert all(r["measured"] >= 0 and r["predicted"] >= 0 for r in records)
