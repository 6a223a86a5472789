"""Every key of the recipe configs x the edge values its type allows: each is refused in one line naming the key,
or accepted here with the reason it is right (issue 44: an empty samples prompt crashed generate after training).

The edge values are derived from each key's type hint (toolkit.config.keys.dotted_keys), written as a user writes them
on the command line; each key's field says which of them a run takes and why (accepts=, gathered in
toolkit.training.recipe_keys.ACCEPTS; a reason starting "pretrain:" or "finetune:" holds in that recipe only). Every
other is refused, so a new key's accepted values are declared before it ships. A value accepted here but failing later
(after training, mid-run) is a hole to close in the section's validate(), not a reason to add."""

from __future__ import annotations

import re
import types
import typing

import pytest

from toolkit.config.declarations import Need
from toolkit.config.errors import ConfigError
from toolkit.config.keys import dotted_keys
from toolkit.config.load import load_config
from toolkit.training.recipe_config import FinetuneConfig, PretrainConfig
from toolkit.training.recipe_keys import ACCEPTS, USED_WHEN

RECIPES = {"pretrain": PretrainConfig, "finetune": FinetuneConfig}

STR = {"empty": '""', "blank": '"   "', "long": "x" * 5000, "nul": '"a\\0b"', "newline": '"a\\nb"'}
INT = {"0": "0", "-1": "-1", "2**31": str(2**31), "2**63": str(2**63), "1.5": "1.5", "abc": "abc"}
FLOAT = {"0": "0", "-1": "-1", "nan": "nan", "inf": "inf", "1e308": "1e308", "abc": "abc"}
WRONG_ITEM = {int: "[a]", float: "[a]"}


