"""The recipes' config trees: one name per concept, and the renamed keys still working for a release."""

from __future__ import annotations

from pathlib import Path

import pytest

from toolkit.config.errors import ConfigError
from toolkit.config.load import load_config
from toolkit.training.recipe_config import FinetuneConfig, PretrainConfig

CONFIGS = Path(__file__).resolve().parents[3] / "recipes" / "configs"


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_load_with_no_deprecated_key(path):
    cls = PretrainConfig if path.name.startswith("pretrain") else FinetuneConfig
    notes: list[str] = []
    cfg = load_config(cls, path, [], notes)
    assert notes == []
    assert cfg.eval.every >= 0 and cfg.samples.max_new_tokens >= 0


def test_both_recipes_name_the_shared_sections_alike():
    shared = {"output_dir", "seed", "resume", "overwrite", "model", "data", "train", "optim", "checkpoint", "logging",
              "eval", "samples"}
    pre = set(PretrainConfig.__dataclass_fields__)
    fine = set(FinetuneConfig.__dataclass_fields__)
    assert shared <= pre and shared <= fine
    for section in ("optim", "checkpoint", "logging", "eval", "samples"):
        assert type(getattr(PretrainConfig(), section)) is type(getattr(FinetuneConfig(), section)), section
    # fine-tuning's train section is the shared one plus what the model is trained to do (train.objective)
    assert isinstance(FinetuneConfig().train, type(PretrainConfig().train))
    for key in ("attn_implementation", "gradient_checkpointing", "gradient_checkpointing_k"):
        assert key in PretrainConfig().model.__dataclass_fields__ and key in FinetuneConfig().model.__dataclass_fields__


def test_old_pretraining_keys_move_to_their_new_names_with_one_line_each(tmp_path):
    old = tmp_path / "old.yaml"
    old.write_text("logging:\n  every: 2\n  eval_every: 7\n  eval_blocks: 3\nsample:\n  prompt: Once\n  max_new_tokens: 5\n")
    notes: list[str] = []
    cfg = load_config(PretrainConfig, old, [], notes)
    assert (cfg.logging.every, cfg.eval.every, cfg.eval.blocks) == (2, 7, 3)
    assert cfg.samples.prompts == ["Once"] and cfg.samples.max_new_tokens == 5
    assert len(notes) == 4 and all("\n" not in n and n.startswith("deprecated: the config key ") for n in notes)
    assert "sample.prompt is now samples.prompts" in " ".join(notes)


def test_old_finetune_section_name_and_overrides(tmp_path):
    notes: list[str] = []
    cfg = load_config(FinetuneConfig, CONFIGS / "finetune_smollm2_lora.yaml",
                      ["base_model.path=/models/x", "base_model.gradient_checkpointing=full", "logging.eval_every=9"], notes)
    assert cfg.model.path == "/models/x" and cfg.model.gradient_checkpointing == "full" and cfg.model.dtype == "compute"
    assert cfg.eval.every == 9  # an old-name override still wins over the file's new key
    assert sorted(notes) == sorted([
        "deprecated: the config key base_model is now model; the old name stops working in the next release",
        "deprecated: the config key logging.eval_every is now eval.every; the old name stops working in the next release",
    ])


def test_the_same_setting_under_both_names_in_one_place_is_refused(tmp_path):
    both = tmp_path / "both.yaml"
    both.write_text("logging:\n  eval_every: 7\neval:\n  every: 8\n")
    with pytest.raises(ConfigError, match="logging.eval_every and eval.every are the same setting"):
        load_config(PretrainConfig, both, [])


def test_yaml_no_is_the_string_no_for_a_choice():
    """YAML 1.1 reads `no` as false; train.mixed_precision=no must still mean fp32."""
    assert load_config(PretrainConfig, None, ["train.mixed_precision=no"]).train.mixed_precision == "no"
    with pytest.raises(ConfigError, match=r"train.mixed_precision=yes/on/true \(YAML's true\) is not one of"):
        load_config(PretrainConfig, None, ["train.mixed_precision=yes"])
    # and `false` is the choice none: model.compile was true/false before it named what it compiles
    assert load_config(PretrainConfig, None, ["model.compile=false"]).model.compile == "none"
    with pytest.raises(ConfigError, match=r"model.compile=yes/on/true \(YAML's true\) is not one of none, layers, model"):
        load_config(PretrainConfig, None, ["model.compile=true"])


@pytest.mark.parametrize("seed", [-1, 2**32, 2**50])
def test_a_seed_numpy_or_the_data_order_cannot_take_is_refused(seed):
    """numpy refuses a negative seed (a ValueError traceback while splitting the corpus), and the batch
    order's generator overflowed on seed x 1,000,003 past 64 bits."""
    with pytest.raises(ConfigError) as excinfo:
        load_config(PretrainConfig, None, [f"seed={seed}"])
    assert excinfo.value.problems == [f"seed={seed} must be in [0, 4294967295]"]
    assert load_config(PretrainConfig, None, [f"seed={2**32 - 1}"]).seed == 2**32 - 1


