"""Structured output in the engine: grammar masks with speculation kept on.

The references are written apart from the engine: a loop over Hugging Face's forward that
masks each position with its own llguidance matcher (greedy), and the exact distribution of
the constrained continuations enumerated the same way (sampling).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import llguidance
import llguidance.hf
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine.config import SpecConfig
from engine.sample.grammar import grammar_text
from engine.types.request import JSON_STYLE, GrammarSpec, InvalidRequest, SamplingParams
from tests.engine_utils import drain, make_engine, random_prompts
from tests.test_speculative import _chi_square_test

SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "tag": {"type": "string", "enum": ["red", "green", "blue"]},
        "note": {"type": "string", "pattern": "^[a-z ]{0,6}$"},
    },
    "required": ["ok", "n", "tag", "note"],
    "additionalProperties": False,
}
GRAMMARS = {
    "json_schema": GrammarSpec("json_schema", json.dumps(SCHEMA)),
    "regex": GrammarSpec("regex", r"(yes|no), [0-9]{1,3}( apples)?"),
    "choice": GrammarSpec("choice", json.dumps(["red", "green", "blue", "re"])),
}
SPECS = {
    "off": None,
    "draft-fixed": lambda d: SpecConfig("draft", str(d), max_draft_tokens=3, draft_length="fixed"),
    "draft-adaptive": lambda d: SpecConfig("draft", str(d), max_draft_tokens=3),
    "ngram-fixed": lambda d: SpecConfig("ngram", max_draft_tokens=3, draft_length="fixed"),
}
MAX_TOKENS = 96


def _matcher(model_dir: Path, spec: GrammarSpec, vocab: int, eos: int):
    tok = AutoTokenizer.from_pretrained(model_dir)
    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab, eos_token=[eos])
    return llguidance.LLMatcher(lltok, grammar_text(spec))


def _allowed(matcher, vocab: int) -> torch.Tensor:
    bits = torch.tensor(list(matcher.compute_bitmask()), dtype=torch.uint8)
    shifts = torch.arange(8, dtype=torch.uint8)
    return (((bits[:, None] >> shifts) & 1).flatten()[:vocab]).bool()


def _constrained_greedy(model_dir: Path, prompt: list[int], spec: GrammarSpec) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    vocab, eos = model.config.vocab_size, model.config.eos_token_id
    matcher = _matcher(model_dir, spec, vocab, eos)
    out: list[int] = []
    while len(out) < MAX_TOKENS and not matcher.is_stopped():
        with torch.no_grad():
            logits = model(torch.tensor([prompt + out])).logits[0, -1]
        token = int(logits.masked_fill(~_allowed(matcher, vocab), float("-inf")).argmax())
        out.append(token)
        assert matcher.consume_token(token)
        if token == eos:
            break
    return out


@pytest.fixture(scope="module")
def references(tiny_dirs):
    prompts = random_prompts([5, 11, 17], 300, seed=7)
    return prompts, {
        (name, i): _constrained_greedy(tiny_dirs["llama"], p, spec)
        for name, spec in GRAMMARS.items()
        for i, p in enumerate(prompts)
    }


@pytest.mark.parametrize("spec", list(SPECS))
def test_greedy_constrained_output_equals_target_only_constrained_greedy(
    tiny_dirs, references, spec
):
    """Every grammar, several prompts at once beside an unconstrained request: speculation
    off, draft model with fixed and adaptive K, n-gram; the same tokens as the reference."""
    prompts, want = references
    config = SPECS[spec]
    engine = make_engine(
        tiny_dirs["llama"], spec=config(tiny_dirs["llama_draft"]) if config else None
    )
    for name, grammar in GRAMMARS.items():
        for i, prompt in enumerate(prompts):
            params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, grammar=grammar)
            engine.add_request(f"{name}-{i}", prompt, params)
    engine.add_request("free", prompts[0], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    outputs = drain(engine)
    tok = AutoTokenizer.from_pretrained(tiny_dirs["llama"])
    for (name, i), tokens in want.items():
        assert outputs[f"{name}-{i}"] == tokens, (name, i)
        if name == "json_schema":  # whole documents, each a valid one
            doc = json.loads(tok.decode(tokens))
            assert set(doc) == set(SCHEMA["properties"]) and doc["tag"] in ("red", "green", "blue")
    assert len(outputs["free"]) == MAX_TOKENS
    stats = engine.stats()
    if spec == "draft-fixed":
        assert stats.spec_accepted_tokens > 0
    # JSON keys and separators are forced: drafted by the grammar itself, spec off included.
    assert 0 < stats.grammar_forced_accepted <= stats.grammar_forced_drafted
    assert stats.grammar_seconds > 0


# --- sampling: the exact constrained distribution -------------------------------------

BRANCHING = r"[a-d][a-d]( ?[xy])?"
"""16 two-letter words, each maybe followed by x or y: the end of sequence competes with
going on, and several tokens may spell one text (" x" or " " then "x")."""
PROMPT = [5, 6, 7]


def _exact_constrained(model_dir: Path, spec: GrammarSpec) -> dict[tuple[int, ...], float]:
    """Every token sequence the grammar allows from PROMPT with its probability under the
    target at temperature 1, masked and renormalised at each position."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    vocab, eos = model.config.vocab_size, model.config.eos_token_id
    matcher = _matcher(model_dir, spec, vocab, eos)
    exact: dict[tuple[int, ...], float] = {}

    def extend(seq: tuple[int, ...], prob: float) -> None:
        if matcher.is_stopped():
            exact[seq] = prob
            return
        with torch.no_grad():
            logits = model(torch.tensor([PROMPT + list(seq)])).logits[0, -1]
        probs = torch.softmax(logits.masked_fill(~_allowed(matcher, vocab), float("-inf")), -1)
        for token in torch.nonzero(probs).flatten().tolist():
            assert matcher.consume_token(token)
            extend((*seq, token), prob * float(probs[token]))
            matcher.rollback(1)

    extend((), 1.0)
    return exact


