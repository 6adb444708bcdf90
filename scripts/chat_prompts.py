"""Chat instructions for the default model: the draft's training prompts, and the held-out
ones the benchmarks run: `python scripts/chat_prompts.py > bench/chat_prompts.json` freezes
them there, so bench/ needs no import of this.

Built from templates and word lists written here, plus text every machine with Python has
(the standard library's module docstrings and public names), so nothing is downloaded.
`instructions()` is deterministic; `split()` holds out a fixed share by a hash of the text,
so the benchmark's prompts are never among the draft's training prompts.
"""

from __future__ import annotations

import hashlib
import json
import pkgutil
import random
import re
import sysconfig
from pathlib import Path

HOLDOUT_PERCENT = 5

COUNTRIES = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid", "Japan": "Tokyo",
    "Canada": "Ottawa", "Brazil": "Brasilia", "Australia": "Canberra", "Egypt": "Cairo",
    "India": "New Delhi", "China": "Beijing", "Mexico": "Mexico City", "Kenya": "Nairobi",
    "Norway": "Oslo", "Sweden": "Stockholm", "Poland": "Warsaw", "Greece": "Athens",
    "Portugal": "Lisbon", "Argentina": "Buenos Aires", "Peru": "Lima", "Chile": "Santiago",
    "Turkey": "Ankara", "Russia": "Moscow", "Nigeria": "Abuja", "Vietnam": "Hanoi",
    "Thailand": "Bangkok", "Ireland": "Dublin", "Austria": "Vienna", "Finland": "Helsinki",
    "Denmark": "Copenhagen", "Morocco": "Rabat", "Indonesia": "Jakarta", "Cuba": "Havana",
    "Hungary": "Budapest", "Belgium": "Brussels", "Switzerland": "Bern", "Iran": "Tehran",
    "South Korea": "Seoul", "New Zealand": "Wellington", "Colombia": "Bogota",
}  # fmt: skip
SUBJECTS = [
    "the Moon", "the Sun", "Mars", "Jupiter", "black holes", "volcanoes", "earthquakes",
    "the ocean", "rainforests", "deserts", "glaciers", "honeybees", "dolphins", "elephants",
    "octopuses", "penguins", "wolves", "dinosaurs", "the Roman Empire", "ancient Egypt",
    "the Renaissance", "the Industrial Revolution", "the printing press", "the telephone",
    "the internet", "electricity", "vaccines", "antibiotics", "DNA", "photosynthesis",
    "the water cycle", "climate change", "renewable energy", "solar panels", "wind turbines",
    "nuclear power", "the human heart", "the brain", "sleep", "coffee", "tea", "chocolate",
    "bread", "cheese", "the Olympic Games", "chess", "football", "jazz", "classical music",
    "the piano", "painting", "photography", "Shakespeare", "Albert Einstein", "Marie Curie",
    "Isaac Newton", "Leonardo da Vinci", "Charles Darwin", "Ada Lovelace", "Alan Turing",
    "the Great Wall of China", "the pyramids", "the Eiffel Tower", "the Amazon river",
    "Mount Everest", "the Sahara", "the Pacific Ocean", "airplanes", "trains", "bicycles",
    "electric cars", "rockets", "satellites", "the International Space Station", "robots",
    "artificial intelligence", "computers", "smartphones", "social media", "money",
    "banks", "inflation", "democracy", "libraries", "museums", "gardening", "recycling",
]  # fmt: skip
CONCEPTS = [
    "gravity", "inflation", "supply and demand", "machine learning", "a neural network",
    "recursion", "an API", "encryption", "a blockchain", "evolution", "the immune system",
    "compound interest", "a budget", "entropy", "the greenhouse effect", "friction",
    "magnetism", "an atom", "a chemical reaction", "the speed of light", "a prime number",
    "probability", "an algorithm", "a database", "cloud computing", "an operating system",
    "a compiler", "version control", "object-oriented programming", "a hash table",
    "binary numbers", "the scientific method", "a hypothesis", "opportunity cost",
    "photosynthesis", "plate tectonics", "a food chain", "the placebo effect", "memory",
    "habits", "procrastination", "mindfulness", "empathy", "leadership", "teamwork",
    "a contract", "copyright", "taxes", "interest rates", "the stock market", "a vaccine",
    "a virus", "bacteria", "metabolism", "calories", "vitamins", "a rainbow", "tides",
    "the seasons", "time zones", "a leap year", "sound waves", "electric current",
]  # fmt: skip
TASKS = [
    "learn a new language", "improve my sleep", "save money", "start running", "cook rice",
    "make a cup of tea", "write a good resume", "prepare for a job interview", "study for an exam",
    "stay focused while working", "plant a tree", "care for a houseplant", "bake bread",
    "change a flat tire", "learn to play the guitar", "reduce stress", "make new friends",
    "organize my desk", "plan a trip", "write an essay", "give a presentation",
    "learn Python", "start a small business", "eat healthier", "drink more water",
    "wake up early", "read more books", "be more productive", "clean a kitchen",
    "train a puppy", "start a garden", "write a cover letter", "negotiate a salary",
    "learn to swim", "take better photos", "make a budget", "stop procrastinating",
    "keep a journal", "fix a slow computer", "back up my files", "choose a laptop",
]  # fmt: skip
PAIRS = [
    ("a virus", "a bacterium"), ("weather", "climate"), ("a list", "a tuple in Python"),
    ("speed", "velocity"), ("a lake", "a sea"), ("RAM", "storage"), ("a frog", "a toad"),
    ("an alligator", "a crocodile"), ("baking soda", "baking powder"), ("a stock", "a bond"),
    ("HTTP", "HTTPS"), ("a compiler", "an interpreter"), ("mass", "weight"),
    ("a simile", "a metaphor"), ("an ocean", "a sea"), ("a moth", "a butterfly"),
    ("TCP", "UDP"), ("a star", "a planet"), ("a rabbit", "a hare"), ("socialism", "capitalism"),
    ("a democracy", "a republic"), ("affect", "effect"), ("a fruit", "a vegetable"),
    ("a hurricane", "a tornado"), ("a CPU", "a GPU"), ("machine learning", "deep learning"),
    ("a loan", "a grant"), ("a meteor", "a comet"), ("Python", "JavaScript"), ("tea", "coffee"),
]  # fmt: skip
CODE_TASKS = [
    "reverses a string", "checks whether a number is prime", "computes the factorial of n",
    "returns the n-th Fibonacci number", "counts the vowels in a string",
    "finds the largest number in a list", "removes duplicates from a list",
    "checks whether a string is a palindrome", "sorts a list of dictionaries by a key",
    "merges two sorted lists", "flattens a nested list", "counts word frequencies in a text",
    "converts Celsius to Fahrenheit", "reads a file and returns its lines",
    "computes the average of a list", "finds the second largest element of a list",
    "checks whether two strings are anagrams", "returns the greatest common divisor of two numbers",
    "generates all subsets of a list", "converts a decimal number to binary",
    "validates an email address with a regular expression", "capitalizes every word in a sentence",
    "implements binary search", "implements bubble sort", "transposes a matrix",
    "sums the digits of an integer", "checks whether a year is a leap year",
    "returns the intersection of two lists", "chunks a list into pieces of size n",
    "counts the lines in a file",
]  # fmt: skip
THINGS = [
    "the sea", "autumn", "a cat", "the city at night", "friendship", "a rainy day", "the stars",
    "a mountain", "coffee", "a lighthouse", "winter", "spring", "a river", "an old tree",
    "the moon", "a train journey", "a garden", "the wind", "a library", "a snowy morning",
]  # fmt: skip
CHARACTERS = [
    "a young wizard", "a lonely robot", "a brave knight", "a curious fox", "a retired pirate",
    "a girl who can talk to birds", "a detective", "a baker", "a space explorer", "a dragon",
]  # fmt: skip
PLOTS = [
    "finds a hidden door", "loses a map", "learns to fly", "makes an unexpected friend",
    "travels back in time", "wins a strange contest", "gets lost in a forest",
    "discovers a secret", "saves a village", "opens a small shop",
]  # fmt: skip
AUDIENCES = ["a five-year-old", "a beginner", "a high school student", "my grandmother"]
SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are a concise assistant. Answer briefly.",
    "You are a friendly teacher who explains things clearly.",
    "You are an expert Python programmer.",
]


