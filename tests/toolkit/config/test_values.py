"""Every key of the recipe configs x the edge values its type allows: each is refused in one line naming the key,
or accepted here with the reason it is right (issue 44: an empty samples prompt crashed generate after training).

The edge values are derived from each key's type hint (toolkit.config.keys.dotted_keys), written as a user writes them
on the command line; ACCEPTS lists, per key, the edge values a run takes and why. A key missing from ACCEPTS fails,
so a new key is classified before it ships. A value accepted here but failing later (after training, mid-run) is
a hole to close in the section's validate(), not a row to add."""

from __future__ import annotations

import re
import types
import typing

import pytest

from toolkit.config.errors import ConfigError
from toolkit.config.keys import dotted_keys
from toolkit.config.load import load_config
from toolkit.training.recipe_config import FinetuneConfig, PretrainConfig
from toolkit.training.unused import USED_WHEN, Need

RECIPES = {"pretrain": PretrainConfig, "finetune": FinetuneConfig}

STR = {"empty": '""', "blank": '"   "', "long": "x" * 5000, "nul": '"a\\0b"', "newline": '"a\\nb"'}
INT = {"0": "0", "-1": "-1", "2**31": str(2**31), "2**63": str(2**63), "1.5": "1.5", "abc": "abc"}
FLOAT = {"0": "0", "-1": "-1", "nan": "nan", "inf": "inf", "1e308": "1e308", "abc": "abc"}
WRONG_ITEM = {str: "[[1]]", int: "[a]", float: "[a]"}


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
    if origin is list:
        return {"unset": "", "scalar": "x", "[]": "[]", '[""]': '[""]', "[null]": "[null]",
                "[wrong]": WRONG_ITEM.get(args[0], "[a]")}
    if origin is dict or hint is dict:
        return {"unset": "", "[]": "[]", "scalar": "x"}
    raise AssertionError(f"no edge values for the type {hint}: add them to edges()")


