"""Pure server pieces: incremental detokenization, stop strings, logprob formatting."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from engine.types.outputs import TokenLogprob
from server.detokenizer import IncrementalDetokenizer, Piece, StopStringFilter
from server.logprobs import LOGPROB_FLOOR, TokenTexts, chat_logprobs, completion_logprobs

TEXT = "def add(a, b):\n    return a + b\nHéllo wörld ✓ 日本語 😀 The quick brown fox"


@pytest.fixture(scope="module")
def tokenizer(tiny_dirs):
    return AutoTokenizer.from_pretrained(tiny_dirs["llama"])


def _stream(tokenizer, prompt_ids, ids):
    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    pieces = [detok.step(t) for t in ids]
    return pieces, detok.flush()


def test_incremental_detokenization_matches_full_decode(tokenizer):
    prompt = tokenizer.encode("x = 1\n")
    ids = tokenizer.encode(TEXT)
    pieces, tail = _stream(tokenizer, prompt, ids)
    assert "".join(pieces) + tail == tokenizer.decode(ids)
    assert tail == ""


def test_multibyte_characters_are_never_split(tokenizer):
    ids = tokenizer.encode("✓日本語😀")
    assert len(ids) > 4  # byte-level BPE splits these characters across tokens
    pieces, _ = _stream(tokenizer, [], ids)
    assert all("\ufffd" not in p for p in pieces)
    assert "" in pieces  # some tokens completed no character and were held back
    assert "".join(pieces) == "✓日本語😀"


def test_random_token_streams_round_trip(tokenizer):
    rng = random.Random(0)
    for _ in range(20):
        ids = [rng.randrange(3, len(tokenizer)) for _ in range(30)]
        pieces, tail = _stream(tokenizer, [], ids)
        assert "".join(pieces) + tail == tokenizer.decode(ids)


def _pieces(tokenizer, prompt_ids, ids, native):
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, native=native)
    # a context cut mid-character stays on the windowed decode
    cut = tokenizer.decode(prompt_ids[-5:], skip_special_tokens=True).endswith("\ufffd")
    assert (detok._stream is not None) == (native and not cut)  # the path meant runs
    return [detok.step(t) for t in ids], detok.flush()


def test_native_stream_equals_the_windowed_decode(tokenizer):
    """The Rust DecodeStream path gives every step exactly the windowed Python decode's text,
    prompt context, special tokens and split characters included."""
    rng = random.Random(1)
    specials = tokenizer.all_special_ids
    cases = [(tokenizer.encode("x = 1\n"), tokenizer.encode(TEXT + " ✓日本語😀"))]
    for _ in range(60):
        prompt = [rng.randrange(0, len(tokenizer)) for _ in range(rng.randrange(0, 9))]
        ids = [rng.choice(specials) if rng.random() < 0.1 else rng.randrange(0, len(tokenizer))
               for _ in range(40)]  # fmt: skip
        cases.append((prompt, ids))
    for prompt, ids in cases:
        assert _pieces(tokenizer, prompt, ids, True) == _pieces(tokenizer, prompt, ids, False)
    streamed = sum(IncrementalDetokenizer(tokenizer, p)._stream is not None for p, _ in cases)
    assert streamed > len(cases) // 2  # random prompts often end mid-character


def test_native_stream_keeps_sentencepiece_spacing():
    """A Metaspace ("▁" for a space) tokenizer: the prompt's last tokens are the context that
    keeps a word's leading space in the first generated piece."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>", "▁Hello", "▁world", "!", "▁how", "▁are", "▁you", "?"]
    model = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    model.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    model.decoder = decoders.Metaspace(prepend_scheme="first")
    tok = PreTrainedTokenizerFast(tokenizer_object=model, bos_token="<s>", eos_token="</s>")
    prompt, ids = [1, 3, 4, 5], [6, 7, 8, 9, 2]
    native = _pieces(tok, prompt, ids, True)
    assert native == _pieces(tok, prompt, ids, False)
    assert "".join(native[0]) + native[1] == " how are you?"


def _run_filter(stops, chunks):
    """Feed text chunks (one piece each) through a filter; return released text and stopped."""
    filt = StopStringFilter(stops)
    out = []
    for i, chunk in enumerate(chunks):
        released, stopped = filt.push([Piece(i, chunk)])
        out += released
        if stopped:
            return "".join(p.text for p in out), True
    out += filt.flush()
    return "".join(p.text for p in out), False


@pytest.mark.parametrize(
    ("chunks", "expected"),
    [
        (["Hello", " wor", "ld", "STOP", "more"], "Hello world"),
        (["Hello S", "T", "O", "P after"], "Hello "),  # stop split over several tokens
        (["abcSTOPdefSTOP"], "abc"),  # several tokens' text in one piece (speculative step)
        (["STOP"], ""),
    ],
)
def test_stop_string_truncates(chunks, expected):
    assert _run_filter(["STOP"], chunks) == (expected, True)


def test_stop_string_never_leaks_in_partial_releases():
    filt = StopStringFilter(["</end>"])
    released, stopped = filt.push([Piece(0, "text </e")])
    assert not stopped and "".join(p.text for p in released) == ""  # "</e" may start a stop
    released2, stopped = filt.push([Piece(1, "nd> tail")])
    assert stopped and "".join(p.text for p in released + released2) == "text "


