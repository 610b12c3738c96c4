"""Instruction-style chat prompts made offline, for distilling a drafter from an instruct model.

Two sources, both deterministic (a seed picks and orders them):
- the Python standard library's own functions (`ast` over its sources, train_demo's split by
  file): write a function that does what a docstring's first sentence says, explain what a
  function does, explain a short function's code, show how to call it;
- everyday and programming requests written from templates over short word lists here
  (explain a concept, give tips or ideas, write a poem or an email, compare two things, write
  a Python function or class for a task, explain a Python feature, answer a why question).

`training_prompts` draws them kind by kind (each template is a kind, and each of the four
function requests), so the few hundred template fillings are not lost among thousands of
function prompts.

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
             "unit testing", "object-oriented programming", "a database index", "caching",
             "the greenhouse effect", "the solar system", "plate tectonics", "the human heart",
             "neural networks", "the speed of light", "magnetism", "interest rates",
             "cloud computing", "an API", "the scientific method", "taxes", "the Roman Empire",
             "the printing press", "antibiotics", "tides", "sound waves", "friction",
             "artificial intelligence", "a web browser", "HTTP", "a CPU", "big O notation",
             "binary search", "sorting algorithms", "nuclear energy", "the food chain")
_AUDIENCES = ("a beginner", "a high-school student", "someone who has never heard of it",
              "my grandmother")
_TOPICS = ("staying focused", "learning a language", "saving money", "cooking pasta",
           "running a first marathon", "public speaking", "writing an essay", "gardening",
           "time management", "debugging code", "traveling on a budget", "making friends",
           "keeping a journal", "studying for exams", "working from home", "reducing stress",
           "taking better photos", "writing clean code", "starting a small business",
           "learning to code", "getting better sleep", "staying motivated", "job interviews",
           "eating healthier", "managing a team", "writing a resume", "learning math",
           "keeping a house plant alive", "moving to a new city", "negotiating a salary")
_THINGS = ("the ocean", "a city at night", "a lost robot", "friendship", "the first snow",
           "a cat on a windowsill", "an old library", "the desert", "a thunderstorm",
           "a lighthouse", "a train journey", "the stars", "a quiet forest", "coffee",
           "a rainy afternoon", "a busy market", "a small boat", "the mountains", "an old clock",
           "a snowy village", "a river", "a firefly", "the wind", "a bakery in the morning",
           "a paper airplane", "a sunflower", "a sleepy dog", "a rocket launch", "a campfire",
           "a grandmother's kitchen", "a dragon who is afraid of the dark", "a time traveler")
_FORMS = ("a limerick", "a four-line poem", "a bedtime story", "a diary entry",
          "a short song", "a short fable")
_PAIRS = (("Python", "JavaScript"), ("a cat", "a dog"), ("tea", "coffee"),
          ("TCP", "UDP"), ("a virus", "a bacterium"), ("weather", "climate"),
          ("RAM", "storage"), ("a list", "a set"), ("SQL", "NoSQL databases"),
          ("mean", "median"), ("speed", "velocity"), ("an array", "a linked list"),
          ("a stack", "a queue"), ("a process", "a thread"), ("HTTP", "HTTPS"),
          ("a compiler", "an interpreter"), ("frontend", "backend development"),
          ("Git", "GitHub"), ("a function", "a method"), ("a class", "an object"),
          ("AI", "machine learning"), ("a comet", "an asteroid"), ("a frog", "a toad"),
          ("a crocodile", "an alligator"), ("baking soda", "baking powder"),
          ("a hurricane", "a tornado"), ("empathy", "sympathy"), ("affect", "effect"),
          ("renting", "buying a house"), ("a debit card", "a credit card"),
          ("stocks", "bonds"), ("== and", "is in Python"))
# Everyday and programming requests of the evaluation prompts' kinds, none about an evaluation
# prompt's subject (no palindromes, Fibonacci, merged sorted lists, CSV files, bank accounts,
# recursion, for loops, hash tables, lists against tuples, guitars, France, the water cycle,
# the sky's colour, breakfasts, autumn leaves or readable code).
_PY_TASKS = ("count the vowels in a string", "reverse a list", "remove duplicates from a list",
             "find the largest number in a list", "check whether a number is prime",
             "compute the factorial of a number", "convert Celsius to Fahrenheit",
             "sort a dictionary by its values", "flatten a nested list",
             "count the words in a text file", "read a JSON file",
             "find the second smallest number in a list",
             "check whether two strings are anagrams", "compute the average of a list",
             "capitalize every word in a sentence", "find the common elements of two lists",
             "generate a random password", "check whether a year is a leap year",
             "compute the greatest common divisor of two numbers",
             "split a list into chunks of equal size", "count each letter in a string",
             "sum the digits of a number", "get the current date and time",
             "parse a date from a string", "remove whitespace from a string",
             "sort a list of tuples by their second item", "check whether a list is sorted",
             "combine two dictionaries", "convert a list of strings to integers",
             "rotate a list by k positions", "find the longest word in a sentence",
             "convert a number to binary", "check whether an email address is valid",
             "measure how long a function takes", "find the median of a list",
             "count the lines in a file", "shuffle a list", "convert a string to a list of words",
             "check whether a string contains only digits", "find the index of an item in a list",
             "create a dictionary from two lists", "count how often an item appears in a list",
             "find all even numbers in a list", "square every number in a list",
             "remove a key from a dictionary", "write text to a file", "list the files in a folder",
             "compute the area of a circle", "convert minutes to hours and minutes",
             "find the smallest and largest values in a list", "reverse the words in a sentence",
             "print a multiplication table", "round a number to two decimal places",
             "join a list of strings with commas", "remove punctuation from a string",
             "find the duplicate items in a list", "sort a list of strings by length",
             "filter a list of dictionaries by a key", "compute a person's age from a birth date",
             "check whether a file exists", "convert a dictionary to JSON", "transpose a matrix",
             "find the most common item in a list", "generate all permutations of a string",
             "check whether a number is a perfect square", "convert kilometers to miles",
             "extract the numbers from a string", "count the uppercase letters in a string")
_PY_CLASSES = ("a stack", "a queue", "a to-do list", "a rectangle with area and perimeter methods",
               "a shopping cart", "a library book", "a student with a list of grades",
               "a simple counter", "a deck of cards", "a stopwatch", "a point in 2D space",
               "a temperature reading in Celsius and Fahrenheit", "a contact in an address book",
               "a simple inventory of items", "a car with a speed and a fuel level",
               "a simple calculator", "a playlist of songs", "a circle",
               "a movie with a title and a rating", "a parking lot", "a recipe with ingredients",
               "an employee with a salary", "a pair of dice", "a to-do item with a due date",
               "a game character with health points", "a user with a name and an email",
               "a hotel room booking", "a vending machine", "a traffic light", "a thermostat")
_PY_CONCEPTS = ("a dictionary", "a generator", "a decorator", "a list comprehension",
                "a lambda function", "exception handling", "the with statement",
                "a virtual environment", "the global keyword", "slicing", "a while loop",
                "string formatting", "type hints", "inheritance", "a module", "an f-string",
                "the range function", "a set", "*args and **kwargs", "the __init__ method",
                "a class method", "the zip function", "the enumerate function", "a context manager",
                "a dataclass", "the map function", "the filter function", "a key function",
                "a property", "a static method", "duck typing", "a docstring", "an assertion",
                "the break statement", "default arguments", "keyword arguments",
                "the import statement", "a package", "the self parameter", "a closure",
                "an iterator", "the yield keyword", "async and await", "a try and except block",
                "string methods", "integer division", "the modulo operator", "None")
_IDEAS = ("a rainy weekend", "a birthday party", "a science fair project", "a short story",
          "a team-building activity", "a family dinner", "a small balcony garden",
          "a gift for a friend", "a weekend trip", "a school fundraiser", "a picnic",
          "a blog about travel", "a board game night", "a summer holiday with kids",
          "a date night", "a class presentation", "a podcast", "a mobile app",
          "a children's book", "a quick dinner", "a healthy snack", "a photography project",
          "a coding project for beginners", "a Sunday afternoon", "a new hobby",
          "a community event", "staying active in winter", "a school club",
          "decorating a small room", "a video game")
_PLANS = ("learning to cook", "getting fit in a month", "learning to draw", "reading more books",
          "learning to swim", "preparing for a job interview", "learning a new programming "
          "language", "cleaning the house", "training a puppy", "starting to run",
          "moving to a new city", "planning a wedding", "learning to play the piano",
          "learning to code", "writing a novel", "saving for a vacation", "eating healthier",
          "learning photography", "running a 5k", "learning to meditate", "starting a podcast",
          "building a website", "learning Spanish", "learning chess")
_WHY = ("do leaves change color in the fall", "is the ocean salty", "do we dream",
        "do cats purr", "is exercise good for you", "do we have seasons",
        "does ice float on water", "do birds migrate", "do stars twinkle", "do we need sleep",
        "does bread rise", "do onions make you cry", "does the moon change shape",
        "do we get hiccups", "is the grass green", "do volcanoes erupt", "do we yawn",
        "do apples turn brown", "does metal feel cold", "do we have fingerprints",
        "do dogs wag their tails", "does the Earth spin", "do we sneeze", "do bees make honey",
        "do some people need glasses", "do rivers flow to the sea", "do we forget things",
        "is sugar bad for teeth", "does popcorn pop", "do flowers smell", "do we get goosebumps",
        "do planes leave white trails")
_COUNTRIES = ("Japan", "Italy", "Spain", "Germany", "Canada", "Brazil", "Egypt", "Australia",
              "India", "Mexico", "Kenya", "Norway", "Greece", "Peru", "Thailand", "Portugal",
              "Sweden", "Turkey", "Vietnam", "Argentina", "South Korea", "Ireland", "Morocco",
              "Chile", "Poland", "Austria", "New Zealand", "Switzerland", "the Netherlands",
              "Indonesia", "Nigeria", "Cuba")
_EMAILS = ("thank a colleague for their help", "ask my manager for a day off",
           "invite friends to a picnic", "apologize for a late reply",
           "ask a teacher for feedback on an essay", "welcome a new team member",
           "remind a client about an unpaid invoice", "decline a meeting politely",
           "ask for a deadline extension", "thank a customer for their order",
           "follow up after a job interview", "congratulate a colleague on a promotion",
           "cancel a subscription", "introduce myself to a new client", "ask for a refund",
           "tell my team about a schedule change")
_BENEFITS = ("drinking water", "regular exercise", "reading every day", "meditation",
             "walking", "learning a second language", "getting enough sleep",
             "cycling to work", "eating vegetables", "open-source software",
             "automated tests", "code review", "version control", "taking breaks",
             "working from home", "electric cars", "solar panels", "learning to code",
             "keeping a diary", "playing chess", "public libraries", "type hints")
_SEASONS = ("spring rain", "a winter morning", "the summer sun", "a mountain lake",
            "the sea at dawn", "a quiet forest", "the first snow", "a city at night",
            "a morning walk", "a starry night", "a sleeping cat", "a cup of tea",
            "the full moon", "a summer storm", "an old tree", "a mountain trail")
_STORIES = ("Romeo and Juliet", "Cinderella", "the Odyssey", "Little Red Riding Hood",
            "Moby Dick", "Snow White", "the Three Little Pigs", "Hamlet", "Pinocchio",
            "the Tortoise and the Hare", "Alice in Wonderland", "Robin Hood", "Frankenstein",
            "Jack and the Beanstalk", "the Wizard of Oz", "Peter Pan")
_STRUCTURES = ("a stack", "a queue", "a linked list", "a binary tree", "a heap", "a graph",
               "a set", "a trie", "a priority queue", "a deque", "an array",
               "a relational database", "a cache", "a binary search tree")
_HOW_TO = ("make a cup of tea", "change a flat tire", "start a vegetable garden",
           "write a good resume", "improve my memory", "fall asleep faster", "type faster",
           "clean a laptop keyboard", "back up my phone", "make a budget", "boil an egg",
           "tie a tie", "write a thank-you note", "choose a strong password",
           "teach a dog to sit", "take care of a houseplant", "make new friends as an adult",
           "stop procrastinating", "learn to touch type", "prepare for a long flight")
_TEMPLATES = (
    ("Explain {} in simple terms.", _CONCEPTS), ("What is {}?", _CONCEPTS),
    ("Explain {} to a ten-year-old.", _CONCEPTS),
    ("Explain {} to {}.", tuple((c, a) for c in _CONCEPTS for a in _AUDIENCES)),
    ("Summarize {} in a few sentences.", _CONCEPTS), ("Tell me about {}.", _CONCEPTS),
    ("Why is {} important?", _CONCEPTS), ("What are the main ideas behind {}?", _CONCEPTS),
    ("Write a short paragraph about {}.", _CONCEPTS),
    ("Give me some tips for {}.", _TOPICS), ("What are the most common mistakes in {}?", _TOPICS),
    ("What are three good habits for {}?",
     tuple(t for t in _TOPICS if t != "writing clean code")),
    ("How can I get better at {}?", _TOPICS),
    ("Write a short poem about {}.", _THINGS), ("Write a very short story about {}.", _THINGS),
    ("Write {} about {}.", tuple((f, t) for f in _FORMS for t in _THINGS)),
    ("Describe {} in three sentences.", _THINGS), ("Write a haiku about {}.", _SEASONS),
    ("What is the difference between {} and {}?", _PAIRS),
    ("Compare {} and {} in a short list.", _PAIRS),
    ("Write a Python function to {}.", _PY_TASKS), ("How do I {} in Python?", _PY_TASKS),
    ("Show me Python code to {}.", _PY_TASKS),
    ("Write a Python function that can {}, with a short example.", _PY_TASKS),
    ("What is the simplest way to {} in Python?", _PY_TASKS),
    ("Write a Python class for {}.", _PY_CLASSES),
    ("Create a simple Python class that represents {}.", _PY_CLASSES),
    ("Write a Python class for {} and show how to use it.", _PY_CLASSES),
    ("Explain {} in Python.", _PY_CONCEPTS), ("How does {} work in Python?", _PY_CONCEPTS),
    ("Give me an example of {} in Python.", _PY_CONCEPTS),
    ("When should I use {} in Python?", _PY_CONCEPTS),
    ("Give me five ideas for {}.", _IDEAS), ("What are some fun ideas for {}?", _IDEAS),
    ("List three creative ideas for {}.", _IDEAS),
    ("Give me a short plan for {}.", _PLANS), ("How should I get started with {}?", _PLANS),
    ("Make a one-week plan for {}.", _PLANS),
    ("Why {}?", _WHY), ("Can you explain why {}?", _WHY),
    ("What is the capital of {}, and what is it known for?", _COUNTRIES),
    ("What is {} famous for?", _COUNTRIES), ("Tell me three interesting facts about {}.",
                                             _COUNTRIES),
    ("What should a tourist see in {}?", _COUNTRIES),
    ("Write a short email to {}.", _EMAILS), ("Help me write a polite message to {}.", _EMAILS),
    ("What are the benefits of {}?", _BENEFITS), ("What are the pros and cons of {}?", _BENEFITS),
    ("Summarize the story of {} in a few sentences.", _STORIES),
    ("Who are the main characters in {}?", _STORIES),
    ("What is {} and when should I use one?", _STRUCTURES),
    ("Explain how {} works, with an example.", _STRUCTURES),
    ("How do I {}?", _HOW_TO), ("What is the best way to {}?", _HOW_TO),
)
# The kinds of function_prompts, by how each starts.
FUNCTION_KINDS = ("Write a Python function `", "What does `", "Explain what this Python code",
                  "Show an example of calling `")


def _first_sentence(docstring: str) -> str | None:
    line = docstring.strip().split("\n\n")[0].replace("\n", " ").strip()
    line = line.split(". ")[0].rstrip(".").strip()
    if not 12 <= len(line) <= 120 or not line[0].isalpha():
        return None
    return line[0].lower() + line[1:]


def _module_name(path: str) -> str:
    name = path[:-3].replace("/", ".")
    return name[: -len(".__init__")] if name.endswith(".__init__") else name


def function_prompts_by_kind(files: Iterable[SourceFile]) -> dict[str, list[str]]:
    """Requests about the public, documented functions of `files`, keyed by kind (the start
    each has, FUNCTION_KINDS)."""
    write, explain, code_of, call = FUNCTION_KINDS
    prompts: dict[str, list[str]] = {kind: [] for kind in FUNCTION_KINDS}
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
                prompts[write].append(f"{write}{node.name}` that {summary}.")
                prompts[explain].append(f"{explain}{module}.{node.name}` do in Python?")
            body = lines[node.lineno - 1:node.end_lineno]
            if 3 <= len(body) <= 12:
                code = "\n".join(body)
                prompts[code_of].append(f"{code_of} does:\n```python\n{code}\n```")
            prompts[call].append(f"{call}{module}.{node.name}`.")
    return prompts


def function_prompts(files: Iterable[SourceFile]) -> list[str]:
    """Requests about the public, documented functions of `files`, kind by kind."""
    return [p for group in function_prompts_by_kind(files).values() for p in group]


def template_prompts() -> dict[str, list[str]]:
    """Every filling of each template, keyed by its template (its kind)."""
    return {template: [template.format(*(f if isinstance(f, tuple) else (f,)))
                       for f in fillings] for template, fillings in _TEMPLATES}


@functools.cache
def _pools() -> tuple[dict[str, tuple[str, ...]], tuple[str, ...]]:
    """(training prompts by kind, held-out prompts), each in sorted order. Parsing every file of
    the standard library takes seconds, so a process does it once; the library does not change
    under it."""
    corpus = load_corpus()
    kinds = {**function_prompts_by_kind(corpus.train), **template_prompts()}
    training = {kind: tuple(sorted(set(group) - set(EVAL_PROMPTS)))
                for kind, group in sorted(kinds.items())}
    return training, tuple(sorted(set(function_prompts(corpus.held_out))))


def training_kinds() -> dict[str, tuple[str, ...]]:
    """Every training prompt by its kind: a template, or the start a function prompt has."""
    return dict(_pools()[0])


def training_prompts(count: int, seed: int) -> list[str]:
    """`count` prompts (fewer when there are not as many): the training files' functions and
    the template fillings, none equal to an evaluation prompt, drawn kind by kind in turn
    (`training_kinds`; each kind shuffled by `seed`, the kinds in a seeded order) until a kind
    runs out, so a few thousand function prompts do not crowd out a template's dozens."""
    rng = random.Random(seed)
    groups = [list(group) for group in _pools()[0].values() if group]
    for group in groups:
        rng.shuffle(group)
    rng.shuffle(groups)
    drawn: list[str] = []
    for turn in range(max(map(len, groups), default=0)):
        drawn += [group[turn] for group in groups if turn < len(group)]
        if len(drawn) >= count:
            break
    return drawn[:count]


def held_out_prompts(count: int, seed: int) -> list[str]:
    """Prompts about the held-out files' functions: never trained on."""
    pool = list(_pools()[1])
    random.Random(seed).shuffle(pool)
    return pool[:count]
