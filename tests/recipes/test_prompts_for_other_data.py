"""A run on the user's own data with the shipped config's samples.prompts says so: one line in the log at startup,
and (fine-tuning) a note atop samples.md (toolkit.training.sample_prompts). The recipes' main() in this process, on
the tiny model: a few seconds each."""

from __future__ import annotations

from pydoc_data.topics import topics

import pytest
from recipe_runner import FT_TINY, ROOT, TINY, recipe_module

CONFIGS = ROOT / "recipes" / "configs"


pytestmark = pytest.mark.usefixtures("recipe_in_process")


@pytest.fixture
def own_text(tmp_path):
    path = tmp_path / "my_notes.txt"
    path.write_text("\n\n".join(topics[name] for name in ("with", "try", "lambda", "if", "for", "while")))
    return path


def test_a_fine_tune_on_its_own_data_with_the_configs_prompts_says_so(capsys, tmp_path, tiny_base, own_text):
    finetune = recipe_module("finetune")
    common = ["--config", str(CONFIGS / "finetune_smollm2_lora.yaml"), *FT_TINY, "train.max_steps=1",
              f"model.path={tiny_base}", "data.seq_len=64", "samples.max_new_tokens=2", "adapter.merge=false"]
    assert finetune.main([*common, f"data.path={own_text}", f"output_dir={tmp_path / 'own'}"]) == 0
    out = capsys.readouterr()
    said = [line for line in (out.out + out.err).splitlines() if "[finetune] samples:" in line]
    assert said == [f"[finetune] samples: the prompts are the shipped config's (written for its data), not about yours "
                    f"(data.path={own_text}); set 'samples.prompts=[a question about your data, another]' for samples "
                    "that show what this run learned"]
    samples = (tmp_path / "own" / "samples.md").read_text().splitlines()
    assert samples[2].startswith(f"> Note: these prompts are the shipped config's, written for its data, not for this "
                                 f"run's (data.path={own_text})")
    # its own prompts: nothing said, and samples.md as before
    assert finetune.main([*common, f"data.path={own_text}", "samples.prompts=What does with do?",
                          f"output_dir={tmp_path / 'prompts'}"]) == 0
    out = capsys.readouterr()
    assert "samples:" not in out.out + out.err
    assert (tmp_path / "prompts" / "samples.md").read_text().splitlines()[2] == (
        "Greedy decoding; the same prompts before and after training.")


def test_pretraining_on_its_own_data_with_the_configs_prompts_says_so(capsys, tmp_path, own_text):
    pretrain = recipe_module("pretrain")
    argv = ["--config", str(CONFIGS / "pretrain_tiny.yaml"), *TINY, "train.max_steps=1", "checkpoint.every=0",
            "eval.every=0", "samples.max_new_tokens=2", f"data.path={own_text}", f"output_dir={tmp_path / 'run'}"]
    assert pretrain.main(argv) == 0
    out = capsys.readouterr()
    assert [line for line in (out.out + out.err).splitlines() if "[pretrain] samples:" in line] == [
        f"[pretrain] samples: the prompts are the shipped config's (written for its data), not about yours "
        f"(data.path={own_text}); set 'samples.prompts=[a question about your data, another]' for samples that show "
        "what this run learned"]