def _stdlib_docs(limit: int = 400) -> list[str]:
    """First paragraphs of the standard library's module docstrings (text every machine
    with Python has), read from the source files without importing them."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for path in sorted(root.glob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")[:6000]
        except (OSError, UnicodeDecodeError):
            continue
        text = re.sub(r"^(#[^\n]*\n|\s*\n)*", "", text)
        m = re.match(r'[rRbBuU]?("""|\'\'\')(.*?)\1', text, re.S)
        if not m:
            continue
        para = m.group(2).strip().split("\n\n")[0]
        para = " ".join(para.split())
        if 80 <= len(para) <= limit:
            out.append(para)
    return out


def _stdlib_names() -> list[str]:
    """Public `module.function` names of pure-Python standard library modules."""
    names = []
    root = Path(sysconfig.get_paths()["stdlib"])
    for mod in sorted(m.name for m in pkgutil.iter_modules([str(root)])):
        if mod.startswith("_") or mod in {"this", "antigravity", "idlelib", "test"}:
            continue
        path = root / f"{mod}.py"
        if not path.exists():
            continue
        text = path.read_text(encoding="utf-8", errors="ignore")
        for fn in re.findall(r"^def ([a-z][a-z0-9_]+)\(", text, re.M)[:10]:
            names.append(f"{mod}.{fn}")
    return names


