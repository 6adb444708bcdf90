"""Tiny random Hugging Face models built on the fly: no hub, no network.

`build_tokenizer` trains a byte-level BPE on a few lines of text (well under a second) and
`build_model` saves a random model of a given family next to it, so every test gets a real
`AutoModelForCausalLM` directory with a real tokenizer and chat template.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    GptOssConfig,
    LlamaConfig,
    MistralConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i * i)\n",
    "The quick brown fox jumps over the lazy dog. Héllo wörld ✓ 日本語 😀",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "import os\nimport sys\n\nif __name__ == '__main__':\n    main()\n",
]
DRAFT_SHAPE = {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1}
"""The tiny draft model's shape beside the default tiny target."""
FAMILIES = {
    "llama": LlamaConfig,
    "qwen2": Qwen2Config,
    "qwen3": Qwen3Config,
    "mistral": MistralConfig,
    "gemma2": Gemma2Config,  # attention logit softcapping (refused), final softcapping
    "gemma3": Gemma3TextConfig,
    "gpt_oss": GptOssConfig,  # attention sinks (refused)
}


def build_tokenizer(out_dir: Path, vocab_size: int = 320) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 20, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    return fast


def build_model(
    out_dir: Path,
    family: str = "llama",
    *,
    seed: int = 0,
    vocab_size: int | None = None,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    max_positions: int = 256,
    tokenizer_dir: Path | None = None,
    **config_changes: object,
) -> Path:
    """Save a random `family` model (and a tokenizer) into out_dir; return out_dir.
    config_changes: more settings of the family's config (`sliding_window=16`)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if tokenizer_dir is None:
        tokenizer = build_tokenizer(out_dir)
    else:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)
        tokenizer.save_pretrained(out_dir)
    config = FAMILIES[family](
        vocab_size=vocab_size or len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        head_dim=hidden_size // num_heads,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_positions,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        tie_word_embeddings=False,
        **config_changes,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    # Random init gives near-uniform logits; sharpen them so greedy paths are well defined
    # (ties between argmax candidates would make "equal output" depend on rounding).
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(out_dir)
    return out_dir


def build_feature_draft(
    out_dir: Path, target_dir: Path, *, seed: int = 0, head_tokens: list[int] | None = None
):
    """A random feature draft (EAGLE) for the model in target_dir, written as
    scripts/train_eagle.py writes a trained one; returns (out_dir, the training-side module
    holding exactly the saved, bfloat16-rounded weights)."""
    from transformers import AutoConfig

    from engine.spec.proposers.eagle import feature_draft_config
    from scripts.train_eagle import FeatureDraft, write_draft

    config = AutoConfig.from_pretrained(target_dir)
    torch.manual_seed(seed)
    model = FeatureDraft(feature_draft_config(config, 2 * config.hidden_size))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:  # norms: not all ones, so a swapped norm would show
                p.uniform_(0.5, 1.5)
            p.copy_(p.to(torch.bfloat16).float())  # what the file holds
    write_draft(model, Path(out_dir), head_tokens)
    return Path(out_dir), model
