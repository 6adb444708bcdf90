"""Engine core on tiny random models: correctness against transformers, batching, KV pool."""

from __future__ import annotations

from dataclasses import fields

import pytest
import torch

from engine.config import SpecConfig
from engine.types.request import SamplingParams
from engine.types.stats import EngineStats
from tests.engine_utils import drain, greedy, hf_greedy, make_engine, random_prompts

LENGTHS = [1, 3, 5, 7, 9, 12, 15, 17, 20, 24, 31, 33, 40, 47, 55, 64]
MAX_TOKENS = 16


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_greedy_matches_transformers_with_requests_joining_mid_decode(tiny_dirs, family):
    model = tiny_dirs[family]
    prompts = random_prompts(LENGTHS, vocab=300, seed=1)
    expected = hf_greedy(model, prompts, MAX_TOKENS)
    # Block size 4 so sequences span many blocks; a small budget forces chunked prefill.
    engine = make_engine(model, block_size=4, max_num_batched_tokens=48)
    outputs: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts[:8]):
        engine.add_request(f"r{i}", prompt, greedy(MAX_TOKENS))
    for _ in range(3):  # the first half is mid-decode when the rest arrive
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        engine.check_invariants()
    for i, prompt in enumerate(prompts[8:], start=8):
        engine.add_request(f"r{i}", prompt, greedy(MAX_TOKENS))
    drain(engine, outputs)
    for i in range(len(prompts)):
        assert outputs[f"r{i}"] == expected[i], f"request {i} (prompt length {LENGTHS[i]})"


def test_mistral_family_runs(tiny_dirs):
    model = tiny_dirs["mistral"]
    prompts = random_prompts([6, 19], vocab=300, seed=2)
    engine = make_engine(model)
    for i, p in enumerate(prompts):
        engine.add_request(f"m{i}", p, greedy(8))
    outputs = drain(engine)
    assert [outputs["m0"], outputs["m1"]] == hf_greedy(model, prompts, 8)


def _sample(seed: int, max_tokens: int = 12) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, top_p=0.9, seed=seed)


def test_seeded_sampling_is_independent_of_the_batch(tiny_dirs):
    prompt = random_prompts([10], vocab=300, seed=3)[0]
    alone = make_engine(tiny_dirs["llama"])
    alone.add_request("x", prompt, _sample(1234))
    solo = drain(alone)["x"]

    busy = make_engine(tiny_dirs["llama"])
    for i, p in enumerate(random_prompts([4, 8, 30, 2, 17], vocab=300, seed=4)):
        busy.add_request(f"other{i}", p, _sample(i))
    busy.step()
    busy.add_request("x", prompt, _sample(1234))
    busy.add_request("y", prompt, _sample(99))
    outputs = drain(busy)
    assert outputs["x"] == solo
    assert outputs["y"] != solo  # another seed takes another path


def test_preemption_under_a_small_pool_keeps_outputs_correct(tiny_dirs):
    model = tiny_dirs["llama"]
    prompts = random_prompts([20, 25, 30, 18, 22, 27], vocab=300, seed=5)
    expected = hf_greedy(model, prompts, 20)
    # 6 requests need about 6 * 12 blocks of 4 tokens; give the pool far fewer.
    engine = make_engine(model, block_size=4, num_blocks=30)
    for i, p in enumerate(prompts):
        engine.add_request(f"p{i}", p, greedy(20))
    outputs = drain(engine)
    assert engine.stats().preemptions > 0
    assert [outputs[f"p{i}"] for i in range(len(prompts))] == expected


def test_abort_frees_blocks(tiny_dirs):
    engine = make_engine(tiny_dirs["llama"])
    for i, p in enumerate(random_prompts([12, 30, 5], vocab=300, seed=6)):
        engine.add_request(f"a{i}", p, greedy(50))
    engine.step()
    engine.step()
    assert engine.kv.num_free_blocks < engine.kv.num_blocks
    out = engine.abort("a1")
    assert out is not None and out.finished and out.finish_reason == "abort"
    assert engine.abort("a1") is None  # idempotent
    engine.check_invariants()
    engine.abort("a0")
    engine.abort("a2")
    assert not engine.has_work()
    engine.check_invariants()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_shared_prompt_prefix_shares_blocks(tiny_dirs):
    model = tiny_dirs["llama"]
    prefix = random_prompts([24], vocab=300, seed=7)[0]
    prompts = [prefix + [5, 6, 7], prefix + [9, 10]]
    expected = hf_greedy(model, prompts, 10)
    engine = make_engine(model, block_size=4)
    outputs: dict[str, list[int]] = {}

    def step() -> None:
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)

    engine.add_request("first", prompts[0], greedy(10))
    step()  # prefill: the prefix's full blocks are now hashed
    engine.add_request("second", prompts[1], greedy(10))
    step()
    first, second = engine.kv.block_table("first"), engine.kv.block_table("second")
    shared = [b for b in second if b in first]
    assert len(shared) == 24 // 4
    assert all(engine.kv.pool.ref_cnt[b] == 2 for b in shared)
    assert engine.scheduler.running[1].num_cached_tokens == 24
    assert engine.stats().prefix_cache_hit_tokens == 24
    drain(engine, outputs)
    assert [outputs["first"], outputs["second"]] == expected
    # Prompt tokens computed: both prompts but the 24 the second found cached, none of the
    # decode steps' tokens.
    stats = engine.stats()
    assert stats.prompt_tokens == len(prompts[0]) + len(prompts[1]) - 24
    assert stats.generation_tokens == 20


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ([], SamplingParams(max_tokens=4), "empty"),
        ([1] * 300, SamplingParams(max_tokens=4), "context length"),
        ([1, 2, 100000], SamplingParams(max_tokens=4), "out of range"),
        ([1, 2, -1], SamplingParams(max_tokens=4), "out of range"),
        ([1, 2], SamplingParams(max_tokens=0), "max_tokens"),
        ([1, 2], SamplingParams(max_tokens=4, temperature=-1), "temperature"),
        ([1, 2], SamplingParams(max_tokens=4, top_p=0), "top_p"),
        ([1, 2], SamplingParams(max_tokens=4, logit_bias=((5, 101.0),)), "logit_bias values"),
        ([1, 2], SamplingParams(max_tokens=4, logit_bias=((100000, 1.0),)), "logit_bias: token"),
        ([1, 2], SamplingParams(max_tokens=4, logit_bias=((-1, 1.0),)), "logit_bias: token"),
    ],
)
def test_bad_input_raises_and_engine_keeps_serving(tiny_dirs, prompt, params, message):
    engine = make_engine(tiny_dirs["llama"])
    engine.add_request("good", [4, 5, 6], greedy(4))
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", prompt, params)
    outputs = drain(engine)
    assert len(outputs["good"]) == 4


