"""Built-in benchmark prompts: Python code to continue, and chat questions (in the tokenizer's ChatML
template where it has one).  Written for benchmarking; no drafter here trains on them (the adapters
train on the standard library's code and the target's own questions)."""

from __future__ import annotations

from specpilot.core.errors import SpecPilotError

CODE = [
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "import json\n\n\ndef load_config(path):\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "def is_prime(n: int) -> bool:\n",
    "def binary_search(items, target):\n    lo, hi = 0, len(items) - 1\n",
    "def read_lines(path):\n    with open(path) as f:\n",
    "def quicksort(xs):\n    if len(xs) <= 1:\n        return xs\n",
    "from dataclasses import dataclass\n\n\n@dataclass\nclass Point:\n",
    "def count_words(text):\n    counts = {}\n    for word in text.split():\n",
    "def flatten(nested):\n    out = []\n    for item in nested:\n",
    "def gcd(a, b):\n    while b:\n",
    "import os\n\n\ndef list_python_files(root):\n",
    "def merge_sorted(a, b):\n    i = j = 0\n    out = []\n",
    "def celsius_to_fahrenheit(c):\n",
    "class Node:\n    def __init__(self, value, next=None):\n",
    "def reverse_string(s):\n",
]
CHAT = [
    "What is the capital of France?", "Give me three tips for learning Python.",
    "Explain what a hash table is in simple terms.", "Write a haiku about the sea.",
    "How do I make a cup of tea?", "What is the difference between a list and a tuple in Python?",
    "Summarize the plot of Romeo and Juliet.", "Why is the sky blue?",
    "List the planets of the solar system.", "What does HTTP stand for?",
    "How can I improve my sleep?", "Translate 'good morning' into Spanish and French.",
    "What is recursion? Give an example.", "Name three sorting algorithms.",
    "What is photosynthesis?", "Write a short thank-you note to a colleague.",
]
SETS = ("code", "chat", "mixed")


def chat(question: str) -> str:
    return f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"


def texts(name: str) -> list[str]:
    """The prompts of a built-in set; ``mixed`` alternates code and chat."""
    if name == "code":
        return list(CODE)
    if name == "chat":
        return [chat(q) for q in CHAT]
    if name == "mixed":
        return [t for pair in zip(CODE, (chat(q) for q in CHAT)) for t in pair]
    raise SpecPilotError(f"unknown prompt set {name!r}; built-in sets: {', '.join(SETS)} (or a JSONL file)")
