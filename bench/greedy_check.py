"""The benchmark's correctness check: Tandem's greedy output against HF plain generate().

Both run the same weights in the same dtype on the same prompts; Tandem ignores EOS, and
the reference neither stops at nor masks it, so both produce exactly `tokens` tokens. On a
GPU, kernels that sum in another order may flip a near-tied argmax, after which the two
continuations differ for good; the length of the agreeing prefix says how soon that came,
and the reference's logit gap at the first difference (its own pick's logit minus Tandem's
pick's) whether it was such a tie. Speculation must not change Tandem's own output at all:
`compare(got, off)` against Tandem with speculation off says whether it did.
"""

from __future__ import annotations

import torch

from engine.core.engine import LLMEngine
from engine.types.request import SamplingParams


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


def first_difference(got: list[int], want: list[int]) -> int | None:
    """The first position where the two differ (a shorter one ends there), or None."""
    n = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None)
    if n is None and len(got) != len(want):
        return min(len(got), len(want))
    return n


@torch.inference_mode()
def logit_gap(model, prompt: list[int], want: list[int], got: list[int], n: int) -> float:
    """The reference's logit of its token at position n minus its logit of Tandem's token
    there, in float32 from the model's own logits (0 would be an exact tie)."""
    ids = torch.tensor([prompt + want[:n]], device=model.device)
    logits = model(ids).logits[0, -1].float()
    return float(logits[want[n]] - logits[got[n]])


def compare(got: list[list[int]], want: list[list[int]], prompts=None, model=None) -> dict:
    """Token-identical or not, and how far each output agrees before its first difference;
    with the reference `model` and the `prompts`, the logit gap at each first difference
    (`differences`: prompt index, position, gap)."""
    agree, differences = [], []
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        n = first_difference(g, w)
        agree.append(min(len(g), len(w)) if n is None else n)
        if n is not None and model is not None and n < min(len(g), len(w)):
            gap = logit_gap(model, prompts[i], w, g, n)
            differences.append({"prompt": i, "position": n, "logit_gap": gap})
    out = {
        "greedy_match": got == want,
        "prompts": len(want),
        "tokens_each": len(want[0]) if want else 0,
        "agreeing_prefix_mean": sum(agree) / max(len(agree), 1),
    }
    if model is not None:
        out["differences"] = differences
    return out
