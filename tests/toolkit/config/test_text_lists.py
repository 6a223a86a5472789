"""A list of strings on the command line (toolkit.config.text_lists), over every such key of both recipes.

`samples.prompts=[How do I open a file?, What is a dict?]` was "not valid YAML" (a `?` in a flow list),
`samples.prompts=How do I open a file?` "must be a list", `[Q: what is x?]` a mapping, and the same override
unquoted in the shell "override 'do' is not key=value": each without the spelling that works."""

from __future__ import annotations

import shlex
import typing
from pathlib import Path

import pytest

from toolkit.config.errors import ConfigError
from toolkit.config.keys import dotted_keys, value_at
from toolkit.config.load import _build, parse_overrides
from toolkit.config.text_lists import read_text_list, spelled
from toolkit.training.recipe_config import FinetuneConfig, PretrainConfig

RECIPES = {"pretrain": PretrainConfig, "finetune": FinetuneConfig}
# found from the type hints here, not by the loader's own test of them (is_text_list)
LIST_KEYS = [(recipe, key) for recipe, cls in RECIPES.items() for key, hint in dotted_keys(cls).items()
             if hint == list[str] or list[str] in typing.get_args(hint)]
LISTED = pytest.mark.parametrize(("recipe", "key"), LIST_KEYS, ids=[f"{r}-{k}" for r, k in LIST_KEYS])

# as written after `key=` (what the shell passes on once it is quoted) -> the strings it means
WRITTEN = {
    "[How do I open a file?, What is a dict?]": ["How do I open a file?", "What is a dict?"],
    "[Q: what is x?]": ["Q: what is x?"],
    "[a: b, c]": ["a: b", "c"],
    "[What is [x]?, #1, *x, it's]": ["What is [x]?", "#1", "*x", "it's"],
    "[yes, 1, null, ~]": ["yes", "1", "null", "~"],
    '["Tell me a, b and c", \'it\'\'s "so"\', x]': ["Tell me a, b and c", 'it\'s "so"', "x"],
    "[a,b ,  c,]": ["a", "b", "c"],
    "[]": [],
    "How do I open a file?": ["How do I open a file?"],
    "Q: what is x?": ["Q: what is x?"],
    "Tell me a, b and c": ["Tell me a, b and c"],
    '"quoted: yes"': ["quoted: yes"],
    "yes": ["yes"],
}
# the values a suggested spelling must read back as
HARD = [["How do I open a file?", "What is a dict?"], ["a, b", "Q: x", "it's", 'say "hi"', "back\\slash", "[x]"],
        ["日本語, ünïcode"], ["tab\there"]]


def test_the_recipes_have_the_list_keys_this_walks():
    keys = {key for _, key in LIST_KEYS}
    assert {"samples.prompts", "adapter.target_modules", "logging.trackers", "eval.harness_tasks"} <= keys


@LISTED
@pytest.mark.parametrize("written", WRITTEN)
def test_each_spelling_reads_as_the_strings_it_means_for_every_list_key(recipe, key, written):
    cls = RECIPES[recipe]
    problems: list[str] = []
    cfg = _build(cls, parse_overrides([f"{key}={written}"], {k for _, k in LIST_KEYS}), "", problems)
    assert problems == [] and value_at(cfg, key) == WRITTEN[written]


@LISTED
@pytest.mark.parametrize("value", HARD, ids=range(len(HARD)))
def test_the_suggested_spelling_reads_back_through_the_shell(recipe, key, value):
    (arg,) = shlex.split(spelled(key, value))  # one argument, as bash passes it
    assert parse_overrides([arg], {key}) == _tree(key, value)


@LISTED
def test_an_override_the_shell_split_is_refused_with_the_quoted_override_that_works(recipe, key):
    args = ["seed=3", *f"{key}=[How do I open a file?, What is a dict?]".split(" "), "train.max_steps=2"]
    with pytest.raises(ConfigError) as excinfo:
        parse_overrides(args, {key})
    (line,) = excinfo.value.problems
    assert line.startswith(f"override 'do' is not key=value: the shell split the value of {key} at its spaces into 10 "
                           "arguments; quote the override whole, e.g. ")
    (fixed,) = shlex.split(line.rsplit("e.g. ", 1)[1])
    assert parse_overrides([fixed], {key}) == _tree(key, ["How do I open a file?", "What is a dict?"])


@LISTED
@pytest.mark.parametrize("written", ['["How do I open a file?, What is a dict?]', "[a, , b]", "[a, b", '["a" b]'])
def test_a_list_that_still_does_not_read_is_one_line_with_a_spelling_that_does(recipe, key, written):
    with pytest.raises(ConfigError) as excinfo:
        parse_overrides([f"{key}={written}"], {key})
    (line,) = excinfo.value.problems
    assert "\n" not in line and line.startswith(f"override {key}={written} does not read as a list of strings: ")
    (fixed,) = shlex.split(line.rsplit("e.g. ", 1)[1])
    assert isinstance(read_text_list(key, fixed.split("=", 1)[1]), list)


def test_another_keys_override_is_yaml_as_before():
    assert parse_overrides(["data.path=[a, b]", "seed=1"], {"samples.prompts"}) == {"data": {"path": ["a", "b"]},
                                                                                   "seed": 1}
    with pytest.raises(ConfigError, match=r"^override 'train\.lr' is not key=value \(for example"):
        parse_overrides(["train.lr"])  # no override before it: no value the shell split


def test_the_recipe_prints_the_prompts_a_user_meant(capsys):
    from toolkit.training.entry import run

    config = str(Path(__file__).resolve().parents[3] / "recipes" / "configs" / "finetune_smollm2_lora.yaml")
    argv = ["--config", config, "samples.prompts=[How do I open a file?, Q: what is x?]", "--print-config"]
    assert run("finetune", FinetuneConfig, object, argv) == 0
    assert "  prompts:\n  - How do I open a file?\n  - 'Q: what is x?'\n" in capsys.readouterr().out
    assert run("finetune", FinetuneConfig, object, ["--config", config, "samples.prompts=What", "is", "x?"]) == 2
    assert capsys.readouterr().err == ("error: override 'is' is not key=value: the shell split the value of "
                                       "samples.prompts at its spaces into 3 arguments; quote the override whole, "
                                       """e.g. 'samples.prompts=["What is x?"]'\n""")


def _tree(key: str, value) -> dict:
    *parents, leaf = key.split(".")
    tree = {leaf: value}
    for part in reversed(parents):
        tree = {part: tree}
    return tree
