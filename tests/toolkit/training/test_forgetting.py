"""The forgetting budget's rule, its verdicts over a run and the config lines that refuse what it cannot hold."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from toolkit.config.errors import ConfigError, UserError
from toolkit.config.load import load_config
from toolkit.data.mixture import MixtureSchedule
from toolkit.training.forgetting import MAX_SHARE, Budget, ForgettingConfig, next_share, weights_at
from toolkit.training.recipe_config import FinetuneConfig

CONFIG = Path(__file__).resolve().parents[3] / "recipes" / "configs" / "finetune_smollm2_lora.yaml"
MIXED = ["data.sources=[{name: docs, weight: 0.8}, {name: general, path: /tmp/general.txt, weight: 0.2}]",
         "eval.every=10"]


def test_the_share_rises_near_the_budget_and_falls_with_room():
    assert next_share(0.2, 0.05, 0.05) == 0.45  # the whole budget used: up by GAIN x (1 - 0.5)
    assert next_share(0.2, 0.025, 0.05) == 0.2  # half of it: where the rule aims, no move
    assert next_share(0.2, 0.0, 0.05) == 0.0  # no rise at all: down by GAIN / 2, to the floor
    assert next_share(0.4, 0.01, 0.05) == 0.25  # room: down
    assert next_share(0.5, 0.5, 0.05) == 1.0 * MAX_SHARE  # far over: up by at most GAIN, never past MAX_SHARE
    assert next_share(0.1, -0.02, 0.05) == 0.0  # better than the base: never below 0
    assert next_share(0.3, 0.001, 0.0) == 0.8 and next_share(0.3, 0.0, 0.0) == 0.05  # a budget of 0: any rise is over
    for share in np.linspace(0, 0.9, 10):  # in hundredths, so that every rank and a resume hold the same number
        for change in (-0.1, 0.0, 0.01, 0.04, 0.2):
            s = next_share(float(share), change, 0.05)
            assert 0 <= s <= MAX_SHARE and s == round(s, 2)


def test_weights_keep_the_other_sources_proportions():
    assert weights_at([0.6, 0.2, 0.2], 2, 0.5) == pytest.approx([0.375, 0.125, 0.5])
    assert weights_at([0.0, 1.0], 1, 0.3) == pytest.approx([0.7, 0.3])  # only the general had weight


def judged_run(cfg: ForgettingConfig, evals: list[tuple[int, float, float]]) -> tuple[Budget, list]:
    """A mixture of docs and general judged over `evals` (step, docs loss, general loss); the base's first."""
    budget = Budget(cfg, ["docs", "general"], [(0, [0.8, 0.2])])
    verdicts = []
    for i, (step, docs, general) in enumerate(evals):
        result = {"eval_loss": (docs + general) / 2, "eval_loss/docs": docs, "eval_tokens/docs": 100,
                  "eval_loss/general": general, "eval_tokens/general": 100}
        phase = "before" if i == 0 else "after" if i == len(evals) - 1 else "train"
        verdicts.append(budget.judge(step, phase, result))
    return budget, verdicts


def test_a_run_is_held_to_its_budget_by_replay_selection_and_patience():
    cfg = ForgettingConfig(general="general", budget=0.05, patience=2)
    budget, v = judged_run(cfg, [(0, 3.0, 2.0), (10, 2.8, 2.06), (20, 2.6, 2.2), (30, 2.5, 2.15), (40, 2.9, 2.05)])
    assert [x.keep for x in v] == [False, True, False, False, False]  # 20 and 30 are over 2.1, 40 is no better
    assert [x.end for x in v] == [False, False, False, True, False]  # two evaluations without a better one in budget
    assert [x.row["within"] for x in v] == [True, True, False, False, True]
    assert [x.row["best_step"] for x in v] == [None, 10, 10, 10, 10]
    assert v[1].row["general_change"] == pytest.approx(0.03) and v[1].row["general_limit"] == pytest.approx(2.1)
    assert v[0].row["domain_loss"] == 3.0 and v[1].row["domain_loss"] == 2.8  # the general source left out
    # replay: 0.2 -> +0.03 of 0.05 moves it up 0.05, then +0.1 and +0.075, over: up by GAIN, to MAX_SHARE at most;
    # never at the end ("after")
    assert [x.row["share"] for x in v] == [0.2, 0.25, 0.75, 0.9, 0.9]
    assert budget.state["decisions"] == [[10, 0.25], [20, 0.75], [30, 0.9]]
    plan = v[3].plan
    assert plan[0] == (0, [0.8, 0.2]) and plan[1][0] == 10 and plan[-1][1] == pytest.approx([0.1, 0.9])
    assert budget.selected(40) == 10 and budget.selected(10) is None
    rows = {name: after for name, _, after in budget.rows({}, {}, 40)}
    assert rows["domain gain"] == "+6.7%" and rows["general change (budget +5%)"] == "+3.00%"
    assert rows["kept"] == "step 10 of 40"
    # a resume continues from the saved state: the same plan, the same next verdicts
    saved = json.loads(json.dumps(budget.state))
    again = Budget(cfg, ["docs", "general"], [(0, [0.8, 0.2])])
    schedule = MixtureSchedule([50, 50], [(0, [0.8, 0.2])], ["docs", "general"], 10, 5, 1, 0, 1234)
    assert again.restore(saved, schedule) == budget.state and again.plan() == budget.plan()
    assert [int(schedule.counts(step)[1]) for step in (9, 30)] == [2, 9]  # the base's share, then the last decision's
    assert int(schedule.counts(10)[1]) in (2, 3) and int(schedule.counts(20)[1]) in (7, 8)  # 2.5 and 7.5 blocks


