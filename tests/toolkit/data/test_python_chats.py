"""The embedded chat SFT set (toolkit.data.python_chats.PYTHON_CHATS) that a fine-tune uses when no
data.path is given: well-formed records of both forms the chat loader accepts, plain ASCII, and
answers whose code and worked examples are right."""

from __future__ import annotations

import ast
import re

import pytest

from toolkit.data.chat import ChatDataConfig, load_chat_records, to_messages
from toolkit.data.python_chats import PYTHON_CHATS, TUTOR

CONVERSATIONS = [to_messages(record, i) for i, record in enumerate(PYTHON_CHATS)]
CODE_BLOCK = re.compile(r"```python\n(.*?)```", re.DOTALL)


def _texts(record: dict) -> list[str]:
    if "messages" in record:
        return [m["content"] for m in record["messages"]]
    return [record[k] for k in ("instruction", "input", "output") if k in record]


def test_the_set_is_large_enough_for_a_train_and_eval_split():
    assert len(PYTHON_CHATS) >= 20


@pytest.mark.parametrize("index", range(len(PYTHON_CHATS)))
def test_each_record_has_exactly_one_of_the_two_forms(index):
    record = PYTHON_CHATS[index]
    if "messages" in record:
        assert set(record) == {"messages"}
        assert all(set(m) == {"role", "content"} for m in record["messages"])
    else:
        assert set(record) in ({"instruction", "output"}, {"instruction", "input", "output"})
        assert all(isinstance(record[k], str) for k in record)


@pytest.mark.parametrize("index", range(len(PYTHON_CHATS)))
def test_each_conversation_is_an_optional_system_turn_then_user_assistant_pairs(index):
    roles = [m["role"] for m in CONVERSATIONS[index]]
    if roles[0] == "system":
        roles = roles[1:]
    assert roles and len(roles) % 2 == 0, roles
    assert roles == ["user", "assistant"] * (len(roles) // 2)


@pytest.mark.parametrize("index", range(len(PYTHON_CHATS)))
def test_no_turn_is_empty_or_padded_with_whitespace(index):
    for m in CONVERSATIONS[index]:
        assert m["content"].strip(), (index, m)
        assert m["content"] == m["content"].strip(), (index, m)


def test_the_text_is_plain_ascii():
    # so that any token span of any tokenizer decodes back to text (see the module docstring)
    bad = [(i, t) for i, r in enumerate(PYTHON_CHATS) for t in _texts(r) if not t.isascii()]
    assert bad == []


def test_both_record_forms_and_every_shape_are_present():
    forms = {"messages" in r for r in PYTHON_CHATS}
    assert forms == {True, False}
    instructions = [r for r in PYTHON_CHATS if "instruction" in r]
    assert any(r.get("input") for r in instructions)  # with an input
    assert any(not r.get("input") for r in instructions)  # without one (empty or absent)
    assert any(c[0]["role"] == "system" for c in CONVERSATIONS)
    assert any(sum(m["role"] == "assistant" for m in c) > 1 for c in CONVERSATIONS)  # multi-turn


def test_the_tutor_system_prompt_is_used():
    systems = [c[0]["content"] for c in CONVERSATIONS if c[0]["role"] == "system"]
    assert systems.count(TUTOR) >= 2
    assert TUTOR.startswith("You are") and TUTOR.isascii()


def test_an_instruction_with_an_input_puts_both_in_the_user_turn():
    index = next(i for i, r in enumerate(PYTHON_CHATS) if r.get("input"))
    record, user = PYTHON_CHATS[index], CONVERSATIONS[index][0]
    assert user == {"role": "user", "content": f"{record['instruction']}\n\n{record['input']}"}
    assert CONVERSATIONS[index][1] == {"role": "assistant", "content": record["output"]}


def test_no_question_is_asked_twice():
    firsts = [next(m["content"] for m in c if m["role"] == "user") for c in CONVERSATIONS]
    assert len(set(firsts)) == len(firsts)


def test_every_python_code_block_parses():
    blocks = [b for r in PYTHON_CHATS for t in _texts(r) for b in CODE_BLOCK.findall(t)]
    assert len(blocks) >= 5
    for block in blocks:
        ast.parse(block)


def test_code_fences_are_closed():
    for i, r in enumerate(PYTHON_CHATS):
        for t in _texts(r):
            assert t.count("```") % 2 == 0, (i, t)


def test_code_given_as_an_input_parses():
    inputs = [r["input"] for r in PYTHON_CHATS if r.get("input")]
    assert inputs
    for code in inputs:
        ast.parse(code)


@pytest.mark.parametrize(
    "expression, answer_says, value",
    [
        ("[x * x for x in range(5) if x % 2 == 0]", "gives `[0, 4, 16]`", [0, 4, 16]),
        ("{name: len(name) for name in ['ann', 'bob']}", "gives `{'ann': 3, 'bob': 3}`", {"ann": 3, "bob": 3}),
        ("', '.join(['a', 'b', 'c'])", "gives `'a, b, c'`", "a, b, c"),
        ("f'{3.14159:.2f}'", "into `'3.14'`", "3.14"),
        ("len({1, 2, 2, 3})", "It prints 3", 3),
        ("(7 // 2, 7 % 2, 7 / 2)", "`(3, 1, 3.5)`", (3, 1, 3.5)),
        ("sum(range(1, 11))", "the total is then 55", 55),
        ("list(dict.fromkeys([3, 1, 3, 2, 1]))", "keeps the first occurrence of each item in order", [3, 1, 2]),
    ],
)
def test_worked_examples_in_the_answers_are_right(expression, answer_says, value):
    """Each example an answer states, evaluated: a fine-tune must not learn wrong Python."""
    assert any(answer_says in t for r in PYTHON_CHATS for t in _texts(r)), answer_says
    assert eval(expression) == value


def test_the_generator_example_counts_down():
    answer = next(t for r in PYTHON_CHATS for t in _texts(r) if "def countdown" in t)
    namespace: dict = {}
    exec(CODE_BLOCK.search(answer).group(1), namespace)  # the set's own example
    assert "`list(countdown(3))` gives `[3, 2, 1]`" in answer
    assert list(namespace["countdown"](3)) == [3, 2, 1]


def test_the_even_squares_answer_works():
    record = next(r for r in PYTHON_CHATS if r.get("instruction", "").startswith("Write a function"))
    namespace: dict = {}
    exec(CODE_BLOCK.search(record["output"]).group(1), namespace)
    assert namespace["even_squares"]([1, 2, 3, 4]) == [4, 16]


def test_the_loader_returns_every_record_without_a_path():
    records = load_chat_records(ChatDataConfig())
    assert records == PYTHON_CHATS
    assert all(a is not b for a, b in zip(records, PYTHON_CHATS, strict=True))  # copies, not the module's dicts
    records[0]["messages"] = []
    assert PYTHON_CHATS[0]["messages"]  # replacing a key in a loaded record leaves the set alone
