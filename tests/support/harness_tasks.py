"""Two small lm-evaluation-harness tasks of a user's own, from text that ships with Python (pydoc_data.topics), as
a user writes them: a folder of YAML files whose documents are local JSON lines.

- pydoc_continuation (multiple choice, acc): the first half of a sentence of the CPython docs, and four second
  halves: its own and those of three other sentences.
- pydoc_last_word (generation, exact_match): a sentence without its last word; the model's first word must be it.

`sentences` are the sentences both tasks ask about: a model trained on them has learned the tasks' domain."""

from __future__ import annotations

import contextlib
import json
import logging
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


def write_cached_hub_task(folder: Path, cache: Path, hub_id: str = "someone/pydoc_set") -> str:
    """pydoc_continuation as a task of the Hub's (`pydoc_hub`, dataset_path: `hub_id`) whose dataset the datasets cache
    `cache` holds as a download from the Hub leaves it: what runs offline, read from the cache. Its name."""
    import shutil

    import datasets

    write_tasks(folder / "data")
    data = folder / "data" / "continuation.jsonl"
    builder = datasets.load_dataset_builder("json", data_files={"test": str(data)}, cache_dir=str(cache))
    builder.download_and_prepare()
    prepared = Path(builder.cache_dir)  # json/default-<hash>/0.0.0/<hash>: moved where a hub download is cached
    namespace, name = hub_id.split("/")
    hub = cache / f"{namespace}___{name}" / "default" / prepared.parent.name / prepared.name
    shutil.copytree(prepared, hub)
    (hub / "json-test.arrow").rename(hub / f"{name}-test.arrow")
    local = f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
    text = MULTIPLE_CHOICE.format(data=data)
    assert local in text
    (folder / "pydoc_hub.yaml").write_text(text.replace(local, f"dataset_path: {hub_id}\n")
                                           .replace("task: pydoc_continuation", "task: pydoc_hub"))
    return "pydoc_hub"


@contextlib.contextmanager
def datasets_lines():
    """The lines datasets logs inside the block ("Using the latest cached version ..."), which its own handler prints
    where a test's capture does not see them."""
    heard: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: heard.append(record.getMessage())
    logging.getLogger("datasets").addHandler(handler)
    try:
        yield heard
    finally:
        logging.getLogger("datasets").removeHandler(handler)


# what keeps a process off the Hub besides its network: none of them set while a test makes the Hub unreachable
OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "http_proxy", "HTTP_PROXY",
                     "all_proxy", "ALL_PROXY")


@contextlib.contextmanager
def unreachable_hub(monkeypatch, cache: Path):
    """This process without the Hub, whatever the machine's network (HF_ENDPOINT: a port nothing listens on), with no
    offline variable set and the empty datasets cache `cache`, the probe asked afresh inside the block. The offline
    mode the toolkit then sets is undone with the monkeypatch."""
    import datasets.config
    import huggingface_hub.constants

    from toolkit.data import hub

    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")
    for module in (huggingface_hub.constants, datasets.config):
        monkeypatch.setattr(module, "HF_HUB_OFFLINE", False)
    for name in OFFLINE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    hub.hub_unreachable.cache_clear()
    try:
        yield cache
    finally:
        hub.hub_unreachable.cache_clear()
