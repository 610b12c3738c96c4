"""Instruction-style chat prompts made offline, for distilling a drafter from an instruct model.

Two sources, both deterministic (a seed picks and orders them):
- the Python standard library's own functions (`ast` over its sources, train_demo's split by
  file): write a function that does what a docstring's first sentence says, explain what a
  function does, explain a short function's code, show how to call it;
- everyday requests written from templates over short word lists here (explain a concept,
  give tips, write a short poem or story, compare two things).

The prompts that figures are measured on (`EVAL_PROMPTS`, written by hand, and the held-out
files' functions) never appear in training: `training_prompts` takes only the training files
and template fillings, and drops any text equal to an evaluation prompt.
"""

from __future__ import annotations

import ast
import functools
import random
from collections.abc import Iterable

from museflash.training.train_demo import SourceFile, load_corpus

# Held-out chat prompts for the acceptance and speed figures, never trained on.
EVAL_PROMPTS = (
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain the difference between a list and a tuple in Python.",
    "What are three good habits for writing readable code?",
    "Write a haiku about autumn leaves.",
    "How do I read a CSV file in Python?",
    "Explain what recursion is with a simple example.",
    "Give me a short plan for learning to play the guitar.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "What is the capital of France, and what is it known for?",
    "Summarize the water cycle in a few sentences.",
    "Write a Python class for a bank account with deposit and withdraw methods.",
    "Why is the sky blue?",
    "Write a function in Python that merges two sorted lists.",
    "What is a hash table and when should I use one?",
    "Give me five ideas for a healthy breakfast.",
    "Explain how a for loop works in Python.",
)

_CONCEPTS = ("photosynthesis", "gravity", "inflation", "machine learning", "the internet",
             "democracy", "climate change", "vaccines", "black holes", "compound interest",
             "evolution", "electricity", "the stock market", "encryption", "sleep", "volcanoes",
             "the immune system", "blockchain", "supply and demand", "renewable energy",
             "DNA", "the moon's phases", "rainbows", "earthquakes", "the French Revolution",
             "binary numbers", "operating systems", "a compiler", "version control",
             "unit testing", "object-oriented programming", "a database index", "caching")
_TOPICS = ("staying focused", "learning a language", "saving money", "cooking pasta",
           "running a first marathon", "public speaking", "writing an essay", "gardening",
           "time management", "debugging code", "traveling on a budget", "making friends",
           "keeping a journal", "studying for exams", "working from home", "reducing stress",
           "taking better photos", "writing clean code", "starting a small business")
_THINGS = ("the ocean", "a city at night", "a lost robot", "friendship", "the first snow",
           "a cat on a windowsill", "an old library", "the desert", "a thunderstorm",
           "a lighthouse", "a train journey", "the stars", "a quiet forest", "coffee")
_PAIRS = (("Python", "JavaScript"), ("a cat", "a dog"), ("tea", "coffee"),
          ("TCP", "UDP"), ("a virus", "a bacterium"), ("weather", "climate"),
          ("RAM", "storage"), ("a list", "a set"), ("SQL", "NoSQL databases"),
          ("mean", "median"), ("speed", "velocity"), ("an array", "a linked list"))
_TEMPLATES = (
    ("Explain {} in simple terms.", _CONCEPTS), ("What is {}?", _CONCEPTS),
    ("Explain {} to a ten-year-old.", _CONCEPTS),
    ("Give me some tips for {}.", _TOPICS), ("What are the most common mistakes in {}?", _TOPICS),
    ("Write a short poem about {}.", _THINGS), ("Write a very short story about {}.", _THINGS),
    ("Describe {} in three sentences.", _THINGS),
    ("What is the difference between {} and {}?", _PAIRS),
    ("Compare {} and {} in a short list.", _PAIRS),
)


def _first_sentence(docstring: str) -> str | None:
    line = docstring.strip().split("\n\n")[0].replace("\n", " ").strip()
    line = line.split(". ")[0].rstrip(".").strip()
    if not 12 <= len(line) <= 120 or not line[0].isalpha():
        return None
    return line[0].lower() + line[1:]


def _module_name(path: str) -> str:
    name = path[:-3].replace("/", ".")
    return name[: -len(".__init__")] if name.endswith(".__init__") else name


def function_prompts(files: Iterable[SourceFile]) -> list[str]:
    """Requests about the public, documented functions of `files`."""
    prompts = []
    for source in files:
        try:
            tree = ast.parse(source.text)
        except (SyntaxError, ValueError):
            continue
        module = _module_name(source.path)
        lines = source.text.splitlines()
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            summary = _first_sentence(doc) if doc else None
            if summary:
                prompts.append(f"Write a Python function `{node.name}` that {summary}.")
                prompts.append(f"What does `{module}.{node.name}` do in Python?")
            body = lines[node.lineno - 1:node.end_lineno]
            if 3 <= len(body) <= 12:
                code = "\n".join(body)
                prompts.append(f"Explain what this Python code does:\n```python\n{code}\n```")
            prompts.append(f"Show an example of calling `{module}.{node.name}`.")
    return prompts


def template_prompts() -> list[str]:
    out = []
    for template, fillings in _TEMPLATES:
        out += [template.format(*(f if isinstance(f, tuple) else (f,))) for f in fillings]
    return out


@functools.cache
def _pools() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(training, held-out) prompts in sorted order. Parsing every file of the standard library
    takes seconds, so a process does it once; the library does not change under it."""
    corpus = load_corpus()
    training = set(function_prompts(corpus.train) + template_prompts()) - set(EVAL_PROMPTS)
    return tuple(sorted(training)), tuple(sorted(set(function_prompts(corpus.held_out))))


def training_prompts(count: int, seed: int) -> list[str]:
    """`count` prompts (fewer when there are not as many): the training files' functions and
    the template fillings, shuffled by `seed`, none equal to an evaluation prompt."""
    pool = list(_pools()[0])
    random.Random(seed).shuffle(pool)
    return pool[:count]


def held_out_prompts(count: int, seed: int) -> list[str]:
    """Prompts about the held-out files' functions: never trained on."""
    pool = list(_pools()[1])
    random.Random(seed).shuffle(pool)
    return pool[:count]
