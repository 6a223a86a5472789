"""What a resume may change since its checkpoint (toolkit.checkpoint.settings)."""

from __future__ import annotations

import re

import pytest

from toolkit.checkpoint.formats import Checkpoint
from toolkit.checkpoint.settings import check_same_data_order
from toolkit.checkpoint.trainer_state import TrainerState
from toolkit.config.errors import UserError


def test_a_resume_with_another_seed_or_global_batch_is_refused_and_anything_else_is_not(tmp_path):
    """The batch order is a function of (seed, step, global batch): changing either would feed the
    resumed run other sequences. A checkpoint older than the global-batch field is not refused."""
    TrainerState(step=3, seed=7, global_batch_size=12).write(tmp_path)
    check_same_data_order(Checkpoint.read(tmp_path), seed=7, global_batch_size=12)
    with pytest.raises(UserError, match=r"train.global_batch_size=12 and this run has train.global_batch_size=16: "
                                        r"the data position would not carry over; resume with train.global_batch_size=12"):
        check_same_data_order(Checkpoint.read(tmp_path), seed=7, global_batch_size=16)
    with pytest.raises(UserError, match=r"seed=7 and this run has seed=8"):
        check_same_data_order(Checkpoint.read(tmp_path), seed=8, global_batch_size=12)
    TrainerState(step=3, seed=7).write(tmp_path)  # written before the field existed: 0
    check_same_data_order(Checkpoint.read(tmp_path), seed=7, global_batch_size=16)


def test_a_mixtures_trained_weights_are_kept_and_its_coming_stages_may_change(tmp_path):
    """The weights of the steps trained are part of the data order; a stage that starts after the checkpoint may be
    added, moved or changed (said in one line)."""
    from toolkit.checkpoint.settings import check_same_mixture
    from toolkit.data.mixture import SourceConfig, StageConfig, weight_plan

    sources = [SourceConfig("web", weight=0.7), SourceConfig("code", weight=0.3)]

    def mixture(*stages: StageConfig) -> dict:
        return {"sources": ["web", "code"], "plan": [[s, list(w)] for s, w in weight_plan(sources, list(stages))]}

    TrainerState(step=50, mixture=mixture(StageConfig(80, {"code": 0.9}))).write(tmp_path)
    said: list[str] = []
    check_same_mixture(Checkpoint.read(tmp_path), mixture(StageConfig(80, {"code": 0.9})), said.append)
    assert said == []
    check_same_mixture(Checkpoint.read(tmp_path), mixture(StageConfig(51, {"code": 1.0}), StageConfig(90, {"web": 0})), said.append)
    assert said == ["resumed with changed data.stages, taken from step 51 on: from step 51: weights web 0.412, code "
                    "0.588; from step 90: weights web 0.000, code 1.000"]
    check_same_mixture(Checkpoint.read(tmp_path), mixture(), said.append)  # the stage to come dropped: the weights in force said
    assert said[-1] == "resumed with changed data.stages, taken from step 51 on: from step 51: weights web 0.700, code 0.300"
    with pytest.raises(UserError, match=r"trained steps 1-50 with other data.sources weights or data.stages than "
                                        r"this run gives those steps; resume with them as they were: only the weights "
                                        r"from step 51 on may change"):
        check_same_mixture(Checkpoint.read(tmp_path), mixture(StageConfig(50, {"code": 0.9})), said.append)
    with pytest.raises(UserError, match=r"was trained on the mixture of web, code \(data.sources\) and this run reads "
                                        r"one corpus \(data.path\): the data position would not carry over"):
        check_same_mixture(Checkpoint.read(tmp_path), {}, said.append)
    TrainerState(step=50).write(tmp_path)
    check_same_mixture(Checkpoint.read(tmp_path), {}, said.append)
    with pytest.raises(UserError, match=r"was trained on one corpus \(data.path\) and this run reads the mixture"):
        check_same_mixture(Checkpoint.read(tmp_path), mixture(), said.append)


def test_a_resume_takes_a_changed_preference_setting_from_the_next_step_and_says_so(tmp_path):
    """The objective and its beta, gamma and lambda are read at every step: a checkpoint records them and a resume
    that changes one names it in the resume line (a pretraining config has none of them)."""
    from toolkit.checkpoint.settings import check_same_settings, take_changed_settings, trained_settings
    from toolkit.config.declarations import declared
    from toolkit.config.load import load_config
    from toolkit.training.recipe_config import FinetuneConfig, PretrainConfig

    dpo = ["train.objective=dpo", "data.format=preference"]
    saved = trained_settings(load_config(FinetuneConfig, None, [*dpo, "train.beta=0.1"]))
    assert {"train.objective", "train.beta"} <= saved.keys()
    # gamma and lambda where the objective uses them, at the value it uses (empty: its usual one)
    assert not {"train.gamma", "train.orpo_lambda"} & saved.keys()
    simpo = trained_settings(load_config(FinetuneConfig, None, ["train.objective=simpo", "data.format=preference"]))
    assert simpo["train.gamma"] == 0.5 and "train.orpo_lambda" not in simpo
    assert "train.objective" not in trained_settings(load_config(PretrainConfig, None, []))
    TrainerState(step=3, seed=1, settings=saved).write(tmp_path)
    on_resume = declared(FinetuneConfig, "resume")
    changed = check_same_settings(Checkpoint.read(tmp_path), trained_settings(load_config(FinetuneConfig, None, [*dpo, "train.beta=0.2"])),
                                  10, on_resume)
    assert changed == {"train.beta": (0.1, 0.2)}
    said: list[str] = []
    take_changed_settings(changed, None, 3, 1e-3, said.append, on_resume)
    assert said == ["resumed with changed settings, taken from step 4 on: train.beta 0.1 -> 0.2"]