def test_without_a_budget_the_general_loss_is_reported_and_nothing_acts():
    budget, v = judged_run(ForgettingConfig(general="general"), [(0, 3.0, 2.0), (10, 2.0, 3.0), (20, 1.5, 3.5)])
    assert not any(x.keep or x.end or x.plan for x in v) and budget.state["decisions"] == []
    assert [x.row["general_limit"] for x in v] == [None, None, None] and v[-1].row["general_change"] == 0.75
    assert budget.selected(20) is None
    assert dict((n, a) for n, _, a in budget.rows({}, {}, 20))["general change"] == "+75.00%"


def test_nothing_within_the_budget_keeps_the_last_step_and_says_so():
    budget, v = judged_run(ForgettingConfig(general="general", budget=0.01, patience=0),
                           [(0, 3.0, 2.0), (10, 2.5, 2.5), (20, 2.0, 3.0)])
    assert not any(x.keep for x in v) and budget.selected(20) is None
    rows = {n: a for n, _, a in budget.rows({}, {}, 20)}
    assert rows["kept"] == "step 20 (none within)" and rows["general change (budget +1%)"] == "+50.00% over"


def test_the_harness_budget_is_judged_in_the_end_table():
    cfg = ForgettingConfig(general="general", budget=0.05, harness_points=2)
    budget, _ = judged_run(cfg, [(0, 3.0, 2.0), (10, 2.8, 2.0)])
    rows = {n: a for n, _, a in budget.rows({"harness/arc/acc": 0.50, "harness/piqa/acc": 0.60},
                                            {"harness/arc/acc": 0.49, "harness/piqa/acc": 0.55}, 10)}
    assert rows["general change: arc/acc (budget -2 points)"] == "-1.0 points"
    assert rows["general change: piqa/acc (budget -2 points)"] == "-5.0 points over"


def test_a_reweighed_mixture_draws_the_steps_before_its_change_as_it_did():
    plan = [(0, [0.8, 0.2])]
    fixed = MixtureSchedule([50, 50], plan, ["docs", "general"], 10, 5, 1, 0, 1234)
    moved = MixtureSchedule([50, 50], plan, ["docs", "general"], 10, 5, 1, 0, 1234)
    moved.reweigh([(0, [0.8, 0.2]), (4, weights_at([0.8, 0.2], 1, 0.6))])
    for step in range(4):
        assert np.array_equal(fixed.global_indices(step), moved.global_indices(step))
    assert list(moved.counts(4)) == [4, 6] and list(fixed.counts(4)) == [8, 2]
    assert moved.plan == plan  # what a checkpoint records and a resume checks: the configured plan


