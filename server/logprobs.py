"""Engine `TokenLogprob`s -> the two OpenAI logprob formats.

Completions: parallel lists `tokens`, `token_logprobs`, `top_logprobs` ({token text: logprob},
which always includes the sampled token) and `text_offset`. Chat: one entry per token with
its text, logprob, UTF-8 `bytes` and a `top_logprobs` list.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

from engine import TokenLogprob
from server.detokenizer import REPLACEMENT_CHAR, Piece
from server.responses import ChatLogprobEntry, CompletionLogprobs, TopLogprob

# JSON has no -inf; OpenAI-compatible servers clamp to this floor.
LOGPROB_FLOOR = -9999.0
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def clamp(logprob: float) -> float:
    return LOGPROB_FLOOR if math.isnan(logprob) else max(logprob, LOGPROB_FLOOR)


def _byte_level_table() -> dict[str, int]:
    """GPT-2's printable stand-ins for raw bytes, inverted (char -> byte)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


class TokenTexts:
    """Per-token display text and exact bytes, cached (one instance per loaded tokenizer)."""

    def __init__(self, tokenizer: object) -> None:
        self._tokenizer = tokenizer
        self._texts: dict[int, str] = {}
        self._bytes: dict[int, bytes] = {}
        self._byte_level = self._uses_byte_level(tokenizer)
        self._table = _byte_level_table() if self._byte_level else {}

    @staticmethod
    def _uses_byte_level(tokenizer: object) -> bool:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        decoder = getattr(backend, "decoder", None)
        return decoder is not None and "ByteLevel" in repr(decoder)

    def bytes_of(self, token_id: int) -> bytes:
        cached = self._bytes.get(token_id)
        if cached is None:
            cached = self._bytes[token_id] = self._raw_bytes(token_id)
        return cached

    def _raw_bytes(self, token_id: int) -> bytes:
        piece = self._tokenizer.convert_ids_to_tokens(token_id)  # type: ignore[attr-defined]
        if isinstance(piece, str):
            match = _BYTE_TOKEN.fullmatch(piece)
            if match:
                return bytes([int(match.group(1), 16)])
            if self._byte_level and all(ch in self._table for ch in piece):
                return bytes(self._table[ch] for ch in piece)
            if not self._byte_level and "\u2581" in piece:  # SentencePiece's word-start mark
                return piece.replace("\u2581", " ").encode("utf-8")
        return self._decode(token_id).encode("utf-8")

    def _decode(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id], skip_special_tokens=False)  # type: ignore[attr-defined]

    def text_of(self, token_id: int) -> str:
        """The token's text; a partial UTF-8 sequence is shown as `bytes:\\xe2\\x9c` (OpenAI)."""
        cached = self._texts.get(token_id)
        if cached is None:
            cached = self._decode(token_id)
            if REPLACEMENT_CHAR in cached:
                raw = self.bytes_of(token_id)
                try:
                    cached = raw.decode("utf-8")
                except UnicodeDecodeError:
                    cached = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            self._texts[token_id] = cached
        return cached


def completion_logprobs(
    texts: TokenTexts,
    entries: Sequence[tuple[int, TokenLogprob | None]],
    offsets: Sequence[int],
) -> CompletionLogprobs:
    """entries: (token id, its logprob or None for the first prompt token) per token."""
    out = CompletionLogprobs()
    for (token_id, entry), offset in zip(entries, offsets, strict=True):
        out.tokens.append(texts.text_of(token_id))
        out.text_offset.append(offset)
        if entry is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(clamp(entry.logprob))
        top = {texts.text_of(tid): clamp(lp) for tid, lp in entry.top}
        top.setdefault(texts.text_of(token_id), clamp(entry.logprob))
        out.top_logprobs.append(top)
    return out


def piece_offsets(pieces: Sequence[Piece], start: int) -> list[int]:
    """Character offset of each piece's text, counting from `start`."""
    offsets = []
    for piece in pieces:
        offsets.append(start)
        start += len(piece.text)
    return offsets


def chat_logprobs(texts: TokenTexts, pieces: Sequence[Piece], top_n: int) -> list[ChatLogprobEntry]:
    entries = []
    for piece in pieces:
        if piece.logprob is None:
            continue
        top = [
            TopLogprob(token=texts.text_of(tid), logprob=clamp(lp), bytes=list(texts.bytes_of(tid)))
            for tid, lp in piece.logprob.top[:top_n]
        ]
        entries.append(
            ChatLogprobEntry(
                token=texts.text_of(piece.token_id),
                logprob=clamp(piece.logprob.logprob),
                bytes=list(texts.bytes_of(piece.token_id)),
                top_logprobs=top,
            )
        )
    return entries
