"""Structured output: grammars compiled by llguidance (once per spec, cached), one matcher per
constrained request, masking every sampled row (docs/STRUCTURED_OUTPUT.md)."""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from engine.types.request import JSON_STYLE, GrammarSpec, InvalidRequest

CACHE_SIZE = 256


def available() -> bool:
    try:
        import llguidance  # noqa: F401
    except ImportError:
        return False
    return True


def grammar_text(spec: GrammarSpec) -> str:
    """The spec in llguidance's own grammar format (not yet checked)."""
    from llguidance import LLMatcher

    if spec.kind == "json_schema":
        return LLMatcher.grammar_from_json_schema(spec.source, overrides=JSON_STYLE)
    if spec.kind == "json_object":
        return LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_STYLE)
    if spec.kind == "regex":
        return LLMatcher.grammar_from_regex(spec.source)
    if spec.kind == "choice":  # Lark string literals take JSON's escapes
        choices = json.loads(spec.source)
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
    return LLMatcher.grammar_from_lark(spec.source)


_NUMBER_CHARS = frozenset(b"0123456789.eE+-")
_OPEN_ENDS = frozenset(b".eE+-")  # a number ending here needs another digit


def _json_scan(text: bytes, state: tuple[bool, bool, int]) -> tuple[bool, bool, int]:
    """(in a string, after a backslash in it, digits of the number being written) after `text`."""
    in_string, escaped, digits = state
    for c in text:
        if in_string:
            escaped = not escaped and c == 0x5C
            in_string = escaped or c != 0x22
            digits = 0
        elif c == 0x22:
            in_string, digits = True, 0
        elif c in _NUMBER_CHARS:
            digits += 0x30 <= c <= 0x39
        else:
            digits = 0
    return in_string, escaped, digits


class NumberDigits:
    """Per token, the digits it adds to a number being written (+1 if it leaves it open: `1.`)."""

    def __init__(self, token_bytes: Sequence[bytes]) -> None:
        cost = np.zeros(len(token_bytes), dtype=np.int32)
        for i, text in enumerate(token_bytes):
            lead = 0
            while lead < len(text) and text[lead] in _NUMBER_CHARS:
                lead += 1
            cost[i] = sum(0x30 <= c <= 0x39 for c in text[:lead])
            cost[i] += lead == len(text) > 0 and text[-1] in _OPEN_ENDS
        self.cost = torch.from_numpy(cost)
        self.most = int(cost.max(initial=0))


