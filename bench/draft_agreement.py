"""How often a feature draft (models/eagle) predicts the target's greedy token, outside the engine.

  python -m bench.draft_agreement [--draft models/eagle] [--requests 24] [--max-tokens 96]

The target (the default GGUF, dequantized, float32, transformers) answers the benchmarks'
held-out chat prompts greedily. The draft then runs teacher-forced on those answers as
scripts/train_eagle.py trains it: depth 1 at every answer position from the target's own
features, depth 2 from its depth-1 prediction. Printed:
- per-position agreement with the target's argmax over the whole vocabulary, by depth
  (what training's held-out agreement measures, on the benchmarks' prompts);
- the first-draft acceptance and tokens per verifying pass a greedy chain of K = 1 and K = 2
  would get walking those answers (an accepted draft's next position is the target's bonus
  token, so it is never drafted: hard stretches are drafted more often than easy ones).
The second part is what `python -m bench.default_engine speed --draft models/eagle` measures
in the engine; the two agree when the engine serves the draft as trained.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from bench.default_engine import TARGET, _prompts
from engine.model.files import prepare
from engine.model.head import HEAD_TOKENS_FILE
from scripts.train_eagle import FeatureDraft


def walk(first: list[bool], second: list[bool], k: int) -> tuple[int, int]:
    """(first drafts accepted, verifying passes: one first draft each) of a greedy chain of
    length k over one answer; first[j] / second[j]: depth 1 / 2 predicted answer token j."""
    accepted = passes = j = 0
    while j < len(first):
        passes += 1
        if not first[j]:
            j += 1  # the target's correction
            continue
        accepted += 1
        if k >= 2 and j + 1 < len(first) and second[j + 1]:
            j += 3  # two drafts and the bonus token
        else:
            j += 2  # one draft and the bonus (K = 1) or the correction
    return accepted, passes


@torch.inference_mode()
def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--draft", default="models/eagle")
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--max-tokens", type=int, default=96)
    args = p.parse_args(argv)
    target_dir = str(prepare(TARGET))
    config = AutoConfig.from_pretrained(target_dir)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    draft = FeatureDraft.load(args.draft)
    head = torch.tensor(json.loads((Path(args.draft) / HEAD_TOKENS_FILE).read_text())["token_ids"])
    head_rows = target.lm_head.weight[head].to(torch.bfloat16).float()  # as served
    embedding = target.model.embed_tokens.weight
    theta = config.rope_parameters["rope_theta"]
    agree, total = [0, 0], [0, 0]
    walks = {1: [0, 0], 2: [0, 0]}
    answer_tokens = 0
    for prompt in _prompts(target_dir, args.requests):
        out = target.generate(torch.tensor([prompt]), max_new_tokens=args.max_tokens,
                              do_sample=False)  # fmt: skip
        ids = out[:, : out.shape[1] - 1]  # the last token predicts nothing we check
        n, start = out.shape[1], len(prompt)
        features = target.model(input_ids=ids).last_hidden_state
        want = out[0, start:]  # greedy: the answer token is the target's argmax
        by_depth = []
        for d, predicted in enumerate(draft.unrolled(embedding[ids], features, 2, theta)):
            picks = head[(predicted[0] @ head_rows.T).argmax(-1)]
            # row q predicts token q + 1; answer token j is token start + j
            rows = picks[start - 1 :]
            hit = (rows == want).tolist()
            valid = hit[d:]  # depth 2's first row has no depth-1 prediction before it
            agree[d] += sum(valid)
            total[d] += len(valid)
            by_depth.append([False] * d + valid)
        answer_tokens += n - start
        for k, sums in walks.items():
            for i, v in enumerate(walk(by_depth[0], by_depth[1], k)):
                sums[i] += v
    print(f"{args.requests} held-out prompts, {answer_tokens} greedy answer tokens, "
          f"draft {args.draft}")  # fmt: skip
    for d in range(2):
        print(f"  depth {d + 1} agreement: {agree[d]} of {total[d]} = {agree[d] / total[d]:.3f}")
    for k, (acc, passes) in walks.items():
        print(f"  K = {k}: first drafts accepted {acc} of {passes} = {acc / passes:.3f}, "
              f"tokens per verifying pass {answer_tokens / passes:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