@pytest.mark.parametrize(("overrides", "said"), [
    (["forgetting.budget=0.05"], "forgetting.budget=0.05 bounds the loss of a general held-out set, and there is none"),
    (["forgetting.general=/tmp/g.txt", "forgetting.budget=-0.1", "eval.every=5"], "forgetting.budget=-0.1 must be >= 0"),
    (["forgetting.general=/tmp/g.txt", "forgetting.patience=-1"], "forgetting.patience=-1 must be >= 0"),
    (["forgetting.general=/tmp/g.txt", "forgetting.budget=0.05", "eval.every=0"],
     "and eval.every=0 evaluates only at the end"),
    (["forgetting.general=/tmp/g.txt", "forgetting.budget=0.05", "eval.every=5", "data.val_fraction=0"],
     "data.val_fraction=0 holds none out"),
    (["forgetting.general=/tmp/g.txt", "data.path=/tmp/g.txt"], "is training data too"),
    ([*MIXED, "forgetting.general=/tmp/general.txt"], "is training data too"),
    ([*MIXED, "forgetting.general=genral"], "forgetting.general=genral is neither a data.sources name (docs, general)"),
    ([*MIXED, "forgetting.general=/tmp/other.txt"], "the name of a data source; name the source something else"),
    ([*MIXED, "forgetting.general=general", "forgetting.budget=0.05",
      "data.stages=[{start_step: 5, weights: {docs: 0.5}}]"], "drop data.stages, or set forgetting.replay=false"),
    (["data.sources=[{name: general, path: /tmp/general.txt}]", "forgetting.general=general"],
     "is the only data source"),
    (["forgetting.general=/tmp/g.txt", "forgetting.harness_points=2"], "forgetting.harness_points=2.0 is part of the budget"),
    (["forgetting.general=/tmp/g.txt", "data.format=preference", "train.objective=dpo"],
     "train.objective's preference loss is not one"),
])
def test_a_budget_it_cannot_hold_is_one_line_before_the_model_loads(overrides, said):
    with pytest.raises(ConfigError) as caught:
        load_config(FinetuneConfig, CONFIG, overrides)
    assert said in str(caught.value)


def test_a_budget_it_can_hold_loads():
    cfg = load_config(FinetuneConfig, CONFIG, [*MIXED, "forgetting.general=general", "forgetting.budget=0.05"])
    assert cfg.forgetting.budget == 0.05 and cfg.forgetting.select and cfg.forgetting.patience == 3
    assert Budget.of(cfg, ["docs", "general"], [(0, [0.8, 0.2])]).replays
    assert Budget.of(load_config(FinetuneConfig, CONFIG, []), [], None) is None


def test_a_general_set_that_shares_a_file_with_the_training_data_is_refused(tmp_path):
    (tmp_path / "train.txt").write_text("domain\n")
    (tmp_path / "general.txt").write_text("general\n")
    for general, data in ((f"{tmp_path}/*.txt", f"{tmp_path}/train.txt"), (f"{tmp_path}/general.txt", f"{tmp_path}/*.txt"),
                          (str(tmp_path), f"{tmp_path}/train.txt")):
        with pytest.raises(ConfigError, match="is training data too"):
            load_config(FinetuneConfig, CONFIG, [f"data.path={data}", f"forgetting.general={general}"])
    load_config(FinetuneConfig, CONFIG, [f"data.path={tmp_path}/train.txt", f"forgetting.general={tmp_path}/g*.txt"])
    for missing, said in ((f"{tmp_path}/nope.txt", "does not exist; give a file"),
                          (f"{tmp_path}/*.md", "does not exist (no file matches the pattern)")):
        with pytest.raises(ConfigError, match=re.escape(said)):  # before the base loads, not after
            load_config(FinetuneConfig, CONFIG, [f"forgetting.general={missing}"])
    load_config(FinetuneConfig, CONFIG, ["forgetting.general=org/english-text"])  # a hub id: read once the base loads


def test_a_source_name_is_recorded_as_a_name_where_a_folder_has_it_too(tmp_path, monkeypatch):
    from toolkit.checkpoint.settings import trained_settings

    monkeypatch.chdir(tmp_path)
    (tmp_path / "general").mkdir()  # a folder of the launch's: forgetting.general=general is still the source
    cfg = load_config(FinetuneConfig, CONFIG, [*MIXED, "forgetting.general=general"])
    assert trained_settings(cfg)["forgetting.general"] == "general"


def test_only_the_general_source_with_weight_is_refused():
    with pytest.raises(ConfigError, match="is the only data source with weight"):
        load_config(FinetuneConfig, CONFIG, ["data.sources=[{name: docs, weight: 0}, {name: general, path: /tmp/g.txt}]",
                                             "forgetting.general=general"])


