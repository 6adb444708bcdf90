"""Attention features beyond causal softmax attention (engine/model/features.py,
engine/attention/paged.py `refuse_unsupported`): a sliding window is served as a cap on the
context, where it changes nothing, and greedy output equals transformers' generate(); what no
path implements (softcapped attention logits, sinks, ALiBi, an attention of the model's own) is
refused at start with the feature named, and at run time should it get through."""

from __future__ import annotations

import re

import openai
import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    BloomConfig,
    FalconConfig,
    Llama4TextConfig,
    StableLmConfig,
)

from engine.attention import paged as attention
from engine.attention.backends import BACKENDS
from engine.config import CacheConfig, EngineConfig, ModelConfig, SpecConfig
from engine.core.engine import LLMEngine
from engine.model.features import check_config
from engine.model.inputs import SeqInput
from engine.model.runner import ModelRunner
from engine.types.request import InvalidRequest
from tests.engine_utils import drain, greedy, hf_greedy, make_engine, random_prompts
from tests.server_helpers import GREEDY, MODEL, serve
from tests.tiny_models import build_model

WINDOW = 16


@pytest.fixture(scope="module")
def windowed(tiny_dirs, tmp_path_factory) -> dict[str, object]:
    """Tiny random models with a sliding window of WINDOW tokens (max_positions 256)."""
    root = tmp_path_factory.mktemp("windowed")
    tok = tiny_dirs["llama"]
    return {
        "mistral": build_model(
            root / "mistral", "mistral", seed=5, tokenizer_dir=tok, sliding_window=WINDOW
        ),
        # Qwen2: the window on layer 1 only (max_window_layers)
        "qwen2": build_model(
            root / "qwen2",
            "qwen2",
            seed=6,
            tokenizer_dir=tok,
            use_sliding_window=True,
            sliding_window=WINDOW,
            max_window_layers=1,
        ),
        # Gemma-2: windows on every other layer, final logit softcapping (at 2.0: these
        # logits reach about 4), no softcapped attention logits
        "gemma2": build_model(
            root / "gemma2",
            "gemma2",
            seed=7,
            tokenizer_dir=tok,
            sliding_window=WINDOW,
            attn_logit_softcapping=None,
            final_logit_softcapping=2.0,
        ),
        # Gemma-3: local layers on a rotary base of their own
        "gemma3": build_model(
            root / "gemma3", "gemma3", seed=8, tokenizer_dir=tok, sliding_window=WINDOW
        ),
    }


@pytest.mark.parametrize("family", ["mistral", "qwen2", "gemma2", "gemma3"])
@pytest.mark.parametrize("impl", ["auto", "transformers"])
def test_a_sliding_window_model_serves_generate_within_its_window(windowed, family, impl):
    model_dir = windowed[family]
    engine = make_engine(model_dir, model_impl=impl)
    assert engine.runner.sliding_window == WINDOW
    assert engine.max_model_len == WINDOW
    if family in ("mistral", "qwen2"):  # Llama family: native (C kernels) where impl is auto
        assert engine.runner.model_impl == ("native" if impl == "auto" else "transformers")
    prompts = random_prompts([3, 9, 15], vocab=engine.vocab_size, seed=11)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, greedy(WINDOW - len(p)))
    got = drain(engine)
    expected = [hf_greedy(model_dir, [p], WINDOW - len(p))[0] for p in prompts]
    assert [got[str(i)] for i in range(len(prompts))] == expected
    with pytest.raises(InvalidRequest, match="maximum context length is 16 tokens") as info:
        engine.add_request("long", prompts[1], greedy(WINDOW - len(prompts[1]) + 1))
    assert info.value.param == "max_tokens"