@pytest.mark.parametrize("spec", ["draft-fixed", "ngram-fixed", "off"])
def test_constrained_sampling_follows_the_constrained_target(tiny_dirs, spec):
    """4000 samples (half of them seeded) against the exact constrained distribution."""
    grammar = GrammarSpec("regex", BRANCHING)
    exact = _exact_constrained(tiny_dirs["llama"], grammar)
    assert len(exact) > 16 * 3
    config = SPECS[spec]
    engine = make_engine(
        tiny_dirs["llama"],
        spec=config(tiny_dirs["llama_draft"]) if config else None,
        num_blocks=4096,
        max_num_seqs=256,
        max_num_batched_tokens=2048,
        max_waiting=4000,
        prefix_caching=False,
    )
    n = 4000
    params = SamplingParams(max_tokens=16, temperature=1.0, grammar=grammar)
    for i in range(n):
        engine.add_request(f"s{i}", PROMPT, params if i % 2 else replace(params, seed=i))
    counts: dict[tuple[int, ...], int] = {}
    for tokens in drain(engine).values():
        counts[tuple(tokens)] = counts.get(tuple(tokens), 0) + 1
    stat, bound = _chi_square_test(counts, exact, n)
    assert stat < bound, f"chi-square {stat:.1f} >= {bound:.1f}"
    if spec == "draft-fixed":
        stats = engine.stats()
        assert 0 < stats.spec_accepted_tokens < stats.spec_drafted_tokens


# --- the grammar state and its errors ---------------------------------------------------


def test_grammar_state_follows_drafts_rolls_back_and_refuses(tiny_dirs):
    engine = make_engine(tiny_dirs["llama"])
    tok = AutoTokenizer.from_pretrained(tiny_dirs["llama"])
    state = engine.grammars.state(GrammarSpec("regex", "ab(c|d)"))
    ids = [tok.convert_tokens_to_ids(c) for c in "abcd"]
    a, b, c, d = ids
    first = state.allowed([])
    assert first[a] and not first[b]
    assert state.allowed([a])[b] and not state.allowed([a])[a]
    after_ab = state.allowed([a, b])
    assert after_ab[c] and after_ab[d] and not after_ab[a]
    assert state.allowed([]) is first  # kept for the step: no second computation
    assert state.valid_prefix([a, b, a]) == 2 and state.valid_prefix([b]) == 0
    refused = state.allowed([b])  # after a refused draft only stopping fits
    assert refused.sum() == 1 and refused[tok.eos_token_id]
    assert not state.commit(b)  # refused, and the matcher is still usable
    assert state.commit(a) and state.commit(b) and not state.stopped
    assert state.allowed([])[d]
    assert state.commit(d) and state.stopped
    assert state.allowed([]).sum() == 1  # complete: only the end of sequence


@pytest.mark.parametrize(
    "spec, param",
    [
        (GrammarSpec("json_schema", '{"type": "strng"}'), "response_format"),
        (GrammarSpec("json_schema", "{not json", "structured_outputs"), "structured_outputs"),
        (GrammarSpec("regex", "(unclosed", "guided_regex"), "guided_regex"),
        (GrammarSpec("lark", "start: undefined_rule", "tools"), "tools"),
    ],
)
def test_a_grammar_that_does_not_compile_is_refused_naming_its_field(tiny_dirs, spec, param):
    engine = make_engine(tiny_dirs["llama"])
    params = SamplingParams(max_tokens=4, grammar=spec)
    with pytest.raises(InvalidRequest) as info:
        engine.add_request("bad", [5, 6], params)
    assert info.value.param == param and info.value.code == "invalid_grammar"
    assert not engine.has_work()


