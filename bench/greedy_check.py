"""The benchmark's correctness check: Tandem's greedy output against HF plain generate().

Both run the same weights in the same dtype on the same prompts; Tandem ignores EOS, and
the reference neither stops at nor masks it, so both produce exactly `tokens` tokens. On a
GPU, kernels that sum in another order may flip a near-tied argmax, after which the two
continuations differ for good; the length of the agreeing prefix says how soon that came.
"""

from __future__ import annotations

import torch

from engine.core.engine import LLMEngine
from engine.core.request import SamplingParams


@torch.inference_mode()
def hf_greedy(model, prompt: list[int], tokens: int) -> list[int]:
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(
        ids, max_new_tokens=tokens, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    return out[0, len(prompt) :].tolist()


def tandem_greedy(
    engine: LLMEngine, tag: str, prompts: list[list[int]], tokens: int
) -> list[list[int]]:
    """All prompts at once (the batched paths are the ones worth checking)."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts, strict=True):
        engine.add_request(rid, prompt, params)
    out: dict[str, list[int]] = {}
    while engine.has_work():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return [out.get(rid, []) for rid in ids]


def compare(got: list[list[int]], want: list[list[int]]) -> dict:
    """Token-identical or not, and how far each output agrees before its first difference."""
    agree = []
    for g, w in zip(got, want, strict=True):
        n = next((i for i, (a, b) in enumerate(zip(g, w, strict=False)) if a != b), None)
        agree.append(min(len(g), len(w)) if n is None else n)
    return {
        "greedy_match": got == want,
        "prompts": len(want),
        "tokens_each": len(want[0]) if want else 0,
        "agreeing_prefix_mean": sum(agree) / max(len(agree), 1),
    }
