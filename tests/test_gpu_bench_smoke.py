"""The GPU benchmark end to end at tiny scale on the CPU: pair and bench.

bench.gpu_pair --tiny trains a tiny pair for a few steps, and bench.gpu_bench measures it at
concurrency 1 and 2 with a few output tokens. The numbers
mean nothing; the test checks that every row the GPU session relies on is there and
positive, and that Tandem's greedy output equals HF plain generate()'s on this pair.
"""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from bench import gpu_bench, gpu_floor, gpu_pair
from engine.attention.backends import triton_available

pytestmark = pytest.mark.bench

LEVELS = [1, 2]
TANDEM_SETTINGS = ["off", "draft K=2", "draft K=4", "adaptive"]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu-bench")
    pair = gpu_pair.main(
        ["--tiny", "--device", "cpu", "--max-steps", "4", "--out", str(root / "tiny")]
    )
    data = gpu_bench.main(
        [
            "--pair", str(root / "tiny"), "--device", "cpu", "--levels", *map(str, LEVELS),
            "--max-tokens", "6", "--min-prompt", "16", "--max-prompt", "32",
            "--min-requests", "2", "--check-prompts", "3", "--floor-iters", "3",
            "--copy-mb", "8", "--max-num-batched-tokens", "256",
            "--out", str(root / "gpu_tiny.json"),
        ]
    )  # fmt: skip
    return root, pair, data


def test_pair_is_saved_with_its_record(smoke):
    root, pair, _ = smoke
    for member in ("target", "draft"):
        assert (root / "tiny" / member / "model.safetensors").exists()
        assert (root / "tiny" / member / "tokenizer.json").exists()
    assert pair == json.loads((root / "tiny" / "pair.json").read_text())
    assert pair["mode"] == "trained" and pair["target_params"] > pair["draft_params"] > 0
    assert pair["target_training"]["steps"] == pair["draft_training"]["steps"] == 4
    assert pair["eval"]["target_ce"] > 0 and 0 <= pair["eval"]["match_rate"] <= 1


def test_every_expected_row_has_positive_numbers(smoke):
    root, _, data = smoke
    saved = json.loads((root / "gpu_tiny.json").read_text())
    assert json.dumps(saved, sort_keys=True) == json.dumps(data, sort_keys=True)  # nan != nan
    assert data["machine"]["device_type"] == "cpu" and data["not_run"] == []
    rows = {(r["system"], r["setting"], r["concurrency"]): r for r in data["results"]}
    measured = [("Tandem", s, c) for s in TANDEM_SETTINGS for c in LEVELS]
    measured += [("HF generate()", "plain", c) for c in LEVELS]
    assert set(rows) == set(measured)
    for key in measured:
        row = rows[key]
        assert row["errors"] == [], key
        assert row["output_tokens"] == 6 * max(2, 2 * key[2]), key
        for field in ("tokens_per_s", "ttft_mean_ms", "itl_mean_ms", "seconds"):
            assert row[field] > 0, (key, field)
    for setting in TANDEM_SETTINGS[1:3]:
        for c in LEVELS:
            row = rows[("Tandem", setting, c)]
            assert row["mean_k"] > 0 and 0 <= row["acceptance"] <= 1
    assert math.isnan(rows[("Tandem", "off", 1)]["acceptance"])
    floor = data["floor"]
    for field in ("target_weight_bytes", "copy_bandwidth_gb_s", "floor_us", "pass_median_us"):
        assert floor[field] > 0, field
    assert floor["pass_over_floor"] == pytest.approx(floor["pass_median_us"] / floor["floor_us"])


def test_tandem_greedy_output_equals_hf_generate(smoke):
    _, _, data = smoke
    assert set(data["greedy"]) == set(TANDEM_SETTINGS)
    for setting, check in data["greedy"].items():
        assert check["prompts"] == 3 and check["tokens_each"] == 6
        assert check["greedy_match"] is True, setting
        assert check["differences"] == [], setting
        assert check.get("same_as_off", True) is True, setting
    assert all("same_as_off" in data["greedy"][s] for s in TANDEM_SETTINGS[1:])
    for row in data["results"]:
        if row["system"] == "Tandem":
            assert row["greedy_match"] is True


def test_greedy_match_when_drafts_are_accepted(smoke):
    """The tiny draft is rarely right, so the check above mostly sees rejections; with the
    target as its own draft nearly every draft token is accepted and bonus tokens follow."""
    root, _, _ = smoke
    pair = root / "self"
    shutil.copytree(root / "tiny", pair)
    shutil.rmtree(pair / "draft")
    shutil.copytree(root / "tiny" / "target", pair / "draft")
    data = gpu_bench.main(
        [
            "--pair", str(pair), "--device", "cpu", "--levels", "2", "--systems", "tandem",
            "--only", "draft K=4", "adaptive", "--max-tokens", "12", "--min-prompt", "16",
            "--max-prompt", "32", "--check-prompts", "3", "--max-num-batched-tokens", "256",
            "--out", str(root / "gpu_self.json"),
        ]
    )  # fmt: skip
    assert data["floor"] is None  # no `off` setting to time the target with
    for setting in ("draft K=4", "adaptive"):
        assert data["greedy"][setting]["greedy_match"] is True
    row = next(r for r in data["results"] if r["setting"] == "draft K=4")
    assert row["acceptance"] > 0.5 and row["tokens_per_pass"] > 2


@pytest.mark.skipif(not triton_available(), reason="the decode graphs' path needs triton")
def test_floor_on_random_weights_of_an_architecture(tmp_path, monkeypatch):
    """`python -m bench.gpu_floor`'s runner, at toy scale on the CPU: the native forward on
    the Triton backend with decode graphs, and the weights a pass reads, which leave out an
    input embedding that is not the LM head."""
    monkeypatch.setitem(gpu_floor.SHAPES, "toy", (64, 2, 4, 2, 128, False))
    runner = gpu_floor.random_runner("toy", torch.device("cpu"), 32, tmp_path)
    assert (runner.model_impl, runner.decode_graphs is not None) == ("native", True)
    model = runner.model
    everything = sum(p.numel() * p.element_size() for p in model.parameters())
    embedding = model.get_input_embeddings().weight
    read = everything - embedding.numel() * embedding.element_size()
    assert gpu_floor.weight_bytes(model) == read
    row = gpu_floor.measure_floor(runner, 32, 2, 1 << 20)
    assert row["target_weight_bytes"] == read and row["pass_median_us"] > 0
    assert row["graph_replay_us"] is None  # no CUDA graph on the CPU
    assert runner.decode_graphs.steps > 0  # the passes took the fixed-shape path
