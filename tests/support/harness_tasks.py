"""Two small lm-evaluation-harness tasks of a user's own, from text that ships with Python (pydoc_data.topics), as
a user writes them: a folder of YAML files whose documents are local JSON lines.

- pydoc_continuation (multiple choice, acc): the first half of a sentence of the CPython docs, and four second
  halves: its own and those of three other sentences.
- pydoc_last_word (generation, exact_match): a sentence without its last word; the model's first word must be it.

`sentences` are the sentences both tasks ask about: a model trained on them has learned the tasks' domain."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

MULTIPLE_CHOICE = """task: pydoc_continuation
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""

GENERATION = """task: pydoc_last_word
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prefix}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 6
  do_sample: false
filter_list:
  - name: first_word
    filter:
      - function: regex
        regex_pattern: "([^ .,;:]+)"
      - function: take_first
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""


def sentences(n: int = 40) -> list[str]:
    from pydoc_data.topics import topics

    text = " ".join(topics[k] for k in sorted(topics))
    found = [" ".join(s.split()) for s in re.split(r"(?<=[.])\s+", text)]  # the docs' lines rejoined
    found = sorted({s for s in found if 60 <= len(s) <= 140 and s.isascii() and s.count(" ") >= 7 and s[0].isupper()})
    random.Random(0).shuffle(found)
    return found[: n + 3 * n]  # the first n are asked about; the rest lend the wrong continuations


def write_tasks(folder: Path, n: int = 40) -> list[str]:
    """The two tasks' YAML and documents in `folder`; the n sentences they ask about."""
    folder.mkdir(parents=True, exist_ok=True)
    pool = sentences(n)
    asked, others = pool[:n], pool[n:]
    rng = random.Random(1)
    choices_rows, word_rows = [], []
    for i, s in enumerate(asked):
        words = s.split()
        cut = len(words) // 2
        wrong = [" " + " ".join(o.split()[cut:]) for o in others[3 * i : 3 * i + 3]]
        choices = [" " + " ".join(words[cut:]), *wrong]
        order = list(range(4))
        rng.shuffle(order)
        choices_rows.append({"context": " ".join(words[:cut]), "choices": [choices[j] for j in order],
                             "label": order.index(0)})
        word_rows.append({"prefix": " ".join(words[:-1]), "answer": re.match(r"[^ .,;:]+", words[-1]).group()})
    for name, rows, template in (("continuation", choices_rows, MULTIPLE_CHOICE), ("last_word", word_rows, GENERATION)):
        data = folder / f"{name}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        (folder / f"{name}.yaml").write_text(template.format(data=data))
    return asked