def test_the_window_changes_transformers_output_past_it(windowed):
    """The window is real: past it, transformers' own Mistral differs from full attention,
    so only the cap keeps Tandem's full-context attention exact."""
    prompt = torch.tensor([list(range(3, 3 + WINDOW))])
    outputs = [
        AutoModelForCausalLM.from_pretrained(windowed["mistral"], dtype=torch.float32, **kw)
        .eval()
        .generate(prompt, max_new_tokens=2 * WINDOW, do_sample=False, pad_token_id=0)
        .tolist()
        for kw in ({}, {"sliding_window": None})
    ]
    assert outputs[0] != outputs[1]


def test_a_final_logit_softcap_is_applied(windowed):
    """Gemma-2's final_logit_softcapping runs in the model's own forward (transformers')."""
    model_dir = windowed["gemma2"]
    runner = ModelRunner(str(model_dir), torch.device("cpu"), torch.float32)
    runner.allocate_kv(8, 4)
    prompt = random_prompts([12], vocab=runner.vocab_size, seed=3)[0]
    got = runner.forward([SeqInput(prompt, 0, [0, 1, 2], list(range(len(prompt))))])
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    expected = model(torch.tensor([prompt])).logits[0]
    assert got.abs().max() < 2.0 < model.lm_head(model.model(torch.tensor([prompt]))[0]).max()
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_max_model_len_past_the_window_is_refused(windowed):
    config = EngineConfig(
        model=ModelConfig(model=str(windowed["mistral"]), max_model_len=32),
        cache=CacheConfig(block_size=4, num_blocks=64),
        spec=SpecConfig(method="off"),
    )
    with pytest.raises(ValueError, match=r"--max-model-len 32 exceeds the sliding window of .*16"):
        LLMEngine(config)


def test_a_draft_with_a_narrower_window_caps_the_context(tiny_dirs, windowed):
    """The draft attends to the whole context too: it must not pass its own window either."""
    spec = SpecConfig("draft", str(windowed["mistral"]), 3, "fixed")
    engine = make_engine(tiny_dirs["llama"], spec=spec)
    assert engine.max_model_len == WINDOW
    prompt = random_prompts([5], vocab=engine.vocab_size, seed=2)[0]
    engine.add_request("r", prompt, greedy(WINDOW - len(prompt)))
    assert drain(engine)["r"] == hf_greedy(tiny_dirs["llama"], [prompt], WINDOW - 5)[0]
    assert engine.stats().spec_drafted_tokens > 0


@pytest.fixture(scope="module")
def windowed_server(tiny_dirs, windowed):
    """The sliding-window Mistral served with the tiny Llama draft."""
    yield from serve(tiny_dirs, model__path=str(windowed["mistral"]), model__max_model_len=None)


def test_the_server_keeps_requests_within_the_window(windowed_server):
    """Greedy text as generate()'s within the window; past it a 400 naming max_tokens (or the
    prompt), and a request without max_tokens gets what fits, finished for length."""
    client, served = windowed_server.client, windowed_server
    prompt = list(range(3, 10))
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=WINDOW - 7, **GREEDY)
    expected = hf_greedy(served.settings.engine.model.model, [prompt], WINDOW - 7)[0]
    assert out.choices[0].text == served.tokenizer.decode(expected)
    assert (out.usage.completion_tokens, out.choices[0].finish_reason) == (WINDOW - 7, "length")
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=WINDOW - 6, **GREEDY)
    assert "maximum context length is 16 tokens" in str(info.value)
    assert info.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=list(range(3, 20)), **GREEDY)
    assert info.value.body["param"] == "prompt"
    fitted = client.completions.create(model=MODEL, prompt=prompt, **GREEDY)
    assert fitted.choices[0].text == out.choices[0].text
    assert (fitted.usage.total_tokens, fitted.choices[0].finish_reason) == (WINDOW, "length")
    served.wait_idle()


def test_softcapped_attention_logits_are_refused_at_start(tiny_dirs, tmp_path):
    model_dir = build_model(tmp_path / "g", "gemma2", tokenizer_dir=tiny_dirs["llama"])
    with pytest.raises(ValueError, match=r"gemma2: attn_logit_softcapping=50.0 is not implemented"):
        make_engine(model_dir)


