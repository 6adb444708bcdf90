"""Long prompts are tokenized on a worker thread, so the event loop keeps serving streams."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

from server.prompts import OFF_LOOP_CHARS, encode_prompts, render_chat_off_loop
from server.protocol import ChatMessage


class RecordingTokenizer:
    chat_template = "{{ messages }}"

    def __init__(self) -> None:
        self.threads: list[threading.Thread] = []

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.threads.append(threading.current_thread())
        return [len(text)]

    def apply_chat_template(self, conversation, tokenize=False, add_generation_prompt=True):
        return "".join(m["content"] for m in conversation)


def _run(coro_fn):
    """Run on a fresh loop; return (result, the loop's thread)."""

    async def main():
        return await coro_fn(), threading.current_thread()

    return asyncio.run(main())


def test_long_prompts_leave_the_event_loop_and_short_ones_stay():
    tok = RecordingTokenizer()
    state = SimpleNamespace(tokenizer=tok)
    short, loop_thread = _run(lambda: encode_prompts(state, ["hello", [1, 2, 3]]))
    assert [p.token_ids for p in short] == [[5], [1, 2, 3]]
    assert tok.threads == [loop_thread]
    long_text = "x" * OFF_LOOP_CHARS
    long, loop_thread = _run(lambda: encode_prompts(state, [long_text, "y"]))
    assert [p.token_ids for p in long] == [[OFF_LOOP_CHARS], [1]]
    assert long[0].text == long_text
    assert loop_thread not in tok.threads[1:]


def test_long_chat_is_rendered_off_the_event_loop():
    tok = RecordingTokenizer()
    state = SimpleNamespace(tokenizer=tok)
    messages = [ChatMessage(role="user", content="z" * OFF_LOOP_CHARS)]
    prompt, loop_thread = _run(lambda: render_chat_off_loop(state, messages))
    assert prompt.token_ids == [OFF_LOOP_CHARS]
    assert tok.threads and tok.threads[-1] is not loop_thread
