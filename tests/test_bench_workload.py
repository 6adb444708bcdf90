"""bench/prompts.py's six task-family workload (bench/family_prompts.json, frozen by
scripts/family_prompts.py): its shape, the summarization articles' length (from the token
counts the file keeps: no model is loaded), the request cycle, the per-family rates, and
bench.chat_bench's per-family row."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from bench import chat_bench
from bench.prompts import FAMILY_PROMPTS, family_cycle, family_messages, family_rates
from bench.serving import Trace

pytestmark = pytest.mark.bench

FAMILIES = ["chat", "translation", "summarization", "qa", "math", "rag"]


def test_six_families_of_eight_chat_prompts():
    families = family_messages()
    assert list(families) == FAMILIES
    for name, prompts in families.items():
        assert len(prompts) == 8, name
        for messages in prompts:
            assert messages[-1]["role"] == "user" and messages[-1]["content"].strip()
            assert {m["role"] for m in messages} <= {"system", "user", "assistant"}
    assert all(len(m) == 3 for m in families["chat"])  # user, assistant, follow-up


def test_summarization_prompts_are_500_to_1500_tokens_and_rag_prompts_carry_passages():
    frozen = json.loads(FAMILY_PROMPTS.read_text())["families"]
    for item in frozen["summarization"]:
        assert 500 <= item["article_tokens"] <= item["prompt_tokens"] <= 1500
    for item in frozen["rag"]:
        assert 3 <= len(item["sources"]) <= 4 and item["answer_source"] in item["sources"]
        assert item["messages"][-1]["content"].endswith("Answer using the passages above.")
    assert all(isinstance(i["answer"], int) for i in frozen["math"])
    assert all(i["prompt_tokens"] > 0 for items in frozen.values() for i in items)
    assert FAMILY_PROMPTS.stat().st_size < 150_000


def test_requests_cycle_through_the_families_in_turn():
    families = family_messages()
    cycle = family_cycle(50)
    assert [name for name, _ in cycle[:7]] == [*FAMILIES, "chat"]
    assert cycle[6][1] == families["chat"][1] and cycle[48][1] == families["chat"][0]


def test_family_rates_sum_tokens_and_times_over_requests():
    # (family, sent, first token, last token, output tokens, tokens with the first)
    rates = family_rates([("qa", 0.0, 1.0, 3.0, 9, 1), ("qa", 5.0, 5.5, 6.5, 5, 1),
                          ("rag", 0.0, 2.0, 2.0, 1, 1)])  # fmt: skip
    assert rates["qa"] == {"requests": 2, "output_tokens": 14,
                           "decode_tokens_per_s": 12 / 3, "e2e_tokens_per_s": 14 / 4.5}  # fmt: skip
    assert rates["rag"]["decode_tokens_per_s"] == 0.0 and rates["rag"]["e2e_tokens_per_s"] == 0.5
    assert rates["all"]["requests"] == 3 and rates["all"]["output_tokens"] == 15


def test_chat_bench_rows_keep_the_rates_of_each_family(monkeypatch):
    sent = []

    async def chat_one(url, body):
        sent.append(body["messages"])
        trace = Trace(start=0.0, chunks=[(1.0, 1), (2.0, 1), (3.0, 1)], output_tokens=3)
        return trace, {"completion_tokens": 3}

    async def no_counters(client, url):
        return {}

    monkeypatch.setattr(chat_bench, "chat_one", chat_one)
    monkeypatch.setattr(chat_bench, "server_counters", no_counters)
    families, prompts = map(list, zip(*family_cycle(12), strict=True))
    args = SimpleNamespace(max_tokens=8, seeded=False)
    row = asyncio.run(
        chat_bench.run_level("http://127.0.0.1:1", prompts, 1, 12, args, 0.0, families)
    )
    assert sent == prompts
    assert list(row["families"]) == [*FAMILIES, "all"]
    math = {"requests": 2, "output_tokens": 6, "decode_tokens_per_s": 1.0, "e2e_tokens_per_s": 1.0}
    assert row["families"]["math"] == math
    plain = asyncio.run(chat_bench.run_level("http://127.0.0.1:1", prompts, 1, 2, args, 0.0))
    assert "families" not in plain