def test_stop_token_and_min_tokens(tiny_dirs):
    model = tiny_dirs["llama"]
    prompt = random_prompts([8], vocab=300, seed=8)[0]
    reference = hf_greedy(model, [prompt], 12)[0]
    stop = reference[3]
    first = reference.index(stop)
    engine = make_engine(model)
    engine.add_request(
        "s", prompt, SamplingParams(max_tokens=12, temperature=0, stop_token_ids=(stop,))
    )
    engine.add_request(
        "m",
        prompt,
        SamplingParams(max_tokens=12, temperature=0, stop_token_ids=(stop,), min_tokens=first + 2),
    )
    finish = {}
    tokens: dict[str, list[int]] = {}
    while engine.has_work():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                finish[out.request_id] = out.finish_reason
    assert tokens["s"] == reference[: first + 1] and finish["s"] == "stop"
    assert stop not in tokens["m"][: first + 2]  # masked while under min_tokens
    engine.check_invariants()


@pytest.mark.parametrize(
    ("prompt_len", "budget", "draft"),
    [(6, 128, False), (40, 16, False), (40, 16, True)],
    ids=["one-chunk", "three-chunks", "three-chunks-with-a-draft"],
)
def test_logprobs_match_the_model(tiny_dirs, prompt_len, budget, draft):
    """Prompt logprobs put together from every prefill chunk, and the sampled tokens'."""
    model = tiny_dirs["llama"]
    prompt = random_prompts([prompt_len], vocab=300, seed=9)[0]
    spec = SpecConfig("draft", str(tiny_dirs["llama_draft"]), 2, "fixed") if draft else None
    engine = make_engine(model, spec=spec, max_num_batched_tokens=budget)
    engine.add_request(
        "l",
        prompt,
        SamplingParams(max_tokens=3, temperature=0, logprobs=2, prompt_logprobs=1, ignore_eos=True),
    )
    outs = []
    while engine.has_work():
        outs += engine.step()
    tokens = [t for o in outs for t in o.new_token_ids]
    logprobs = [lp for o in outs for lp in (o.new_logprobs or [])]
    assert len(logprobs) == 3 and [lp.token_id for lp in logprobs] == tokens
    assert all(len(lp.top) == 2 and lp.top[0][0] == lp.token_id for lp in logprobs)  # greedy
    assert sum(o.prompt_logprobs is not None for o in outs) == 1  # sent once, complete
    prompt_lps = outs[0].prompt_logprobs
    assert prompt_lps is not None and len(prompt_lps) == len(prompt) and prompt_lps[0] is None
    hf = torch.log_softmax(_hf_logits(model, prompt + tokens), dim=-1)
    for pos in range(1, len(prompt)):
        assert prompt_lps[pos].logprob == pytest.approx(hf[pos - 1, prompt[pos]].item(), abs=1e-4)
    for i, lp in enumerate(logprobs):
        assert lp.logprob == pytest.approx(hf[len(prompt) - 1 + i, tokens[i]].item(), abs=1e-4)


def _hf_logits(model_dir, tokens):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0]


@pytest.mark.gpu
def test_reference_attention_on_cuda_gives_transformers_greedy_tokens(tiny_dirs):
    """The reference backend on CUDA, in float32 (bfloat16 would compare two roundings of a
    random tiny model's near-ties; the Triton default has its own tests)."""
    model = tiny_dirs["qwen2"]
    prompts = random_prompts(LENGTHS, vocab=300, seed=1)
    expected = hf_greedy(model, prompts, MAX_TOKENS)
    engine = make_engine(model, device="cuda", dtype="float32", attention_backend="reference")
    for i, p in enumerate(prompts):
        engine.add_request(f"g{i}", p, greedy(MAX_TOKENS))
    outputs = drain(engine)
    assert [outputs[f"g{i}"] for i in range(len(prompts))] == expected


def test_a_stats_snapshot_shares_no_container_with_the_live_stats():
    """AsyncEngine publishes `stats().snapshot()` after every step for other threads to read:
    every list or dict field must be a copy, or the next step would change a published one."""
    live = EngineStats(
        spec_drafted_by_position=[3, 2],
        spec_accepted_by_position=[2, 1],
        draft_length_reasons={"cost": 4},
        speed_of_light={"tokens_per_s": 1.0},
    )
    snap = live.snapshot()
    containers = 0
    for f in fields(EngineStats):
        value = getattr(live, f.name)
        assert getattr(snap, f.name) == value, f.name
        if isinstance(value, (list, dict)):
            containers += 1
            assert getattr(snap, f.name) is not value, f.name
    assert containers >= 4