class Grammars:
    """Compiles grammar specs against the model's tokenizer and hands out matchers."""

    def __init__(self, tokenizer_dir: str, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self.tokenizer_dir = tokenizer_dir
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.seconds = 0.0
        """Time spent computing masks and moving matchers (the engine reports it)."""
        self._tokenizer: Any = None
        self._number_digits: NumberDigits | None = None
        self._compiled: OrderedDict[GrammarSpec, Any] = OrderedDict()  # spec: matcher | error
        self._lock = threading.Lock()

    def check(self, spec: GrammarSpec) -> Any:
        """`spec`'s matcher, compiled once; InvalidRequest naming its field if it does not
        compile. Slow for a large schema: call it off an event loop."""
        compiled = self._compile(spec)
        if isinstance(compiled, str):
            first_line = (compiled.strip().splitlines() or ["unknown error"])[0]
            raise InvalidRequest(
                f"The grammar does not compile: {first_line}", spec.param, "invalid_grammar"
            )
        return compiled

    def state(self, spec: GrammarSpec) -> GrammarState:
        # Found compiled: the server checked it off its event loop.
        return GrammarState(self.check(spec).deep_copy(), self, spec.number_digits)

    def token_bytes(self, token: int) -> bytes:
        return bytes(self._llg_tokenizer().decode_bytes([token]))

    def number_digits(self) -> NumberDigits:
        if self._number_digits is None:  # built once, for the first request with a limit
            vocab = range(self.vocab_size)
            self._number_digits = NumberDigits([self.token_bytes(t) for t in vocab])
        return self._number_digits

    def _compile(self, spec: GrammarSpec) -> Any:
        with self._lock:
            if spec in self._compiled:
                self._compiled.move_to_end(spec)
                return self._compiled[spec]
        if not available():
            return "structured output needs the llguidance package, which is not installed"
        from llguidance import LLMatcher

        compiled: Any
        try:
            text = grammar_text(spec)
            tokenizer = self._llg_tokenizer()
            is_error, messages = LLMatcher.validate_grammar_with_warnings(text, tokenizer)
            compiled = messages[0] if is_error else LLMatcher(tokenizer, text, log_level=0)
            if not isinstance(compiled, str):
                compiled = _first_mask_problem(compiled) or compiled
        except (ValueError, TypeError, RuntimeError) as exc:  # e.g. a schema that is not JSON
            compiled = str(exc) or type(exc).__name__
        with self._lock:
            self._compiled[spec] = compiled
            while len(self._compiled) > CACHE_SIZE:
                self._compiled.popitem(last=False)
        return compiled

    def _llg_tokenizer(self) -> Any:
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf
                from transformers import AutoTokenizer

                hf = AutoTokenizer.from_pretrained(self.tokenizer_dir)
                self._tokenizer = llguidance.hf.from_tokenizer(
                    hf, n_vocab=self.vocab_size, eos_token=list(self.eos_token_ids)
                )
            return self._tokenizer


def _first_mask_problem(matcher: Any) -> str | None:
    """Why a compiled grammar cannot start (its first mask fails or is empty), or None."""
    probe = matcher.deep_copy()
    mask = probe.compute_bitmask()
    if probe.is_error():
        return probe.get_error()
    if not any(mask):
        return "the grammar matches no text at all"
    return None


class GrammarState:
    """One request's matcher: at the committed output plus `drafts` (consumed for a mask)."""

    def __init__(self, matcher: Any, grammars: Grammars, digit_limit: int = 0) -> None:
        self.matcher = matcher
        self.grammars = grammars
        self.digit_limit = digit_limit
        self.json_state = (False, False, 0)  # _json_scan's, after the committed output
        self.drafts: list[int] = []
        self._masks: dict[tuple[int, ...], torch.Tensor] = {}
        self._forced: list[int] | None = None
        self.failure: str | None = None
        """Set at llguidance's first (permanent) error; the request ends with it."""

    def _check_error(self) -> bool:
        if self.failure is None and self.matcher.is_error():
            self.failure = f"the grammar engine failed: {self.matcher.get_error()}"
        return self.failure is not None

    @property
    def stopped(self) -> bool:
        """The grammar is complete and nothing may follow (the request is done)."""
        return bool(self.drafts == [] and self.matcher.is_stopped())

    def allowed(self, prior: Sequence[int]) -> torch.Tensor:  # [vocab] bool, on the CPU
        """The tokens allowed after the output plus `prior` (this step's drafts), kept for the
        step: the draft and the target ask alike."""
        key = tuple(prior)
        mask = self._masks.get(key)
        if mask is None:
            start = time.perf_counter()
            mask = self._compute(key)
            self._masks[key] = mask
            self.grammars.seconds += time.perf_counter() - start
        return mask

    def _compute(self, prior: tuple[int, ...]) -> torch.Tensor:
        vocab = self.grammars.vocab_size
        bits = np.zeros(vocab, dtype=bool)
        if not self._check_error() and self._seek(prior) and not self._check_error():
            packed = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
            if not self._check_error():
                bits = np.unpackbits(packed, bitorder="little")[:vocab].astype(bool)
        if self.digit_limit and bits.any():
            bits = self._cap_digits(prior, bits)
        # Nothing allowed (past the end, a refused draft, a failure): only stopping fits.
        if not bits.any():
            bits[list(self.grammars.eos_token_ids)] = True
        return torch.from_numpy(bits)

    def _cap_digits(self, prior: tuple[int, ...], bits: np.ndarray) -> np.ndarray:
        """`bits` less what takes the number past the digit limit, unless that leaves none."""
        state = self.json_state
        for token in prior:
            state = _json_scan(self.grammars.token_bytes(token), state)
        in_string, _, digits = state
        if in_string or digits + (self.grammars.number_digits().most) <= self.digit_limit:
            return bits
        capped = bits & (self.grammars.number_digits().cost <= self.digit_limit - digits).numpy()
        return capped if capped.any() else bits

    def _seek(self, prior: tuple[int, ...]) -> bool:
        """Seek the output plus `prior`; False if refused (then at the longest prefix taken)."""
        common = 0
        for a, b in zip(self.drafts, prior, strict=False):
            if a != b:
                break
            common += 1
        if len(self.drafts) > common:
            self.matcher.rollback(len(self.drafts) - common)
            del self.drafts[common:]
        rest = list(prior[common:])
        if not rest:
            return True
        # validate first: a refused token would leave the matcher in an error state for good
        taken = self.matcher.validate_tokens(rest)
        if taken:
            self.matcher.consume_tokens(rest[:taken])
            self.drafts.extend(rest[:taken])
        return taken == len(rest)

    def forced(self) -> list[int]:
        """The tokens the grammar forces next (a JSON key after `{`, its `": "`...): drafts
        that cost no draft model, accepted wherever the grammar allows nothing else."""
        if self._forced is None:
            start = time.perf_counter()
            self._forced = []
            if not self._check_error():
                self._seek(())
                self._forced = list(self.matcher.compute_ff_tokens())
                self._check_error()
            self.grammars.seconds += time.perf_counter() - start
        return self._forced

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of `tokens` (drafts after the output) the grammar takes in a row."""
        start = time.perf_counter()
        if self._check_error():
            return 0
        self._seek(())
        taken = self.matcher.validate_tokens(list(tokens)) if tokens else 0
        self.grammars.seconds += time.perf_counter() - start
        return taken

    def commit(self, token: int) -> bool:
        """Append an emitted token; False if the grammar refuses it."""
        start = time.perf_counter()
        self._masks.clear()
        self._forced = None
        if self.digit_limit:
            self.json_state = _json_scan(self.grammars.token_bytes(token), self.json_state)
        ok = False
        if not self._check_error():
            self._seek(())
            ok = self.matcher.validate_tokens([token]) == 1 and self.matcher.consume_token(token)
            ok = ok and not self._check_error()
        self.grammars.seconds += time.perf_counter() - start
        return bool(ok)