# key -> {edge label: why a run takes it}. A reason starting "pretrain:" or "finetune:" holds in that recipe only.
ACCEPTS: dict[str, dict[str, str]] = {
    "output_dir": {},
    "seed": {"0": "a seed like any other", "2**31": "within numpy's seed range (up to 2**32 - 1)"},
    "resume": {"unset": "no resume: the default"},
    "overwrite": {},
    "train.max_steps": {"2**31": "a long run: stopped any time by Ctrl-C or SIGTERM, it checkpoints and resumes"},
    "train.epochs": {"unset": "train.max_steps counts the run: the default"},
    "train.global_batch_size": {"2**31": "refused once the data is packed, before training: fewer blocks than one "
                                "step (toolkit.data.batching)"},
    "train.micro_batch_size": {"2**31": "refused at launch by the layout: it does not divide global_batch_size"},
    "train.mixed_precision": {},
    "train.fp8_recipe": {},
    "train.fp8_layers": {},
    "train.collective_timeout_s": {},
    "train.on_nonfinite": {},
    "train.pipeline_stages": {"2**31": "refused at launch: it does not divide the processes launched "
                              "(toolkit.strategy.parallelism)"},
    "train.step_sync": {},
    "train.max_nonfinite_skips": {"2**31": "never stop for skipped steps: each is still said"},
    "train.objective": {},
    "train.beta": {"unset": "the objective's usual beta (0.1, or 2.0 for simpo)"},
    "train.gamma": {"unset": "simpo's usual margin, 0.5", "0": "simpo with no margin"},
    "train.orpo_lambda": {"unset": "orpo's usual weight, 0.1", "0": "orpo without its odds-ratio term"},
    "optim.lr": {},
    "optim.min_lr_ratio": {"0": "cosine down to 0"},
    "optim.warmup_steps": {"0": "no warmup: the default", "2**31": "a warmup longer than the run: the lr it reaches is "
                           "logged each step, and a resume that raises max_steps goes on to the peak"},
    "optim.schedule": {},
    "optim.weight_decay": {"0": "no decay"},
    "optim.betas": {},
    "optim.eps": {},
    "optim.max_grad_norm": {"0": "no clipping, as documented"},
    "optim.fused": {},
    "optim.lr_scaling": {},
    "optim.lr_reference_batch": {"0": "the default; lr_scaling=none does not read it",
                                 "2**31": "the batch lr was tuned at: the scaled rate is what the run logs"},
    "checkpoint.every": {"0": "only at the end", "2**31": "only at the end"},
    "checkpoint.final_dtype": {},
    "checkpoint.keep_last": {"2**31": "keep every checkpoint"},
    "checkpoint.on_save_error": {},
    "checkpoint.async_save": {},
    "logging.every": {"2**31": "metrics at the last step only"},
    "logging.trackers": {"[]": "metrics.jsonl only, as documented"},
    "logging.profile": {"[]": "no profiling: the default"},
    "eval.every": {"0": "only at the end", "2**31": "only at the end"},
    "eval.blocks": {"0": "every held-out block", "2**31": "every held-out block"},
    "eval.harness_tasks": {"[]": "nothing scored: the default"},
    "eval.harness_include_path": {"unset": "the harness's own tasks only: the default"},
    "eval.harness_num_fewshot": {"unset": "each task's own number of shots", "0": "no shots", "2**31": "more than a "
                                 "task has is refused at the start, once its examples are read (harness.check_tasks)"},
    "eval.harness_limit": {"unset": "every document"},
    "samples.prompts": {"[]": "no samples"},
    "samples.max_new_tokens": {"0": "no samples", "2**31": "finetune: refused once the base model is loaded, "
                               "before any sample or training (recipes/finetune.py: more than its positions)"},
    "model.attn_implementation": {},
    "model.gradient_checkpointing": {},
    "model.gradient_checkpointing_k": {"2**31": "at most one layer is recomputed: harmless, if of little use"},
    "model.compile": {},
    "model.cast_weights": {},
    "model.loss": {},
    "model.loss_chunk_tokens": {"2**31": "one chunk: the whole micro-batch, as loss=full"},
    "model.model_type": {},
    "model.config": {},
    "model.init_seed": {"unset": "the run's seed", "0": "torch takes any 64-bit seed", "-1": "torch takes any "
                        "64-bit seed", "2**31": "torch takes any 64-bit seed"},
    "model.path": {"unset": "SmolLM2-135M-Instruct, the documented default"},
    "model.gguf_file": {"unset": "model.path read as a Hugging Face folder"},
    "model.dtype": {},
    "model.gguf_cache": {},
    "model.cache_dir": {"unset": "~/.cache/llm-toolkit"},
    "tokenizer.path": {"unset": "a BPE trained on the corpus: the default"},
    "tokenizer.vocab_size": {},
    "tokenizer.min_frequency": {"0": "no minimum: as 1", "2**31": "no pair merges: a byte-level vocabulary, whose "
                                "size the run says"},
    "tokenizer.train_documents": {"0": "all of them, as documented", "2**31": "all of them"},
    "adapter.method": {},
    "adapter.r": {"2**31": "the layers' widths are known once the base is loaded: a rank past them is issue 44's "
                  "adapter.r item, for toolkit.models.adapter"},
    "adapter.alpha": {},
    "adapter.dropout": {"0": "no dropout: peft's default"},
    "adapter.target_modules": {},
    "adapter.merge": {},
    "adapter.dora": {},
    "adapter.rslora": {},
    "adapter.modules_to_save": {"[]": "none: the default"},
    "adapter.layers": {"[]": "every layer, as documented"},
    "data.path": {"unset": "the embedded corpus, as documented (data.path=)"},
    "data.text_column": {"long": "a column is looked up by name: a missing one is refused when the data is read"},
    "data.sample_by": {},
    "data.name": {"unset": "no hub config: the default", "long": "a hub config is looked up by name: a missing one "
                  "is refused when the data is read"},
    "data.split": {"long": "a split is looked up by name: a missing one is refused when the data is read"},
    "data.val_fraction": {"0": "no held-out data, as documented"},
    "data.seq_len": {"2**31": "finetune: refused once the base model is loaded, before any data work (more than "
                     "its positions)"},
    "data.num_proc": {"2**31": "datasets forks only where the corpus has 2 x num_proc documents: here, none"},
    "data.cache_dir": {"unset": "~/.cache/llm-toolkit"},
    "data.streaming": {},
    "data.stream_val_documents": {"2**31": "a stream of fewer documents is refused once read, before training "
                                  "(recipes/pretrain.py: it leaves none to train on); fine-tuning does not stream, and "
                                  "the note says the key is ignored",
                                  "0": "finetune: it does not stream, and the note says the key is ignored",
                                  "-1": "finetune: it does not stream, and the note says the key is ignored"},
    "data.sources": {"[]": "one corpus, data.path: the default"},
    "data.stages": {"[]": "the sources' weights all along: the default"},
    "data.format": {},
    "data.overlong": {},
    "data.chat_template": {"unset": "the tokenizer's own template"},
    "data.val_path": {"unset": "data.val_fraction of data.path is held out"},
    "data.record_format": {},
    "data.columns.conversation": {"unset": "records of a known shape: the default", "long": "a column is looked up "
                                  "by name: a missing one is refused when the data is read"},
    **{f"data.columns.{name}": {"long": "a speaker or key is looked up by name: records without it are refused "
                                "when read"} for name in ("role", "content", "user", "assistant", "system")},
}

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
    assert key in ACCEPTS, f"{key} has no row in ACCEPTS: walk its edge values and classify it"
    cls = RECIPES[recipe]
    hint = dotted_keys(cls)[key]
    accepts = {label for label, why in ACCEPTS[key].items() if not re.match(r"(pretrain|finetune):", why)
               or why.startswith(f"{recipe}:")}
    unknown = set(ACCEPTS[key]) - set(edges(hint))
    assert not unknown, f"ACCEPTS[{key!r}] names {unknown}, which are not edge values of {hint}"
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
                wrong.append(f"{label}: refused, but ACCEPTS takes it ({ACCEPTS[key][label]}): {exc.problems}")
            elif not any(names(p, key) for p in exc.problems):
                wrong.append(f"{label}: refused without naming {key}: {exc.problems}")
        else:
            if label not in accepts:
                wrong.append(f"{label} ({written[:20]!r}): accepted; refuse it in the section's validate(), or say "
                             "in ACCEPTS why a run takes it")
    assert not wrong, f"{recipe} {key}:\n" + "\n".join(wrong)


def test_the_table_names_only_keys_of_the_recipes():
    keys = set(dotted_keys(PretrainConfig)) | set(dotted_keys(FinetuneConfig))
    assert set(ACCEPTS) <= keys, f"ACCEPTS has rows for keys no recipe has: {sorted(set(ACCEPTS) - keys)}"
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