def test_false_stop_prefix_is_released():
    assert _run_filter(["STOP"], ["ST", "ART", " ok"]) == ("START ok", False)


def test_earliest_of_several_stop_strings_wins():
    assert _run_filter(["xyz", "b"], ["a", "bcxyz"]) == ("a", True)


def test_stop_match_keeps_tokens_before_it():
    filt = StopStringFilter(["##"])
    released, stopped = filt.push([Piece(1, "ab"), Piece(2, "c#"), Piece(3, "#d")])
    assert stopped
    assert [(p.token_id, p.text) for p in released] == [(1, "ab"), (2, "c")]


def test_no_stop_strings_releases_everything():
    filt = StopStringFilter([])
    released, stopped = filt.push([Piece(1, "a"), Piece(2, "")])
    assert not stopped and len(released) == 2 and not filt.has_pending


def test_token_texts_bytes_and_partial_characters(tokenizer):
    texts = TokenTexts(tokenizer)
    ids = tokenizer.encode("✓")
    assert b"".join(texts.bytes_of(t) for t in ids) == "✓".encode()
    assert all(texts.text_of(t).startswith("bytes:\\x") for t in ids if len(ids) > 1)
    ascii_id = tokenizer.encode("a")[0]
    assert texts.text_of(ascii_id) == "a" and texts.bytes_of(ascii_id) == b"a"


def test_completion_logprobs_format(tokenizer):
    texts = TokenTexts(tokenizer)
    a, b = tokenizer.encode("a")[0], tokenizer.encode("b")[0]
    entries = [
        (a, None),  # first prompt token: no logprob
        (b, TokenLogprob(b, -0.5, ((a, -0.1), (b, -0.5)))),
        (a, TokenLogprob(a, float("-inf"), ((b, -0.2),))),
    ]
    out = completion_logprobs(texts, entries, [0, 1, 2])
    assert out.tokens == ["a", "b", "a"]
    assert out.token_logprobs == [None, -0.5, LOGPROB_FLOOR]
    assert out.top_logprobs[0] is None
    assert out.top_logprobs[1] == {"a": -0.1, "b": -0.5}
    assert out.top_logprobs[2] == {"b": -0.2, "a": LOGPROB_FLOOR}  # sampled token added
    assert out.text_offset == [0, 1, 2]


def test_chat_logprobs_format(tokenizer):
    texts = TokenTexts(tokenizer)
    a, b = tokenizer.encode("a")[0], tokenizer.encode("b")[0]
    pieces = [Piece(a, "a", TokenLogprob(a, -0.1, ((a, -0.1), (b, -2.0)))), Piece(None, "x")]
    (entry,) = chat_logprobs(texts, pieces, top_n=1)
    assert (entry.token, entry.logprob, entry.bytes) == ("a", -0.1, [ord("a")])
    assert [(t.token, t.logprob) for t in entry.top_logprobs] == [("a", -0.1)]


@pytest.mark.parametrize("include_usage", [False, True])
def test_direct_content_chunk_equals_the_pydantic_one(include_usage):
    """server/chat.py builds the per-token content chunk without pydantic: the same JSON."""
    import json

    from server.chat import _ChatView
    from server.protocol import ChatCompletionRequest
    from server.responses import ChatChunkChoice, Delta

    options = {"include_usage": True} if include_usage else None
    req = ChatCompletionRequest(
        model="m", messages=[{"role": "user", "content": "hi"}], stream=True,
        stream_options=options,
    )  # fmt: skip
    view = _ChatView(None, req, 3, "chatcmpl-1", "m")
    for index, text in [(0, "Hello"), (2, " wörld ✓"), (1, '"quoted"\n')]:
        direct = view._content_chunk(index, text)
        model = view._chunk(ChatChunkChoice(index=index, delta=Delta(content=text)))
        assert json.dumps(direct, ensure_ascii=False) == json.dumps(model, ensure_ascii=False)
    assert ("usage" in direct) == include_usage


def test_sse_frame_is_sse_starlettes_encoding():
    import json

    from sse_starlette.event import ServerSentEvent

    from server.streaming import sse_frame

    for data in ["[DONE]", json.dumps({"a": "line\nbreak ✓", "b": None}, ensure_ascii=False)]:
        assert sse_frame(data) == ServerSentEvent(data=data).encode()


def test_event_stream_sends_directly_and_in_order():
    """server/streaming.py's response without sse-starlette's per-send cancel scope: every
    frame still goes out, in order, then the end of the body."""
    import asyncio

    from server.streaming import _EventStream, sse_frame

    async def frames():
        for data in ("a", "b", "[DONE]"):
            yield sse_frame(data)

    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    async def main():
        response = _EventStream(frames())
        assert response.send_timeout is None
        await response._stream_response(send)

    asyncio.run(main())
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    bodies = [m["body"] for m in sent[1:]]
    assert bodies == [b"data: a\r\n\r\n", b"data: b\r\n\r\n", b"data: [DONE]\r\n\r\n", b""]
    assert sent[-1]["more_body"] is False
