"""samples.prompts kept from a shipped config (or the default) on a user's own data: said at startup and atop
samples.md (toolkit.training.sample_prompts). A user's fine-tune on their data compared the base and the result on
the config's questions about Python, with no word that the prompts were not theirs."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from toolkit.config.load import load_config
from toolkit.training.recipe_config import FinetuneConfig, PretrainConfig
from toolkit.training.sample_prompts import prompts_line, prompts_note
from toolkit.training.samples import write_samples

CONFIGS = Path(__file__).resolve().parents[3] / "recipes" / "configs"
SHIPPED = sorted(p.name for p in CONFIGS.glob("*.yaml"))


def _load(name: str | None, *overrides: str):
    cls = PretrainConfig if name and name.startswith("pretrain") else FinetuneConfig
    return load_config(cls, CONFIGS / name if name else None, list(overrides))


@pytest.mark.parametrize("name", SHIPPED)
def test_a_shipped_config_on_its_own_data_says_nothing_and_on_yours_says_whose_prompts_they_are(name):
    assert prompts_line(_load(name)) is None and prompts_note(_load(name)) is None
    cfg = _load(name, "data.path=my_notes.jsonl")
    assert prompts_line(cfg) == (
        "samples: the prompts are the shipped config's (written for its data), not about yours "
        "(data.path=my_notes.jsonl); set 'samples.prompts=[a question about your data, another]' for samples that "
        "show what this run learned")
    assert prompts_note(cfg).startswith("Note: these prompts are the shipped config's, written for its data, not for "
                                        "this run's (data.path=my_notes.jsonl); set samples.prompts")
    # the same prompts, copied into a YAML of the user's that reads their data
    written = yaml.safe_load((CONFIGS / name).read_text())["samples"]["prompts"]
    assert prompts_line(_load(None, "data.path=my_notes.jsonl", f"samples.prompts={written}")) is not None


@pytest.mark.parametrize("overrides", [
    ["samples.prompts=[How do I cite a source?]"],  # their own prompts
    ["samples.max_new_tokens=0"],  # no samples
    ["samples.prompts=[]"],
    ["data.path="],  # the embedded corpus, the prompts' own
])
def test_own_prompts_or_no_samples_say_nothing(overrides):
    assert prompts_line(_load("finetune_smollm2_lora.yaml", "data.path=my_notes.jsonl", *overrides)) is None


def test_a_mixture_of_the_users_sources_and_the_default_prompts_say_so():
    cfg = _load(None, "data.sources=[{name: mine, path: my_notes.jsonl}, {name: docs}]")
    assert prompts_line(cfg).startswith("samples: the prompts are the default's (written for its data), not about "
                                        "yours (data.sources)")


def test_a_shipped_configs_prompts_on_another_shipped_configs_data_are_not_about_it():
    """The large configs' prompts are the SmolLM2 chat configs' first question and another: written for UltraChat;
    SmolLM2's own, for the embedded Q&A set, are not."""
    ultrachat = "data.path=HuggingFaceH4/ultrachat_200k"
    assert prompts_line(_load("finetune_llama3.1_8b_lora.yaml")) is None
    assert prompts_line(_load("finetune_smollm2_chat_lora.yaml", ultrachat)) is not None


def test_the_note_heads_samples_md(tmp_path):
    note = prompts_note(_load("finetune_smollm2_lora.yaml", "data.path=my_notes.jsonl"))
    path = write_samples(tmp_path / "samples.md", ["The with statement"], ["a"], ["b"], "base, lora", note=note)
    assert path.read_text().splitlines()[:5] == ["# Samples: base, lora", "", f"> {note}", "",
                                                 "Greedy decoding; the same prompts before and after training."]
    path = write_samples(tmp_path / "samples.md", ["The with statement"], ["a"], ["b"], "base, lora")
    assert path.read_text().splitlines()[:3] == ["# Samples: base, lora", "",
                                                 "Greedy decoding; the same prompts before and after training."]
