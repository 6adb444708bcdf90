"""Architectures served through transformers' forward on Tandem's paged attention (no native
forward): a tiny random model of each gives transformers' generate() greedy text. What this
and tests/test_attention_features.py run is the list docs/ARCHITECTURE.md gives."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

from tests.engine_utils import drain, greedy, hf_greedy, make_engine, random_prompts

SHAPE = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 128,
    "max_position_embeddings": 128,
    "bos_token_id": None,
    "tie_word_embeddings": False,
}
GQA = {"num_key_value_heads": 2}
FAMILIES = {
    "gemma": {**GQA, "head_dim": 16},
    "phi3": {**GQA, "pad_token_id": None},
    "starcoder2": GQA,
    "olmo2": GQA,
    "granite": GQA,
    "cohere": GQA,
    "smollm3": GQA,
    "mixtral": {**GQA, "num_local_experts": 2, "num_experts_per_tok": 1},
    "qwen2_moe": {
        **GQA,
        "num_experts": 2,
        "num_experts_per_tok": 1,
        "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 64,
    },
    "cohere2": {**GQA, "sliding_window": 32},
    "gpt_neox": {"rotary_pct": 0.5},
    "phi": {},
    "gpt2": {},
    "opt": {"ffn_dim": 128, "word_embed_proj_dim": 64},
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_tiny_model_serves_generate(tiny_dirs, tmp_path, family):
    tokenizer = PreTrainedTokenizerFast.from_pretrained(tiny_dirs["llama"])
    tokenizer.save_pretrained(tmp_path)
    ids = {"pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id}
    config = AutoConfig.for_model(
        family, vocab_size=len(tokenizer), **SHAPE, **{**ids, **FAMILIES[family]}
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # sharper logits: no near-ties for rounding to flip
        model.get_output_embeddings().weight.mul_(8.0)
    model.save_pretrained(tmp_path)
    engine = make_engine(tmp_path)
    assert engine.runner.model_impl == "transformers"
    prompts = random_prompts([5, 11], vocab=engine.vocab_size, seed=1)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, greedy(20))
    got = drain(engine)
    assert [got[str(i)] for i in range(len(prompts))] == hf_greedy(tmp_path, prompts, 20)