def test_json_style_is_what_json_dumps_writes():
    # The server's tool-call grammar embeds it; the engine compiles schemas with it.
    assert json.dumps({"a": [1, 2]}) == '{"a": [1, 2]}'
    assert JSON_STYLE == {
        "whitespace_flexible": False,
        "item_separator": ", ",
        "key_separator": ": ",
    }


def test_constrained_output_survives_preemption_trees_and_aborts(tiny_dirs, references):
    """A pool small enough to preempt constrained requests mid-document, a draft-tree config
    (constrained requests draft chains beside unconstrained trees) and an aborted constrained
    request: the same tokens as the reference, and every block back in the pool."""
    prompts, want = references
    spec = SpecConfig(
        "draft", str(tiny_dirs["llama_draft"]), max_draft_tokens=3, draft_length="fixed",
        draft_branches=2,
    )  # fmt: skip
    engine = make_engine(tiny_dirs["llama"], spec=spec, num_blocks=56, max_num_batched_tokens=64)
    for name, grammar in GRAMMARS.items():
        for i, prompt in enumerate(prompts):
            params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, grammar=grammar)
            engine.add_request(f"{name}-{i}", prompt, params)
    for j in range(3):  # unconstrained neighbours, drafting trees
        engine.add_request(f"free-{j}", prompts[j], SamplingParams(max_tokens=40, temperature=0.0))
    doomed = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, grammar=GRAMMARS["regex"])
    engine.add_request("doomed", prompts[0], doomed)
    outputs: dict[str, list[int]] = {}
    for _ in range(2):
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
    engine.abort("doomed")
    drain(engine, outputs)
    for (name, i), tokens in want.items():
        assert outputs[f"{name}-{i}"] == tokens, (name, i)
    stats = engine.stats()
    assert stats.preemptions > 0 and stats.spec_tree_steps > 0


def test_a_grammar_that_fails_mid_document_ends_its_request_with_a_grammar_error(tiny_dirs):
    """A grammar without a finite string compiles but cannot be followed: its request ends
    with error code invalid_grammar (the server's 400), its blocks back in the pool."""
    engine = make_engine(tiny_dirs["llama"])
    endless = GrammarSpec("lark", 'start: "a" start')
    engine.add_request("endless", [5, 6, 7], SamplingParams(max_tokens=20, grammar=endless))
    engine.add_request("fine", [5, 6, 7], SamplingParams(max_tokens=5, temperature=0.0))
    finals = {}
    while engine.has_work():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert finals["endless"].finish_reason == "error"
    assert finals["endless"].error_code == "invalid_grammar"
    assert finals["fine"].finish_reason == "length"
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_json_numbers_take_at_most_the_digit_limit_and_strings_any(tiny_dirs):
    """A number in JSON output stops at `number_digits` digits (the issue: a small model at
    temperature 0 writing `3.8182862020000000381...` until max_tokens); a string's digits and
    a grammar without a limit are untouched; drafts (`prior`) count as committed tokens do."""
    engine = make_engine(tiny_dirs["llama"])
    tok = AutoTokenizer.from_pretrained(tiny_dirs["llama"])

    def ids(text: str) -> list[int]:
        return [tok.convert_tokens_to_ids("Ġ" if c == " " else c) for c in text]

    schema = {
        "type": "object",
        "properties": {"n": {"type": "number"}, "s": {"type": "string"}},
        "required": ["n", "s"],
    }
    spec = GrammarSpec("json_schema", json.dumps(schema), number_digits=5)
    five, six, dot, exp, comma = ids("56.e,")

    def mask(text: str, limit: int = 5, committed: int = 0) -> torch.Tensor:
        state = engine.grammars.state(replace(spec, number_digits=limit))
        tokens = ids(text)
        for token in tokens[:committed]:
            assert state.commit(token)
        return state.allowed(tokens[committed:])

    for committed in (0, 9):  # all drafts, or the object's start committed
        four = mask('{"n": 1234', committed=committed)
        assert four[five] and four[dot] and four[comma]  # a fifth digit, or `.` then one
        full = mask('{"n": 12345', committed=committed)
        assert not full[six] and not full[dot] and not full[exp] and full[comma]
        point = mask('{"n": 1234.', committed=committed)
        assert point[five] and not point[exp]  # the digit `.` needs, and only it
    assert mask('{"n": 12345', limit=0)[six]  # no limit
    assert mask('{"n": 1, "s": "1234567')[six]  # in a string
