"""Tokens -> text, one token at a time, without ever splitting a character or leaking a stop.

`IncrementalDetokenizer` turns each new token into the text it completes: decoding a short
window of recent tokens and diffing against the window without the new token keeps
tokenizer-specific spacing right, and text ending in U+FFFD (an incomplete UTF-8 sequence
of a byte-level vocabulary) is held until a later token completes the character.

Where the tokenizer is a fast (Rust) one whose `tokenizers` package has `DecodeStream` with a
starting context (0.22 on), each step runs there: the same window and diff in Rust, one
call instead of two Python decodes. The streamed server spends much of its per-token time
on the event loop (bench/server_overhead.py), and the two decodes were about a quarter of
that. The windowed decode stays as the fallback and computes the final flush.

`StopStringFilter` releases text only once no stop string can still begin inside it, so a
stop string split across tokens (or across one multi-token speculative step) never reaches
a client.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from engine import TokenLogprob

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens kept as decoding context: enough for tokenizers whose spacing depends on the
# previous token (SentencePiece's leading "▁"), small enough to keep each decode cheap.
_CONTEXT_TOKENS = 5


class Decoder(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


@dataclass(frozen=True)
class Piece:
    """One generated token and the text it completed ("" while a character is incomplete).

    token_id is None for text flushed at the end that no single token completed.
    """

    token_id: int | None
    text: str
    logprob: TokenLogprob | None = None


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Decoder,
        prompt_ids: Sequence[int],
        skip_special_tokens: bool = True,
        native: bool = True,
    ) -> None:
        """native=False keeps every step on the windowed Python decode (tests compare)."""
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids = list(prompt_ids[-_CONTEXT_TOKENS:])
        # Text of _ids[_prefix:_read] was already emitted; _ids[_read:] is still pending.
        self._prefix = 0
        self._read = len(self._ids)
        # A context that ends inside a character (a prompt cut mid-character) is left to the
        # windowed decode, whose text for it the stream's would not match.
        cut = bool(self._ids) and self._decode(0).endswith(REPLACEMENT_CHAR)
        self._backend, self._stream = (
            _decode_stream(tokenizer, self._ids, skip_special_tokens)
            if native and not cut
            else (None, None)
        )

    def _decode(self, start: int, end: int | None = None) -> str:
        return self._tokenizer.decode(self._ids[start:end], skip_special_tokens=self._skip)

    def step(self, token_id: int) -> str:
        self._ids.append(token_id)
        if self._stream is not None:
            text = self._stream.step(self._backend, token_id)
            if not text:  # None: a character is still incomplete
                return ""
        else:
            done = self._decode(self._prefix, self._read)
            text = self._decode(self._prefix)
            if len(text) <= len(done) or text.endswith(REPLACEMENT_CHAR):
                return ""
            text = text[len(done) :]
        self._prefix, self._read = self._read, len(self._ids)
        self._trim()
        return text

    def flush(self) -> str:
        """Whatever is still pending at the end of the output (may contain U+FFFD)."""
        done = self._decode(self._prefix, self._read)
        text = self._decode(self._prefix)
        self._prefix = self._read = len(self._ids)
        return text[len(done) :]

    def _trim(self) -> None:
        # Only _ids[_prefix:] is ever decoded again.
        drop = self._prefix
        if drop > 64:
            del self._ids[:drop]
            self._prefix -= drop
            self._read -= drop


def _decode_stream(tokenizer: Decoder, context: list[int], skip: bool) -> tuple[object, object]:
    """(the Rust tokenizer, a `DecodeStream` primed with `context`), or (None, None) where the
    tokenizer is not a fast one or `tokenizers` is too old to prime a stream."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None, None
    try:
        from tokenizers.decoders import DecodeStream

        return backend, DecodeStream(ids=list(context), skip_special_tokens=skip)
    except (ImportError, TypeError):  # no DecodeStream, or one without `ids`
        return None, None


class StopStringFilter:
    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._pending: list[Piece] = []

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    def push(self, pieces: Sequence[Piece]) -> tuple[list[Piece], bool]:
        """Add pieces; return the pieces safe to release and whether a stop string matched.

        On a match the released pieces end where the stop string begins (the piece holding
        its first character keeps only its text before it) and everything after is dropped.
        """
        self._pending.extend(pieces)
        if not self._stops:
            return self._release(len(self._pending)), False
        text = "".join(p.text for p in self._pending)
        cut = self._first_match(text)
        if cut is not None:
            return self._truncate(cut), True
        limit = len(text) - self._held_suffix(text)
        count, end = 0, 0
        for piece in self._pending:
            if end + len(piece.text) > limit:
                break
            end += len(piece.text)
            count += 1
        return self._release(count), False

    def flush(self) -> list[Piece]:
        """At the end of the output nothing can match any more: release everything."""
        return self._release(len(self._pending))

    def _release(self, count: int) -> list[Piece]:
        out, self._pending = self._pending[:count], self._pending[count:]
        return out

    def _first_match(self, text: str) -> int | None:
        hits = [i for i in (text.find(stop) for stop in self._stops) if i >= 0]
        return min(hits) if hits else None

    def _held_suffix(self, text: str) -> int:
        """Length of the longest suffix of text that a stop string starts with."""
        longest = min(len(text), max(len(s) for s in self._stops) - 1)
        for size in range(longest, 0, -1):
            tail = text[-size:]
            if any(stop.startswith(tail) for stop in self._stops):
                return size
        return 0

    def _truncate(self, cut: int) -> list[Piece]:
        out: list[Piece] = []
        start = 0
        for piece in self._pending:
            if start >= cut:
                break
            out.append(replace(piece, text=piece.text[: cut - start]))
            start += len(piece.text)
        self._pending = []
        return out