def test_every_key_of_the_recipe_configs_says_what_a_resume_does_with_its_change():
    """Refused, taken from the next step (said), kept by AdamW's state (refused), checked on its own, or free with
    the reason: a new key fails here until its field says which (resume=)."""
    from toolkit.config.keys import dotted_keys
    from toolkit.training import recipe_keys as s
    from toolkit.training.recipe_config import FinetuneConfig, PretrainConfig

    classified = [*s.REFUSED, *s.OWN_CHECK, *s.SCHEDULE, *s.FROM_NEXT_STEP, *s.KEPT_BY_THE_OPTIMIZER, *s.FREE]
    every = dotted_keys(PretrainConfig) | dotted_keys(FinetuneConfig)
    assert sorted(set(every) ^ set(classified)) == [] and len(classified) == len(set(classified))


@pytest.mark.parametrize("recipe", ["pretrain", "finetune"])
def test_a_resume_refuses_each_change_that_decides_the_tokens_the_ids_or_the_shape_and_takes_the_rest(recipe, tmp_path):
    """Walks every recorded key of a recipe's config: a checkpoint records each refused and taken one, a resume with
    another value of a refused one is one line naming it and what it decides, of a taken one is taken and said."""
    from toolkit.checkpoint.settings import check_same_settings, trained_settings
    from toolkit.config.load import load_config
    from toolkit.training import recipe_keys as s
    from toolkit.training.recipe_config import FinetuneConfig, PretrainConfig

    cls = PretrainConfig if recipe == "pretrain" else FinetuneConfig
    saved = trained_settings(load_config(cls, None, []))
    present = {k for k in [*s.REFUSED, *s.SCHEDULE, *s.FROM_NEXT_STEP, *s.KEPT_BY_THE_OPTIMIZER]
               if k not in ("train.gamma", "train.orpo_lambda") and (k.split(".")[0] != "adapter" or recipe == "finetune")}
    present -= {k for k in present if k.startswith("tokenizer.")} if recipe == "finetune" else set()
    present -= {k for k in present if k in ("train.objective", "train.beta", "model.path", "model.gguf_file", "model.new_tokens",
                                            "model.dtype", "data.format", "data.overlong", "data.chat_template", "data.append_stop",
                                            "data.record_format", "data.val_path") or k.startswith("data.columns")
                or k.startswith("forgetting.")
                } if recipe == "pretrain" else {"model.model_type", "model.config"}
    assert sorted(saved) == sorted(present)
    TrainerState(step=3, seed=1, settings=saved).write(tmp_path)
    for key, value in saved.items():
        other = {**saved, key: f"{value}-other"}
        if key in s.REFUSED:
            with pytest.raises(UserError, match=rf"was trained with {re.escape(key)}=.* \(this run has .*-other: "
                                                rf"{re.escape(s.REFUSED[key])}\); a resume cannot take the change"):
                check_same_settings(Checkpoint.read(tmp_path), other, 10, s.ON_RESUME)
        elif key in s.KEPT_BY_THE_OPTIMIZER:
            with pytest.raises(UserError, match=rf"{re.escape(key)}=.*AdamW's saved state carries them"):
                check_same_settings(Checkpoint.read(tmp_path), other, 10, s.ON_RESUME)
        else:
            assert check_same_settings(Checkpoint.read(tmp_path), other, 10, s.ON_RESUME) == {key: (value, f"{value}-other")}
    assert check_same_settings(Checkpoint.read(tmp_path), {**saved, "data.cache_dir": "elsewhere"}, 10, s.ON_RESUME) == {}  # free, not recorded
    # a null setting (the embedded corpus) is said as a user writes it back: it was "(empty)"
    with pytest.raises(UserError, match=r"was trained with data.path=null \(this run has b.txt: "):
        check_same_settings(Checkpoint.read(tmp_path), {**saved, "data.path": "b.txt"}, 10, s.ON_RESUME)


def test_a_path_is_recorded_as_the_file_it_names_wherever_the_run_is_launched_from(tmp_path, monkeypatch):
    from toolkit.checkpoint.settings import trained_settings
    from toolkit.config.load import load_config
    from toolkit.training.recipe_config import PretrainConfig

    (tmp_path / "corpus.txt").write_text("text\n")
    monkeypatch.chdir(tmp_path)
    here = trained_settings(load_config(PretrainConfig, None, ["data.path=corpus.txt"]))
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path / "sub")
    assert trained_settings(load_config(PretrainConfig, None, ["data.path=../corpus.txt"]))["data.path"] == here["data.path"]