def test_the_end_says_a_result_that_is_not_what_a_budget_is_for():
    budget, _ = judged_run(ForgettingConfig(general="general", budget=0.01), [(0, 3.0, 2.0), (10, 2.9, 2.5)])
    assert budget.warnings(10) == ["warning: no evaluation was within forgetting.budget=0.01 (the general loss rose "
                                   "+25.00% by step 10): the result is the last step's; lower optim.lr, raise the "
                                   "general data's weight, or loosen the budget"]
    budget, _ = judged_run(ForgettingConfig(general="general", budget=0.05), [(0, 3.0, 2.0), (10, 3.1, 2.0)])
    assert "has gained nothing on the domain (3.1000 against the base's 3.0000)" in budget.warnings(10)[0]
    budget, _ = judged_run(ForgettingConfig(general="general", budget=0.05), [(0, 3.0, 2.0), (10, 2.9, 2.0)])
    assert budget.warnings(10) == [] and budget.result(10, 999) == (10, 999)


def test_a_kept_step_is_the_result_the_cards_describe():
    budget, _ = judged_run(ForgettingConfig(general="general", budget=0.05),
                           [(0, 3.0, 2.0), (10, 2.8, 2.0), (20, 2.9, 2.0)])
    assert budget.result(20, 2000) == (10, 0)  # judged_run trains no tokens: the kept step's count
    budget.state["gone"] = True  # its checkpoint deleted by hand: the last step is the result, and the table says so
    assert budget.result(20, 2000) == (20, 2000) and dict((n, a) for n, _, a in budget.rows({}, {}, 20))["kept"] == "step 20"


def test_patience_ends_a_resumed_run_until_it_is_raised():
    cfg = ForgettingConfig(general="general", budget=0.05, patience=1)
    budget, v = judged_run(cfg, [(0, 3.0, 2.0), (10, 2.8, 2.0), (20, 2.9, 2.0), (30, 2.9, 2.0)])
    assert v[2].end and budget.state["ended"] == 20
    saved = json.loads(json.dumps(budget.state))
    schedule = MixtureSchedule([50, 50], [(0, [0.8, 0.2])], ["docs", "general"], 10, 5, 1, 0, 1234)
    again = Budget(cfg, ["docs", "general"], [(0, [0.8, 0.2])])
    again.restore(saved, schedule)
    assert "the run ended at step 20: forgetting.patience=1 evaluations" in again.ended_said()
    raised = Budget(ForgettingConfig(general="general", budget=0.05, patience=3), ["docs", "general"], [(0, [0.8, 0.2])])
    raised.restore(json.loads(json.dumps(saved)), schedule)
    assert raised.ended_said() is None and raised.state["ended"] is None  # it trains on


def test_replay_decisions_stay_in_force_when_a_resume_drops_the_budget():
    budget, _ = judged_run(ForgettingConfig(general="general", budget=0.05),
                           [(0, 3.0, 2.0), (10, 2.8, 2.2), (20, 2.8, 2.2)])
    assert budget.state["decisions"] == [[10, 0.7]]
    unheld = Budget(ForgettingConfig(general="general"), ["docs", "general"], [(0, [0.8, 0.2])])
    schedule = MixtureSchedule([50, 50], [(0, [0.8, 0.2])], ["docs", "general"], 10, 5, 1, 0, 1234)
    unheld.restore(json.loads(json.dumps(budget.state)), schedule)
    assert int(schedule.counts(11)[1]) == 7  # the share the run was drawing: the data order it trained with goes on


def test_a_budget_set_on_a_resume_replays_from_the_configured_share_and_one_without_a_base_is_refused():
    reported, _ = judged_run(ForgettingConfig(general="general"), [(0, 3.0, 2.0), (10, 2.8, 2.2)])
    assert reported.state["share"] is None  # no budget, no replay
    held = Budget(ForgettingConfig(general="general", budget=0.05), ["docs", "general"], [(0, [0.8, 0.2])])
    schedule = MixtureSchedule([50, 50], [(0, [0.8, 0.2])], ["docs", "general"], 10, 5, 1, 0, 1234)
    held.restore(json.loads(json.dumps(reported.state)), schedule)
    assert held.state["share"] == 0.2 and held.state["general_base"] == 2.0
    with pytest.raises(UserError, match="trained without forgetting.general"):  # a checkpoint from before the feature
        Budget(ForgettingConfig(general="general"), ["docs", "general"], [(0, [0.8, 0.2])]).restore({}, schedule)