def test_a_collective_timeout_beyond_a_year_is_refused():
    """train.collective_timeout_s=2**63-1 was an OverflowError traceback (timedelta) while the launch built its group."""
    with pytest.raises(ConfigError) as excinfo:
        load_config(PretrainConfig, None, ["train.collective_timeout_s=9223372036854775807"])
    assert excinfo.value.problems == ["train.collective_timeout_s=9223372036854775807 must be at most 31536000 (a year)"]


@pytest.mark.parametrize(("objective", "beta"), [("dpo", 0.1), ("simpo", 2.0), ("orpo", 0.1)])
def test_an_empty_beta_is_the_objectives_usual_value_and_a_given_one_is_kept(objective, beta, tmp_path):
    cfg = load_config(FinetuneConfig, None, [f"train.objective={objective}", "data.format=preference"])
    assert cfg.train.beta is None and cfg.train.preference().beta == beta
    cfg = load_config(FinetuneConfig, None, [f"train.objective={objective}", "data.format=preference", "train.beta=0.5"])
    assert cfg.train.preference().beta == 0.5 and cfg.train.preference().objective == objective
    assert load_config(FinetuneConfig, None, []).train.preference() is None  # sft
    used = {"simpo": ("gamma", 0.5), "orpo": ("orpo_lambda", 0.1)}.get(objective)  # its own setting, when empty
    if used:
        assert getattr(cfg.train, used[0]) is None and getattr(cfg.train.preference(), used[0]) == used[1]


@pytest.mark.parametrize(("overrides", "said"), [
    (["data.record_format=sharegpt"], "record_format=sharegpt names the shape of chat records; format=text does not read it"),
    (["data.format=preference", "train.objective=dpo", "data.record_format=alpaca"], "format=preference does not read it"),
    (["data.chat_template=x.jinja"], "chat_template is for format=chat or preference"),
    (["data.format=chat", "data.record_format=sharegpt"], "the embedded set needs none: give data.path, or drop it"),
    (["data.val_path=held.jsonl", "data.sources=[{name: a, weight: 1}]"], "with sources each source holds out its own"),
    (["data.path=wikitext", "data.val_path=wikitext"], "val_path=wikitext is data.path itself: the held-out data would be "
                                                        "trained on"),
    (["data.columns.conversation=dialog"], "columns.conversation=dialog maps chat records; format=text does not read it"),
    (["data.format=chat", "data.path=x.jsonl", "data.columns.conversation=dialog", "data.record_format=sharegpt"],
     "record_format=sharegpt and columns.conversation=dialog both say how to read the records"),
    # a mixture source's own record shape or mapping (issue 43: data.sources for chat as for text)
    (["data.sources=[{name: a, path: a.txt, record_format: alpaca}]"],
     r"data.sources\[0\].record_format maps chat records; format=text does not read it"),
    (["data.format=chat", "data.sources=[{name: a, path: a.jsonl, columns: {role: speaker}}]"],
     r"data.sources\[0\].columns has no conversation: name the column holding the turns"),
    (["data.format=chat", "data.sources=[{name: a, path: a.jsonl, columns: {conversation: d, speaker: s}}]"],
     r"data.sources\[0\].columns names speaker; its keys are conversation, role, content, user, assistant, system"),
    (["data.format=chat", "data.sources=[{name: a, path: a.jsonl, columns: {conversation: d}, record_format: alpaca}]"],
     r"data.sources\[0\].record_format=alpaca and its columns both say how to read its records: keep one"),
])
def test_a_chat_setting_that_the_data_format_would_not_use_is_refused(overrides, said):
    """Set and silently not used (issue 44's class): each is one line."""
    with pytest.raises(ConfigError, match=said):
        load_config(FinetuneConfig, CONFIGS / "finetune_smollm2_lora.yaml", overrides)
    load_config(FinetuneConfig, CONFIGS / "finetune_smollm2_chat_lora.yaml", ["data.record_format=sharegpt",
                                                                              "data.path=chats.jsonl"])


def test_a_pretraining_source_naming_a_chat_shape_is_refused():
    with pytest.raises(ConfigError, match=r"data.sources\[0\].columns maps chat records; pretraining reads text: drop it"):
        load_config(PretrainConfig, None, ["data.sources=[{name: a, path: a.txt, columns: {conversation: dialog}}]"])


@pytest.mark.parametrize("cls", [PretrainConfig, FinetuneConfig], ids=lambda c: c.__name__)
def test_the_path_keys_load_config_expands_are_the_classified_paths_this_recipe_has(cls):
    """Every text key says on its field whether it is a path (test_run_paths); these are the paths."""
    from toolkit.training.recipe_keys import PATH_SETTINGS

    expected = {"output_dir", "resume", "data.path", "data.sources[].path", "data.cache_dir", "eval.harness_include_path"} | (
        {"tokenizer.path"} if cls is PretrainConfig else
        {"data.val_path", "data.chat_template", "model.path", "model.gguf_file", "model.cache_dir", "forgetting.general"})
    assert set(cls.PATHS) == expected and all(PATH_SETTINGS[k] for k in cls.PATHS)