def edges(hint: typing.Any) -> dict[str, str]:
    """label -> the value as written after `key=`; "unset" is `key=` itself (None)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        out = {"unset": ""}
        for arg in args:
            if arg is not type(None):
                out |= edges(arg)
        return out
    if hint is str:
        return {"unset": "", **STR}
    if hint is int:
        return {"unset": "", **INT}
    if hint is float:
        return {"unset": "", **FLOAT}
    if hint is bool:
        return {"unset": "", "maybe": "maybe", "2": "2"}
    if origin is typing.Literal:
        return {"unset": "", "UPPER": str(args[0]).upper(), "empty": '""'}
    if origin is list and args[0] is str:  # its entries are text on the command line: [null] is the string "null"
        return {"unset": "", "[]": "[]", '[""]': '[""]', "open": "[a, b"}
    if origin is list:
        return {"unset": "", "scalar": "x", "[]": "[]", '[""]': '[""]', "[null]": "[null]",
                "[wrong]": WRONG_ITEM.get(args[0], "[a]")}
    if origin is dict or hint is dict:
        return {"unset": "", "[]": "[]", "scalar": "x"}
    raise AssertionError(f"no edge values for the type {hint}: add them to edges()")


# Settings a key has an effect under only (toolkit.training.unused), beyond USED_WHEN's: without them, every value
# is refused for having no effect, and the walk would not reach the key's own checks.
CONTEXT = {
    "train.beta": ["train.objective=dpo", "data.format=preference"],
    "train.gamma": ["train.objective=simpo", "data.format=preference"],
    "train.orpo_lambda": ["train.objective=orpo", "data.format=preference"],
    **{key: ["data.format=chat"] for key in ("data.chat_template", "data.record_format", "data.columns.conversation")},
    **{f"eval.harness_{key}": ["eval.harness_tasks=[my_task]"] for key in ("include_path", "num_fewshot", "limit")},
}


def context(cls: type, key: str) -> list[str]:
    """The overrides under which `key` has an effect in `cls`, where `cls` has them and accepts them alone."""
    need = USED_WHEN.get(key)
    overrides = CONTEXT.get(key, [])
    if isinstance(need, Need):
        value = need.values[0]
        overrides = [f"{need.on}={'' if value is None else str(value).lower() if isinstance(value, bool) else value}"]
    try:
        load_config(cls, None, overrides)
    except ConfigError:  # data.streaming in fine-tuning: the key then has no effect, and says so
        return []
    return overrides


def names(line: str, key: str) -> bool:
    """Whether a problem line names `key`: `data.seq_len=...`, `data.sources[0].name ...`, `missing required key X`."""
    return re.search(rf"(^|\s){re.escape(key)}(?=[=\s\[:.]|$)", line) is not None


CASES = [(recipe, key) for recipe, cls in RECIPES.items() for key in dotted_keys(cls)]


@pytest.mark.parametrize(("recipe", "key"), CASES, ids=[f"{r}-{k}" for r, k in CASES])
def test_every_edge_value_is_refused_in_one_line_or_accepted_with_its_reason(recipe, key):
    cls = RECIPES[recipe]
    hint = dotted_keys(cls)[key]
    reasons = ACCEPTS.get(key, {})
    accepts = {label for label, why in reasons.items() if not re.match(r"(pretrain|finetune):", why)
               or why.startswith(f"{recipe}:")}
    unknown = set(reasons) - set(edges(hint))
    assert not unknown, f"{key}'s accepts= names {unknown}, which are not edge values of {hint}"
    base = context(cls, key)
    wrong = []
    for label, written in edges(hint).items():
        try:
            load_config(cls, None, [*base, f"{key}={written}"])
        except ConfigError as exc:
            bad = [p for p in exc.problems if "\n" in p or len(p) > 400]
            if bad:
                wrong.append(f"{label}: a problem of more than one line or 400 characters: {bad[0][:200]!r}")
            elif label in accepts:
                wrong.append(f"{label}: refused, but its accepts= takes it ({reasons[label]}): {exc.problems}")
            elif not any(names(p, key) for p in exc.problems):
                wrong.append(f"{label}: refused without naming {key}: {exc.problems}")
        else:
            if label not in accepts:
                wrong.append(f"{label} ({written[:20]!r}): accepted; refuse it in the section's validate(), or say "
                             "in its field's accepts= why a run takes it")
    assert not wrong, f"{recipe} {key}:\n" + "\n".join(wrong)


def test_the_table_names_only_keys_of_the_recipes():
    keys = set(dotted_keys(PretrainConfig)) | set(dotted_keys(FinetuneConfig))
    assert set(CONTEXT) <= keys


# model.config is a mapping passed to transformers: a few of its keys, each refused in one line naming it.
MODEL_CONFIG = {
    "hidden_size=0": "model.config.hidden_size",
    "hidden_size=-1": "model.config.hidden_size",
    "hidden_size=abc": "model.config.hidden_size",
    "num_attention_heads=3": "model.config.hidden_size",  # the default hidden size, 4096, and the heads: one line
    "num_hidden_layers=0": "model.config.num_hidden_layers",
    "vocab_size=0": "model.config.vocab_size",
    "max_position_embeddings=0": "model.config.max_position_embeddings",
    "max_position_embeddings=16": "data.seq_len",  # blocks of 256 tokens do not fit
    "hidden_sise=64": "model.config.hidden_sise",  # misspelt
    "hidden_act=gleu": "model.config.hidden_act",  # was transformers' KeyError traceback as the model was built
    "rope_theta=500000": "model.config.rope_theta",  # a key of its own before transformers 5
    "rms_norm_eps=-1": "model.config.rms_norm_eps",  # NaN from the first step: 'diverged; lower optim.lr'
    "rms_norm_eps=0": "model.config.rms_norm_eps",
}


@pytest.mark.parametrize(("overrides", "line"), [
    (["model.config.hidden_act=gleu"], "config.hidden_act='gleu' is not an activation transformers has; did you mean "
                                       "gelu? its activations are gelu, gelu_10,"),
    (["model.model_type=gpt2", "model.config.activation_function=relu_new"],
     "config.activation_function='relu_new' is not an activation transformers has; did you mean"),
    (["model.config.rope_theta=500000"], "config.rope_theta is not a llama config key; transformers keeps it in "
                                         "rope_parameters: write config.rope_parameters={rope_type: default, "
                                         "rope_theta: 500000}"),
])
def test_an_activation_or_a_moved_rope_key_is_said_with_what_to_write(overrides, line):
    """model.config.hidden_act=gleu was a KeyError traceback from transformers' ACT2FN after the data work; rope_theta
    (a key before transformers 5, in older recipes) was 'not a llama config key' with no hint (issue 44's probe)."""
    with pytest.raises(ConfigError) as caught:
        load_config(PretrainConfig, None, overrides)
    assert any(line in p for p in caught.value.problems), caught.value.problems


@pytest.mark.parametrize("written", list(MODEL_CONFIG))
def test_a_wrong_model_config_value_is_one_line_naming_it(written):
    with pytest.raises(ConfigError) as caught:
        load_config(PretrainConfig, None, [f"model.config.{written}"])
    assert all("\n" not in p for p in caught.value.problems)
    assert any(names(p, MODEL_CONFIG[written]) for p in caught.value.problems), caught.value.problems
