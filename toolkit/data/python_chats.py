"""The embedded chat SFT set: short questions about Python with correct, concise answers.

Written for this toolkit (Apache-2.0 like the rest), so a fine-tune runs with no download. It
mixes both record forms `toolkit.data.chat` accepts: `messages` (some with a system turn, some with
several turns) and `instruction`/`input`/`output`. Plain ASCII, so every test can decode any
token span back to text.
"""

from __future__ import annotations

TUTOR = "You are a patient Python tutor. Answer briefly and show a small example when it helps."

PYTHON_CHATS: list[dict] = [
    {
        "messages": [
            {"role": "user", "content": "How do I reverse a list in Python?"},
            {
                "role": "assistant",
                "content": "Use `items.reverse()` to reverse it in place, or `items[::-1]` to get a reversed copy "
                "and keep the original unchanged.",
            },
        ]
    },
    {
        "messages": [
            {"role": "user", "content": "What is the difference between a list and a tuple?"},
            {
                "role": "assistant",
                "content": "A list is mutable: you can append, remove and change items. A tuple is immutable, so "
                "it can be used as a dictionary key and signals that the data should not change.",
            },
        ]
    },
    {
        "messages": [
            {"role": "system", "content": TUTOR},
            {"role": "user", "content": "How do I read a text file line by line?"},
            {
                "role": "assistant",
                "content": "Open it in a `with` block and iterate over the file object:\n\n"
                "```python\nwith open(\"notes.txt\", encoding=\"utf-8\") as f:\n    for line in f:\n"
                "        print(line.rstrip())\n```\n\nThe file is closed automatically when the block ends.",
            },
        ]
    },
    {
        "messages": [
            {"role": "user", "content": "What does `if __name__ == \"__main__\":` do?"},
            {
                "role": "assistant",
                "content": "It runs the indented code only when the file is executed as a script, not when it is "
                "imported as a module. Python sets `__name__` to `\"__main__\"` for the script it starts with.",
            },
        ]
    },
    {
        "messages": [
            {"role": "user", "content": "How can I count how often each word appears in a list?"},
            {
                "role": "assistant",
                "content": "Use `collections.Counter`:\n\n```python\nfrom collections import Counter\n"
                "counts = Counter([\"a\", \"b\", \"a\"])\nprint(counts.most_common(1))  # [('a', 2)]\n```",
            },
        ]
    },
    {
        "messages": [
            {"role": "user", "content": "Why does my default argument list keep growing between calls?"},
            {
                "role": "assistant",
                "content": "Default values are evaluated once, when the function is defined, so every call "
                "shares the same list. Use `None` as the default and create the list inside the function:\n\n"
                "```python\ndef add(item, items=None):\n    if items is None:\n        items = []\n"
                "    items.append(item)\n    return items\n```",
            },
        ]
    },
    {
        "messages": [
            {"role": "user", "content": "What is a list comprehension?"},
            {
                "role": "assistant",
                "content": "A compact way to build a list from an iterable: `[x * x for x in range(5) if x % 2 == 0]` "
                "gives `[0, 4, 16]`.",
            },
            {"role": "user", "content": "Is there the same thing for dictionaries?"},
            {
                "role": "assistant",
                "content": "Yes, a dict comprehension: `{name: len(name) for name in [\"ann\", \"bob\"]}` gives "
                "`{'ann': 3, 'bob': 3}`. There are set comprehensions too, with braces and no colon.",
            },
        ]
    },
    {
        "messages": [
            {"role": "user", "content": "How do I check whether a key is in a dictionary?"},
            {
                "role": "assistant",
                "content": "Use `in`: `if \"port\" in config:`. To read a value with a fallback, use "
                "`config.get(\"port\", 8080)`.",
            },
        ]
    },
    {
        "messages": [
            {"role": "system", "content": TUTOR},
            {"role": "user", "content": "What is the difference between `==` and `is`?"},
            {
                "role": "assistant",
                "content": "`==` compares values, `is` checks whether two names refer to the same object. Use `is` "
                "only for singletons such as `None`: `if x is None:`.",
            },
        ]
    },
    {
        "messages": [
            {"role": "user", "content": "How do I sort a list of dictionaries by one field?"},
            {
                "role": "assistant",
                "content": "Pass a key function: `people.sort(key=lambda p: p[\"age\"])`, or "
                "`sorted(people, key=lambda p: p[\"age\"], reverse=True)` for a new list in descending order.",
            },
        ]
    },
    {
        "messages": [
            {"role": "user", "content": "How do I format a float with two decimals?"},
            {
                "role": "assistant",
                "content": "Use an f-string with a format spec: `f\"{price:.2f}\"` turns `3.14159` into `'3.14'`.",
            },
        ]
    },
    {
        "messages": [
            {"role": "user", "content": "What is a virtual environment and how do I make one?"},
            {
                "role": "assistant",
                "content": "It is a folder with its own interpreter and packages, so projects do not share "
                "dependencies. Create one with `python -m venv .venv`, activate it with "
                "`source .venv/bin/activate` (or `.venv\\Scripts\\activate` on Windows), then `pip install` as usual.",
            },
        ]
    },
    {
        "messages": [
            {"role": "user", "content": "How do I catch an exception?"},
            {
                "role": "assistant",
                "content": "Wrap the code in `try` and name the exception you expect:\n\n```python\ntry:\n"
                "    value = int(text)\nexcept ValueError:\n    value = 0\n```\n\nCatch specific exceptions, not a "
                "bare `except:`, so real bugs still surface.",
            },
            {"role": "user", "content": "And code that must run whether or not it fails?"},
            {
                "role": "assistant",
                "content": "Put it in a `finally` block; it runs after `try` and any `except`, even when an "
                "exception propagates.",
            },
        ]
    },
    {
        "messages": [
            {"role": "user", "content": "What does `*args` mean in a function definition?"},
            {
                "role": "assistant",
                "content": "It collects extra positional arguments into a tuple. `**kwargs` does the same for "
                "keyword arguments, as a dict: `def log(*args, **kwargs):` accepts any call.",
            },
        ]
    },
    {
        "messages": [
            {"role": "user", "content": "How do I get the current date and time?"},
            {
                "role": "assistant",
                "content": "Use the `datetime` module: `from datetime import datetime, timezone` and then "
                "`datetime.now(timezone.utc)` for an aware timestamp in UTC.",
            },
        ]
    },
    {
        "messages": [
            {"role": "system", "content": TUTOR},
            {"role": "user", "content": "What is a generator?"},
            {
                "role": "assistant",
                "content": "A function that uses `yield` to produce values one at a time, only when asked:\n\n"
                "```python\ndef countdown(n):\n    while n > 0:\n        yield n\n        n -= 1\n```\n\n"
                "`list(countdown(3))` gives `[3, 2, 1]`, and nothing is computed before you iterate.",
            },
        ]
    },
    {
        "messages": [
            {"role": "user", "content": "How do I join a list of strings with commas?"},
            {"role": "assistant", "content": "Call `join` on the separator: `\", \".join([\"a\", \"b\", \"c\"])` gives `'a, b, c'`."},
        ]
    },
    {
        "messages": [
            {"role": "user", "content": "How do I loop over a list and also get the index?"},
            {
                "role": "assistant",
                "content": "Use `enumerate`: `for i, name in enumerate(names):`. Pass `start=1` to count from one.",
            },
        ]
    },
    {
        "messages": [
            {"role": "user", "content": "How do I iterate over two lists at the same time?"},
            {
                "role": "assistant",
                "content": "Use `zip`: `for name, score in zip(names, scores):`. It stops at the shorter list; "
                "pass `strict=True` (Python 3.10+) to raise an error if the lengths differ.",
            },
        ]
    },
    {
        "messages": [
            {"role": "user", "content": "What is a decorator?"},
            {
                "role": "assistant",
                "content": "A function that takes a function and returns a new one, applied with `@` above a "
                "definition. For example `@functools.lru_cache` caches the results of the function it decorates.",
            },
        ]
    },
    {
        "messages": [
            {"role": "user", "content": "How do I copy a list so changes do not affect the original?"},
            {
                "role": "assistant",
                "content": "`new = old.copy()` (or `old[:]`) makes a shallow copy. If the list holds other lists "
                "you want to change independently, use `copy.deepcopy(old)`.",
            },
        ]
    },
    {
        "messages": [
            {"role": "system", "content": "You answer in one sentence."},
            {"role": "user", "content": "Which Python keyword defines a class?"},
            {"role": "assistant", "content": "The keyword is `class`, as in `class Point:`."},
        ]
    },
    {
        "messages": [
            {"role": "user", "content": "How do I remove duplicates from a list but keep the order?"},
            {
                "role": "assistant",
                "content": "`list(dict.fromkeys(items))` keeps the first occurrence of each item in order, because "
                "dictionaries preserve insertion order.",
            },
        ]
    },
    {
        "messages": [
            {"role": "user", "content": "What is a dataclass?"},
            {
                "role": "assistant",
                "content": "A class decorated with `@dataclass` from the `dataclasses` module; it writes "
                "`__init__`, `__repr__` and `__eq__` from the annotated fields:\n\n```python\n"
                "from dataclasses import dataclass\n\n@dataclass\nclass Point:\n    x: float\n    y: float = 0.0\n```",
            },
        ]
    },
    {
        "instruction": "Explain what the following code prints.",
        "input": "print(len({1, 2, 2, 3}))",
        "output": "It prints 3: the braces build a set, and a set keeps each value only once.",
    },
    {
        "instruction": "Write a function that returns the squares of the even numbers in a list.",
        "input": "",
        "output": "```python\ndef even_squares(numbers):\n    return [n * n for n in numbers if n % 2 == 0]\n```",
    },
    {
        "instruction": "Fix the bug in this code.",
        "input": "total = 0\nfor i in range(1, 10):\n    total += i\nprint(total)  # should add 1 to 10",
        "output": "`range` stops before its end value, so use `range(1, 11)` to include 10; the total is then 55.",
    },
    {
        "instruction": "What is the output of this expression?",
        "input": "7 // 2, 7 % 2, 7 / 2",
        "output": "`(3, 1, 3.5)`: `//` is floor division, `%` the remainder, and `/` always gives a float.",
    },
    {
        "instruction": "Convert this loop into a single call to a built-in function.",
        "input": "best = numbers[0]\nfor n in numbers:\n    if n > best:\n        best = n",
        "output": "`best = max(numbers)`",
    },
    {
        "instruction": "Explain the difference between `append` and `extend` on a list.",
        "output": "`append(x)` adds `x` as one element, even if it is a list; `extend(xs)` adds each element of "
        "the iterable `xs`. `[1].append([2, 3])` gives `[1, [2, 3]]`, `[1].extend([2, 3])` gives `[1, 2, 3]`.",
    },
    {
        "instruction": "Write a one-line command that installs the requests package with pip.",
        "input": "",
        "output": "`python -m pip install requests`",
    },
    {
        "instruction": "Name the exception this code raises and why.",
        "input": "d = {\"a\": 1}\nprint(d[\"b\"])",
        "output": "`KeyError: 'b'`, because the dictionary has no key `\"b\"`; use `d.get(\"b\")` to get `None` instead.",
    },
]