# what each path key needs beside it to load (data.chat_template is read for chat records only)
NEEDS = {"data.chat_template": ["data.format=chat"]}


@pytest.mark.parametrize("cls, key", [(c, k) for c in (PretrainConfig, FinetuneConfig) for k in c.PATHS],
                         ids=lambda x: getattr(x, "__name__", x))
def test_every_path_key_takes_paths_as_users_write_them(cls, key, tmp_path, monkeypatch):
    """~, $VAR and ${VAR} expanded the same way in every path key, before the range checks look for the file (a
    chat_template of ~/t.jinja was "does not exist"; output_dir=~/runs/x made a folder named ~); relative paths stay
    relative to where the recipe runs; an unset variable is one line naming the key."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("RUNS", str(tmp_path))
    monkeypatch.delenv("LLM_TOOLKIT_TEST_UNSET", raising=False)
    (tmp_path / "f").write_text("{{ messages }}")
    (tmp_path / "some").mkdir()
    (tmp_path / "some" / "where").write_text("{{ messages }}")
    monkeypatch.chdir(tmp_path)

    def loaded(value: str):
        override = (f"data.sources=[{{name: a, path: '{value}'}}]" if key == "data.sources[].path" else
                    f"{key}={value}")
        cfg = load_config(cls, None, [override, *NEEDS.get(key, [])])
        node = cfg
        for part in key.split("."):
            node = getattr(node, part.removesuffix("[]"))
            node = node[0] if part.endswith("[]") else node
        return node

    for written in ("~/f", "$RUNS/f", "${RUNS}/f"):
        assert loaded(written) == str(tmp_path / "f"), written
    assert loaded("some/where") == "some/where"
    with pytest.raises(ConfigError) as excinfo:
        loaded("$LLM_TOOLKIT_TEST_UNSET/f")
    shown = key.replace("[]", "[0]")
    assert str(excinfo.value) == (f"{shown}=$LLM_TOOLKIT_TEST_UNSET/f names the environment variable "
                                  "LLM_TOOLKIT_TEST_UNSET, which is not set; set it (export LLM_TOOLKIT_TEST_UNSET=...) "
                                  "or write the path out")


def test_a_chat_template_given_as_text_is_not_expanded():
    cfg = load_config(FinetuneConfig, None, ["data.format=chat", "data.chat_template={{ '$HOME ~' ~ m }}"])
    assert cfg.data.chat_template == "{{ '$HOME ~' ~ m }}"


@pytest.mark.parametrize("cls, key", [(c, k) for c in (PretrainConfig, FinetuneConfig) for k in c.PATHS],
                         ids=lambda x: getattr(x, "__name__", x))
def test_a_relative_path_found_only_beside_the_config_is_one_line(cls, key, tmp_path, monkeypatch):
    """A YAML in another folder naming `data/f` that is beside it, not where the recipe runs: one line with both fixes,
    not "does not exist" from whichever reader meets it first (or, for output_dir, a fresh run somewhere else)."""
    import yaml

    (tmp_path / "proj" / "data").mkdir(parents=True)
    (tmp_path / "proj" / "data" / "f").write_text("{{ messages }}")
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    tree: dict = {}
    node = tree
    *sections, leaf = key.split(".")
    for part in sections:
        if part.endswith("[]"):
            node[part[:-2]] = [{"name": "a"}]
            node = node[part[:-2]][0]
        else:
            node = node.setdefault(part, {})
    node[leaf] = "data/f"
    (tmp_path / "proj" / "cfg.yaml").write_text(yaml.safe_dump(tree))
    with pytest.raises(ConfigError) as excinfo:
        load_config(cls, "../proj/cfg.yaml", NEEDS.get(key, []))
    shown = key.replace("[]", "[0]")
    assert str(excinfo.value) == (
        f"{shown}=data/f (in ../proj/cfg.yaml) is not in {tmp_path / 'here'}, where relative paths start, but it is "
        f"beside the config; write {shown}={tmp_path / 'proj/data/f'}, or launch from {tmp_path / 'proj'}")
    (tmp_path / "here" / "data").mkdir()
    (tmp_path / "here" / "data" / "f").write_text("{{ messages }}")
    assert load_config(cls, "../proj/cfg.yaml", NEEDS.get(key, []))  # where it runs, it is taken as written


def test_an_empty_output_dir_is_not_the_folder_the_recipe_runs_in():
    """output_dir='' was Path(''): the run wrote into the folder it was launched from."""
    with pytest.raises(ConfigError, match=r"^output_dir='' is blank; give a path, or drop it for the default, runs/pretrain$"):
        load_config(PretrainConfig, None, ["output_dir=''"])