def instructions() -> list[dict]:
    """Every instruction as {"messages": [...]}, deduplicated, in a fixed shuffled order."""
    rng = random.Random(0)
    users: list[str] = []
    for country, _ in COUNTRIES.items():
        users += [
            f"What is the capital of {country}?", f"Tell me three facts about {country}.",
            f"What is {country} famous for?", f"What language do people speak in {country}?",
        ]  # fmt: skip
    for s in SUBJECTS:
        users += [
            f"Tell me about {s}.", f"What are some interesting facts about {s}?",
            f"Write a short paragraph about {s}.", f"Why is {s} important?",
            f"Describe {s} in three sentences.", f"What is a common misconception about {s}?",
        ]  # fmt: skip
    for c in CONCEPTS:
        users += [
            f"Explain {c} in simple terms.", f"What is {c}?", f"Give an example of {c}.",
            f"Why does {c} matter in everyday life?",
        ]  # fmt: skip
        users.append(f"Explain {c} to {rng.choice(AUDIENCES)}.")
    for t in TASKS:
        users += [
            f"How do I {t}?", f"Give me {rng.choice([3, 4, 5])} tips to {t}.",
            f"What is the best way to {t}?", f"I want to {t}. Where should I start?",
            f"Make a step-by-step plan to {t}.",
        ]  # fmt: skip
    for a, b in PAIRS:
        users += [f"What is the difference between {a} and {b}?", f"Compare {a} and {b}."]
    for task in CODE_TASKS:
        users += [
            f"Write a Python function that {task}.",
            f"How would you write a function that {task}? Explain briefly.",
        ]
    for thing in THINGS:
        users += [f"Write a short poem about {thing}.", f"Write a haiku about {thing}."]
    for who in CHARACTERS:
        for plot in rng.sample(PLOTS, 3):
            users.append(f"Write a short story about {who} who {plot}.")
    for _ in range(200):
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        users.append(
            rng.choice(
                [
                    f"What is {a} plus {b}?",
                    f"What is {a} times {b}?",
                    f"If I have {a} apples and give away {min(a, b)}, how many are left?",
                    f"Solve for x: {a}x + {b} = {a * 3 + b}.",
                ]
            )  # fmt: skip
        )
    docs = _stdlib_docs()
    for doc in docs:
        users.append(
            rng.choice(
                [
                    "Summarize the following text in one sentence:\n\n",
                    "Explain this in simple words:\n\n",
                    "Rewrite the following text so that it is easier to read:\n\n",
                ]
            )  # fmt: skip
            + doc
        )
    for name in _stdlib_names():
        users.append(
            rng.choice(
                [
                    f"What does Python's `{name}` do?",
                    f"Show an example of using `{name}` in Python.",
                ]
            )
        )
    seen: set[str] = set()
    unique = [u for u in users if not (u in seen or seen.add(u))]
    rng.shuffle(unique)
    out = []
    for i, user in enumerate(unique):
        messages = [{"role": "user", "content": user}]
        if i % 10 == 0:  # a tenth with a system prompt of their own
            messages.insert(0, {"role": "system", "content": SYSTEM_PROMPTS[i // 10 % 4]})
        out.append({"messages": messages})
    return out


def is_holdout(item: dict) -> bool:
    text = "\n".join(m["content"] for m in item["messages"])
    return int(hashlib.sha256(text.encode()).hexdigest(), 16) % 100 < HOLDOUT_PERCENT


def split() -> tuple[list[dict], list[dict]]:
    """(training instructions, held-out instructions)."""
    items = instructions()
    return [i for i in items if not is_holdout(i)], [i for i in items if is_holdout(i)]


if __name__ == "__main__":  # the held-out instructions, as bench/chat_prompts.json holds them
    held = split()[1]
    print(json.dumps([item["messages"] for item in held], indent=0, ensure_ascii=False))