def test_attention_sinks_are_refused_at_start(tiny_dirs, tmp_path):
    model_dir = build_model(
        tmp_path / "o", "gpt_oss", tokenizer_dir=tiny_dirs["llama"], num_local_experts=2
    )
    with pytest.raises(ValueError, match=r"gpt_oss: s_aux=.* \(attention sinks\) is not impl"):
        make_engine(model_dir)


@pytest.mark.parametrize(
    "config, message",
    [
        (FalconConfig(alibi=True), "falcon: alibi=True is not implemented"),
        (Llama4TextConfig(attention_chunk_size=64), "attention_chunk_size=64 is not impl"),
    ],
)
def test_config_features_no_path_implements_are_named(config, message):
    with pytest.raises(ValueError, match=message):
        check_config(config)


@pytest.mark.parametrize(
    "config, message",
    [  # Bloom attends (with ALiBi) by itself: served, it would see no KV cache
        (
            BloomConfig(vocab_size=64, hidden_size=64, n_layer=2, n_head=4),
            "bloom: 2 of its 2 layers do not attend through Tandem's paged attention",
        ),
        (  # StableLM's and Falcon's layers keep the keyword arguments from their attention
            StableLmConfig(vocab_size=64, hidden_size=64, num_hidden_layers=2),
            "stablelm: its forward fails on Tandem's paged attention: tandem_paged attention "
            "needs the `tandem_metadata`",
        ),
        (
            FalconConfig(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4),
            "falcon: its forward fails on Tandem's paged attention",
        ),
    ],
)
def test_a_model_whose_layers_bypass_the_paged_attention_is_refused(tmp_path, config, message):
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=re.escape(message)):
        ModelRunner(str(tmp_path), torch.device("cpu"), torch.float32)


class _Attn(torch.nn.Module):
    layer_idx = 0


def _attend(context: int, trees=None, **kwargs):
    """One request's 2 new tokens ending at `context`, through the paged attention."""
    caches = [(torch.zeros(4, 4, 1, 8), torch.zeros(4, 4, 1, 8))]
    md = attention.build_metadata(
        caches,
        4,
        [2],
        [context],
        [[0, 1, 2, 3]],
        torch.device("cpu"),
        BACKENDS["reference"],
        trees,
    )
    q, kv = torch.randn(1, 2, 2, 8), torch.randn(1, 1, 2, 8)
    return attention.paged_attention_forward(
        _Attn(), q, kv, kv, kwargs.pop("mask", None), tandem_metadata=md, **kwargs
    )


def test_the_paged_attention_refuses_what_changes_its_result():
    _attend(6, sliding_window=6, softcap=None, s_aux=None, is_causal=True)
    refused = {
        "softcap=50.0 (attention logit softcapping) is not implemented": {"softcap": 50.0},
        "s_aux=a (2,) tensor (attention sinks) is not implemented": {"s_aux": torch.zeros(2)},
        "sliding_window=5 is implemented only as a cap on the context, and a query here "
        "attends 6 keys": {"sliding_window": 5},
        "an attention mask or bias of the model's own": {"mask": torch.zeros(1, 1, 2, 6)},
        "bidirectional attention": {"is_causal": False},
    }
    for message, kwargs in refused.items():
        with pytest.raises(ValueError, match=re.escape(f"_Attn: {message}")):
            _attend(6, **kwargs)


def test_a_draft_tree_attends_only_its_ancestors():
    """Tree nodes past the window's width are fine while each sees few enough keys."""
    tree = attention.Tree(base=3, bits=[0b01, 0b10])  # siblings at slots 3 and 4
    assert attention.most_keys([2], [5], [tree]) == 4
    _attend(5, [tree], sliding_window=4)
    with pytest.raises(ValueError, match="attends 5 keys"):
        _attend(5, sliding_window=4)
